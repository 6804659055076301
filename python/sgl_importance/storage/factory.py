"""The storage factory: SGLang's backend, adapted by name and wrapped in the sealing wrapper.

The one place that picks an adapter by ``--hicache-storage-backend``: the ``file``
backend gets its directory operations (``file.py``), ``mooncake`` is replaced by
whole sealed pages in the same store (``mooncake.py``), any other backend is
sealed through its own ``get``/``set``. Two hooks call into this module: the one
around SGLang's ``StorageBackendFactory.create_backend`` and the launcher check
(``check_cli_args``, which runs the chosen adapter's own checks).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageFailureInjector

from sgl_importance.storage import file, mooncake
from sgl_importance.storage.breaker import MAX_WRITE_FAILURES, WriteBreaker
from sgl_importance.storage.precision import PageClasses, make_precision
from sgl_importance.storage.wrapper import BackendOps, IntegrityStorage

if TYPE_CHECKING:
    import argparse

    from sgl_importance.metrics import Metrics
    from sgl_importance.storage.shared_importance import SharedImportance

logger = logging.getLogger(__name__)


def extra_config(args: argparse.Namespace) -> Optional[dict]:
    """``--hicache-storage-backend-extra-config`` as a dict; None when it is unset or
    not a JSON object (SGLang reports a malformed value itself)."""
    extra = args.hicache_storage_backend_extra_config
    try:
        config = json.loads(extra) if extra else None
    except (TypeError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def check_cli_args(args: argparse.Namespace) -> None:
    """Launcher check of the chosen adapter's setting (``ServerArgs.from_cli_args``): the
    ``file`` backend's directory, the ``mooncake`` client and master; other backends check
    themselves."""
    if args.hicache_storage_backend == "file" and args.enable_hierarchical_cache:
        file.check_storage_dir(file.storage_dir(extra_config(args)))
    elif args.hicache_storage_backend == "mooncake":
        mooncake.check_client()
        mooncake.check_master(mooncake.master_address(extra_config(args)))


def adapt(
    backend: HiCacheStorage, backend_name: str, storage_config: HiCacheStorageConfig
) -> tuple[HiCacheStorage, BackendOps, str]:
    """The backend the wrapper stores through, its operations, and its location for the log.

    Args:
        backend: what ``StorageBackendFactory.create_backend`` returned.
        backend_name: ``--hicache-storage-backend``.
        storage_config: SGLang's ``HiCacheStorageConfig`` (ranks).
    """
    # The failure injector SGLang may put around the backend hides its attributes.
    concrete = backend._backend if isinstance(backend, HiCacheStorageFailureInjector) else backend
    if backend_name == "file" and hasattr(concrete, "file_path"):
        if storage_config.tp_rank == 0:
            file.remove_leftovers(concrete.file_path)
        return backend, file.file_ops(concrete), f"directory {concrete.file_path}"
    if backend_name == "mooncake" and hasattr(concrete, "store"):
        # Sealed pages need whole-object get/set; SGLang's zero-copy paths split
        # each page in two. Pages and their importance share the model prefix.
        pages = mooncake.MooncakePages(concrete, storage_config.tp_rank)
        return pages, mooncake.mooncake_ops(pages), f"mooncake master {concrete.config.master_server_address}"
    return backend, BackendOps(), f"backend {backend_name}"


def wrap_backend(
    backend: HiCacheStorage,
    backend_name: str,
    storage_config: HiCacheStorageConfig,
    *,
    retry_s: float,
    metrics: Optional[Metrics] = None,
    precision: str = "off",
    classes: Optional[PageClasses] = None,
) -> IntegrityStorage:
    """``backend`` as SGLang built it, sealed and verified (see ``wrapper.py``).

    Args:
        backend: what ``StorageBackendFactory.create_backend`` returned.
        backend_name: ``--hicache-storage-backend``.
        storage_config: SGLang's ``HiCacheStorageConfig`` (model, ranks).
        retry_s: seconds writes stay paused after repeated failures.
        metrics: the process's ``metrics.Metrics`` to count refused pages and pauses
            on ``/metrics``, None when SGLang's metrics are off.
        precision: ``--importance-storage-precision`` (off: pages at the model's dtype).
        classes: the process's page grading under ``graded`` (``precision.PageClasses``).
    """
    ranks = {"tp_rank": storage_config.tp_rank, "pp_rank": storage_config.pp_rank}
    identity = {
        "model": storage_config.model_name or "",
        "tp_size": storage_config.tp_size,
        "pp_size": storage_config.pp_size,
        **ranks,
    }
    backend, ops, describe = adapt(backend, backend_name, storage_config)
    if metrics is not None:
        metrics = metrics.storage(ranks)
    breaker = WriteBreaker(
        MAX_WRITE_FAILURES,
        retry_s,
        describe,
        on_pause=metrics.paused if metrics is not None else None,
    )
    logger.info("sgl-importance: storage tier pages are sealed and verified (%s)", describe)
    return IntegrityStorage(
        backend,
        identity,
        ops=ops,
        on_corrupt=metrics.corrupt if metrics is not None else None,
        breaker=breaker,
        precision=make_precision(precision, classes),
        on_page=metrics.page_of_class if metrics is not None else None,
    )


def share_importance(
    backend: HiCacheStorage, rank: int, policy: Optional[str], metrics: Optional[Metrics] = None
) -> Optional[SharedImportance]:
    """Importance shared next to the pages of ``backend`` (what ``wrap_backend``
    returned) when it stores in a Mooncake store under the ``importance`` eviction
    ``policy`` (no other policy reads importance), started; None otherwise."""
    pages = getattr(backend, "inner", None)
    if not isinstance(pages, mooncake.MooncakePages):
        return None
    if policy != "importance":
        logger.info("sgl-importance: page importance is not shared (policy %r)", policy)
        return None
    return mooncake.start_shared_importance(pages, rank, metrics)
