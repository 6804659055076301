"""The adapter for SGLang's ``mooncake`` storage backend under the sealing wrapper, and its launcher check.

SGLang's ``MooncakeStore`` is zero-copy: its ``get``/``set`` take host-pool
pointers and store each page as two objects (``<key>_<rank>_k``, ``_v``). The
sealing wrapper (``wrapper.py``) needs to store a *sealed* page — the bytes
plus a trailer — under one key, and to read it back whole to verify it.
:class:`MooncakePages` gives the wrapper exactly that over the store client
SGLang already set up (``backend.store``, a ``MooncakeDistributedStore``): one
object per page, ``<model prefix>_<page hash>_<rank>_p``, written with
``put`` and read with ``get`` (one copy each way, which the checksum needs anyway).
The model prefix is SGLang's (``config_prefix``: ``extra_backend_tag`` and the
model path), so instances share pages exactly when SGLang would let them.

Failures are the wrapper's business: a read that raises or comes back short is a
miss, a write that fails counts toward its write breaker. With the master gone,
Mooncake's client answers each call with an error after a few seconds; nothing
here blocks the scheduler (SGLang calls storage from its I/O threads).

:func:`check_client` and :func:`check_master` (run by the factory's launcher check)
refuse to start a server whose Mooncake cannot be imported or whose master is
unreachable, in one line, before any model loads.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from sgl_importance.env import MOONCAKE_CLIENT_ENV, MOONCAKE_CONFIG_PATH_ENV, MOONCAKE_MASTER_ENV
from sgl_importance.storage.wrapper import BackendOps

if TYPE_CHECKING:
    from sgl_importance.metrics import Metrics
    from sgl_importance.sglang_types.tree import HostPool
    from sgl_importance.storage.shared_importance import SharedImportance

logger = logging.getLogger(__name__)

PAGE_SUFFIX = "p"
CONNECT_TIMEOUT_S = 3.0


class MooncakePages(HiCacheStorage):
    """Whole pages (sealed by the wrapper) in Mooncake Store, one object each.

    Args:
        backend: SGLang's ``MooncakeStore`` (set up; its ``store`` is the client).
        rank: the tensor-parallel rank (pages of different ranks hold different heads).
    """

    def __init__(self, backend: Any, rank: int = 0, shared: Optional[SharedImportance] = None) -> None:
        self.backend = backend
        # SharedImportance: its records are read with the hit query, before the pages.
        self.shared = shared
        self.store = backend.store
        prefix = backend.config_prefix  # None without a model name or backend tag
        self.prefix = f"{prefix}_" if prefix else ""
        self.rank = rank

    def key_of(self, key: str) -> str:
        """The store key of a page hash (without the per-rank suffix)."""
        return f"{self.prefix}{key}"

    def _object(self, key: str) -> str:
        return f"{self.prefix}{key}_{self.rank}_{PAGE_SUFFIX}"

    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: HostPool, host_pool_name: str) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def get(
        self, key: str, target_location: Optional[torch.Tensor] = None, target_sizes: Any = None
    ) -> Optional[torch.Tensor]:
        data = self.store.get(self._object(key))
        if not data:
            return None  # absent (evicted by the store, or never written)
        out = target_location.view(torch.uint8).reshape(-1).numpy()
        n = min(len(data), out.nbytes)
        out[:n] = np.frombuffer(data, dtype=np.uint8, count=n)
        if n < out.nbytes:
            out[n:] = 0  # short object: the wrapper's trailer check refuses it
        return target_location

    def set(
        self, key: str, value: Optional[torch.Tensor] = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        name = self._object(key)
        rc = self.store.put(name, value.contiguous().view(torch.uint8).reshape(-1).numpy())
        # Another instance may have written the same page first: that is a success.
        return rc == 0 or self.store.is_exist(name) == 1

    def batch_get(
        self, keys: List[str], target_locations: Optional[List[torch.Tensor]] = None, target_sizes: Any = None
    ) -> List[Optional[torch.Tensor]]:
        return [self.get(k, t) for k, t in zip(keys, target_locations)]

    def batch_set(
        self,
        keys: List[str],
        values: Optional[List[torch.Tensor]] = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return all(self.set(k, v) for k, v in zip(keys, values))

    def exists(self, key: str) -> bool:
        return self.store.is_exist(self._object(key)) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """Pages present from the start of ``keys`` (storage is read as a prefix)."""
        if not keys:
            return 0
        flags = self.store.batch_is_exist([self._object(k) for k in keys])
        found = len(keys)
        for i, flag in enumerate(flags):
            if flag != 1:
                found = i
                break
        if found and self.shared is not None:
            # Same I/O thread, one more batched call: the nodes SGLang is about to
            # build from these pages find their importance already here.
            self.shared.fetch(keys[:found])
        return found

    def read_object(self, key: str) -> Optional[bytes]:
        """The whole stored object of a page (any length), or None when absent."""
        data = self.store.get(self._object(key))
        return data if data else None

    def drop(self, key: str) -> None:
        """Remove a damaged page so the next write stores a good copy."""
        rc = self.store.remove(self._object(key))
        if rc not in (0, None):
            raise OSError(f"mooncake remove returned {rc}")

    def clear(self) -> None:
        # SGLang's own behaviour (its admin endpoint only): the store is shared, so
        # this drops every instance's pages, not just this server's.
        self.backend.clear()

    def get_stats(self) -> None:
        return None

    def close(self) -> None:
        if self.shared is not None:
            self.shared.stop()

    def __getattr__(self, name: str) -> Any:
        # Anything else SGLang reads off its backend (config, flags) is the backend's.
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)


def mooncake_ops(pages: MooncakePages) -> BackendOps:
    return BackendOps(where=lambda key: f"mooncake:{pages._object(key)}", drop=pages.drop, read=pages.read_object)


def master_address(extra_config: Optional[dict]) -> Optional[str]:
    """The master a server will use, by SGLang's precedence (extra config, then env)."""
    extra = extra_config or {}
    if extra.get("master_server_address"):
        return str(extra["master_server_address"])
    return os.environ.get(MOONCAKE_MASTER_ENV) or None


def check_master(address: Optional[str]) -> None:
    """Refuse a master that is unset or does not accept a TCP connection.

    Raises:
        ValueError: one line naming the address and the reason.
    """
    if os.environ.get(MOONCAKE_CONFIG_PATH_ENV) or os.environ.get(MOONCAKE_CLIENT_ENV):
        return  # configured another way (config file, standalone client): SGLang checks it
    if not address:
        raise ValueError(
            f"--hicache-storage-backend mooncake: {MOONCAKE_MASTER_ENV} is not set (host:port of a "
            "mooncake_master); `make store` starts a local one and prints the variables"
        )
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as e:
        # strerror: an OSError's; a malformed port raises a ValueError, which has none.
        raise ValueError(
            f"--hicache-storage-backend mooncake: master {address} ({MOONCAKE_MASTER_ENV}) is unreachable "
            f"({getattr(e, 'strerror', None) or e}); start one (`make store`) or fix the address"
        ) from None


def check_client() -> None:
    """Refuse a Mooncake client that cannot be imported (a missing wheel or system library).

    Raises:
        ValueError: one line naming the import error and what installs the client.
    """
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        hint = "; install the Debian package libibverbs1" if "ibverbs" in str(e) else ""
        raise ValueError(
            f"--hicache-storage-backend mooncake: the Mooncake client cannot be imported ({e}{hint}); "
            "`make install` installs mooncake-transfer-engine-non-cuda"
        ) from None


def start_shared_importance(pages: MooncakePages, rank: int, metrics: Optional[Metrics] = None) -> SharedImportance:
    """Importance shared next to the pages of this store, started (the runtime calls it
    when the storage backend is built under ``--radix-eviction-policy importance``).

    Args:
        pages: the adapter; its reads fetch the records of the pages they find.
        rank: this scheduler's tensor-parallel rank (records are per rank).
        metrics: the process's ``metrics.Metrics`` with ``--enable-metrics``, else None.
    """
    from sgl_importance.storage import shared_importance

    count = metrics.shared({"tp_rank": rank}).count if metrics is not None else None
    writer = f"{socket.gethostname()}-{os.getpid()}-r{rank}"
    shared = shared_importance.SharedImportance(
        writer, key_of=lambda h: f"{pages.key_of(h)}_{rank}", store=pages.store, count=count
    )
    shared.start()
    pages.shared = shared
    logger.info("sgl-importance: page importance shared next to the pages in the store (as %s)", writer)
    return shared
