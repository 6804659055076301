"""The adapter for SGLang's ``file`` storage backend: its directory, its leftovers, its damaged pages.

``HiCacheFile`` writes each page to ``<dir>/.<uuid>.tmp`` and renames it to
``<dir>/<key><suffix>.bin``; it never rewrites a key that exists. Three things
it does not do, which the sealing wrapper (``wrapper.py``) needs:

- name the file of a key (for the one log line per damaged file),
- delete a damaged page so the next write stores a good copy,
- clean up ``.tmp`` files that a killed process left behind,
- read a page file whole, whatever its length (encoded pages are shorter than
  the host pool's page, and ``HiCacheFile.get`` reads exactly a page's bytes).

And one check at launch: the directory must be a directory (or creatable).
A path that is a regular file, or cannot be created, stops start-up with one
line naming the path and the reason; an existing directory that is not
writable is accepted (a read-only directory still serves its pages; writes pause).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from sgl_importance.env import FILE_STORAGE_DIR_ENV
from sgl_importance.storage.wrapper import BackendOps

logger = logging.getLogger(__name__)

DEFAULT_DIR = "/tmp/hicache"


def storage_dir(extra_config: Optional[dict]) -> str:
    """The directory ``HiCacheFile`` will use, by its own precedence."""
    return os.environ.get(FILE_STORAGE_DIR_ENV) or (extra_config or {}).get("file_storage_path") or DEFAULT_DIR


def check_storage_dir(path: str) -> None:
    """Refuse a path the ``file`` backend can never use; create a missing directory.

    Raises:
        ValueError: one line naming the directory and the reason.
    """
    if os.path.isdir(path):
        return
    if os.path.lexists(path):
        raise ValueError(
            f"--hicache-storage-backend file: storage directory {path!r} is not a directory "
            f"(a {'broken link' if os.path.islink(path) else 'regular file'} is there); "
            f"remove it or point {FILE_STORAGE_DIR_ENV} elsewhere"
        )
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--hicache-storage-backend file: storage directory {path!r} cannot be created "
            f"({e.strerror or e}); create it or point {FILE_STORAGE_DIR_ENV} elsewhere"
        ) from None


def remove_leftovers(path: str) -> int:
    """Delete ``.tmp`` files a killed writer left in ``path``; returns how many.

    A storage directory belongs to one server (SGLang's own ``clear`` deletes
    every file in it), so any ``.tmp`` present before this server writes is dead.
    """
    removed = 0
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    for name in names:
        if name.startswith(".") and name.endswith(".tmp"):
            try:
                os.remove(os.path.join(path, name))
                removed += 1
            except OSError:
                pass
    if removed:
        logger.warning("sgl-importance: removed %d unfinished page files left in %s", removed, path)
    return removed


def file_ops(backend: Any) -> BackendOps:
    """``BackendOps`` for a ``HiCacheFile`` (duck-typed on its attributes)."""
    directory = backend.file_path

    def path_of(key: str) -> str:
        return os.path.join(directory, f"{backend._get_suffixed_key(key)}.bin")

    def drop(key: str) -> None:
        suffixed = backend._get_suffixed_key(key)
        try:
            os.remove(path_of(key))
        except FileNotFoundError:
            pass
        # Forget it in the backend's bookkeeping so exists() says no and set() writes.
        backend._evictor.abort(suffixed)
        if backend.metadata_cache is not None:  # None unless enable_metadata_cache
            backend.metadata_cache.remove(suffixed)

    def prepare() -> None:
        # A directory removed while serving comes back when writes are retried.
        os.makedirs(directory, exist_ok=True)

    def read(key: str) -> Optional[bytearray]:
        suffixed = backend._get_suffixed_key(key)
        path = path_of(key)
        try:
            with open(path, "rb", buffering=0) as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)
        except FileNotFoundError:
            if backend.metadata_cache is not None:
                backend.metadata_cache.remove(suffixed)
            return None
        # As HiCacheFile.get does: a read refreshes the page's recency for eviction.
        backend._evictor.touch(suffixed, path)
        return data[:n] if n != len(data) else data

    return BackendOps(where=path_of, drop=drop, prepare=prepare, read=read)
