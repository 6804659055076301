"""The process's runtime: the one owner of the plugin's state.

SGLang runs one scheduler per process (per tensor-parallel rank); everything the
plugin keeps across calls in that process lives on its :class:`Runtime` — the
validated config, the hot set's parameters (worked out once), the page importance,
the state of the scheduler's cache under the ``importance`` policy, the shared
importance, the storage grading, the hot set's release registry, per-request
parameters and guard budget, the metrics and the tracing. ``plugin.py`` builds it
before ``Scheduler.__init__`` runs (from the validated ``--importance-*`` flags),
attaches the scheduler after, and passes the parts each hook needs into it: the
owner of state is passed in, never found. The HTTP process builds one too, before
``TokenizerManager.__init__``, for the request checks' config.

:func:`current` is the one accessor (the registry below is the only module-level
state of the package; ``tools/state.py`` checks it). Outside a server process
(tests, tools) it builds a runtime with default settings on first use.

May import any layer below it (``importance/``, ``cache/``, ``hot_set/``,
``trace/``, ``metrics``, ``config``); ``attention/``, ``scheduler/`` and
``plugin.py`` import it, never the other way round.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol

from sgl_importance.cache.state import CacheState
from sgl_importance.cache.state_of import state_of
from sgl_importance.cache.strategy import ImportanceStrategy
from sgl_importance.checks import ForwardCheck
from sgl_importance.config import ImportanceConfig, check_hot_set_backend, resolved_flag
from sgl_importance.env import DUMP_DIR_ENV
from sgl_importance.hot_set.params import HotSetParams, hot_set_params
from sgl_importance.hot_set.request_params import RequestParams
from sgl_importance.hot_set.residency import Residency
from sgl_importance.hot_set.table_budget import TableBudget
from sgl_importance.importance.page_importance import PageImportanceHolder
from sgl_importance.importance.priority import POLICY_NAME
from sgl_importance.metrics import Metrics
from sgl_importance.storage.factory import share_importance, wrap_backend
from sgl_importance.storage.precision import PageClasses, page_classes_for
from sgl_importance.trace.tracing import Tracing

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

    from sgl_importance.hot_set.decode import HotSetDecoder
    from sgl_importance.hot_set.graph.step import GraphStep
    from sgl_importance.hot_set.pages.rows import BorrowedPages
    from sgl_importance.hot_set.pages.state import PageMoves
    from sgl_importance.metrics import HotSetMetrics
    from sgl_importance.sglang_types.scheduler import Scheduler
    from sgl_importance.sglang_types.server import ServerArgs
    from sgl_importance.storage.shared_importance import SharedImportance

logger = logging.getLogger(__name__)


# Two of the runtime's parts are built by layers above it (attention/, scheduler/), which import
# this module: importing their classes here, even for typing only, would close a circle
# (tools/imports.py counts it), so they are named by what their readers use.


class BackendHotSet(Protocol):
    """The decode backend's hot set (``attention/hot_set_attention.HotSetAttention``): what
    the scheduler hooks and the graph variants read of it: the batch's step, not the
    decoder (``Runtime.hot_set_decoder``)."""

    stream_prefill: bool  # a long prompt's full pages leave the device as it prefills
    forward_stream: Optional[torch.cuda.Stream]  # the model runner's (CUDA); None on the CPU
    metrics: Optional[HotSetMetrics]  # None: --enable-metrics off
    graph: Optional[GraphStep]  # the captured hot-set step (--hot-set-graph-rows)

    def end_batch(self) -> Optional[PageMoves]: ...  # after a batch's forward: the page moves it wants

    def after_step(self) -> None: ...  # the gauges of what the rows and running requests hold


class HotSetLimits(Protocol):
    """What a hot-set server takes (``scheduler/long_requests.Limits``): what clipping a
    request's new tokens reads of it."""

    device_longest: int  # the longest request that keeps every page on the device
    device_tokens: int  # the device pool's tokens


class Runtime:
    """Everything the plugin keeps in one scheduler process.

    Args:
        config: the validated ``--importance-*`` flags (defaults when None).
        server_args: SGLang's server args (None outside a launched server).
    """

    def __init__(self, config: Optional[ImportanceConfig] = None, server_args: Optional[ServerArgs] = None) -> None:
        self.config = config if config is not None else ImportanceConfig()
        if server_args is not None:
            # The backend the platform chose where none was named (platform/attention_choice.py).
            decode = resolved_flag(server_args, "decode_attention_backend")
            check_hot_set_backend(self.config, decode or resolved_flag(server_args, "attention_backend"))
        # What of SGLang's flags the storage hook reads (defaults outside a server).
        self.eviction_policy = server_args.radix_eviction_policy if server_args is not None else None
        self.enable_metrics = bool(server_args.enable_metrics) if server_args is not None else False
        # The server's hot-set parameters, worked out once; None under --hot-set-policy off.
        self.hot_set_params: Optional[HotSetParams] = hot_set_params(self.config)
        self.page_importance = PageImportanceHolder()
        self.metrics = Metrics()
        # Where each hot-set request's pages live (the one owner of page moves), and the
        # parameters requests chose for themselves.
        self.residency = Residency()
        # The test suite's forward check (checks.py; its hooks are registered only under it).
        self.checks = ForwardCheck()
        self.request_params = RequestParams()
        # The page importance table and what the KV pool gave up for it, set when SGLang
        # sizes the KV pool (attention/table_reserve.reserve_table); None before.
        self.table_budget: Optional[TableBudget] = None
        # The KV pages lent to the hot set's rows (hot_set/pages/rows.py; built with the hot set).
        self.row_pages: Optional[BorrowedPages] = None
        # What a hot-set server takes (scheduler/long_requests.py); None: SGLang's own limits.
        self.limits: Optional[HotSetLimits] = None
        # The decode backend's hot set (attention/hot_set_attention.py): the batch's step, which the
        # scheduler ends (end_batch) and the graph variants read.
        self.hot_set_attention: Optional[BackendHotSet] = None
        # The hot set's decoder, built with the decode backend: what the scheduler's hooks ask of
        # the selection (pages wanted, rows, shrinking, a request's end), never through the backend.
        self.hot_set_decoder: Optional[HotSetDecoder] = None
        # Inside a decode forward on torch_cpu (platform/cpu_forwards.decode_forward): its matmuls in C.
        self.decode_forward = False
        self.tracing = Tracing(self.config)
        if self.tracing.requested:
            # The tracer sees every layer and step the page importance table records.
            self.page_importance.observer = self.tracing.capture
        # The storage grading under --importance-storage-precision graded (else None).
        c = self.config
        self.page_classes: Optional[PageClasses] = page_classes_for(
            c.storage_precision, c.storage_precision_thresholds()
        )
        # Importance shared next to the pages of a Mooncake store, once one is built.
        self.shared_importance: Optional[SharedImportance] = None
        # The state of the scheduler's tree cache under --radix-eviction-policy
        # importance, found once the scheduler is attached; None under other policies.
        self.cache_state: Optional[CacheState] = None
        self._scheduler: Optional[weakref.ref[Scheduler]] = None
        # Whether anything reads the page importance decode records: the importance policy,
        # the hot set, graded storage, the tracer, the table's dump; outside a server (tests,
        # tools) always. Without a reader the CPU decode skips it (attention/torch_backend.py).
        self.records_importance = server_args is None or (
            self.eviction_policy == POLICY_NAME
            or self.hot_set_params is not None
            or self.page_classes is not None
            or self.tracing.requested
            or bool(os.environ.get(DUMP_DIR_ENV))
        )

    @property
    def scheduler(self) -> Optional[Scheduler]:
        """The process's scheduler, None before it is built (and in tests)."""
        return self._scheduler() if self._scheduler is not None else None

    def eviction_strategy(self, **config: Any) -> ImportanceStrategy:
        """SGLang's factory for ``--radix-eviction-policy importance``: a strategy over a
        new ``CacheState`` this runtime owns."""
        return ImportanceStrategy(self.new_cache_state(config))

    def new_cache_state(self, config: Mapping[str, Any]) -> CacheState:
        """A new cache's state, sharing this runtime's metrics (the cache's strategy
        holds it; the cache layer's hooks find it with ``cache/state_of.state_of``)."""
        # The scheduler and the shared importance come after the cache: read when needed.
        return CacheState(
            config,
            self.metrics,
            scheduler=lambda: self.scheduler,
            shared=lambda: self.shared_importance,
        )

    def storage_backend(
        self,
        original: Callable[..., Any],
        factory: Any,
        backend_name: str,
        storage_config: HiCacheStorageConfig,
        mem_pool_host: Any,
        *args: Any,
        **kwargs: Any,
    ) -> HiCacheStorage:
        """Around ``StorageBackendFactory.create_backend`` (at start-up or attached later):
        SGLang's backend with its pages sealed (``storage/factory.py``) unless
        ``--importance-storage-integrity off``, and, over a Mooncake store under the
        ``importance`` policy, importance shared next to them."""
        backend = original(factory, backend_name, storage_config, mem_pool_host, *args, **kwargs)
        c = self.config
        if c.storage_integrity == "off":
            return backend
        metrics = self.metrics if self.enable_metrics else None
        backend = wrap_backend(
            backend,
            backend_name,
            storage_config,
            retry_s=c.storage_retry_s,
            metrics=metrics,
            precision=c.storage_precision,
            classes=self.page_classes,
        )
        self.shared_importance = share_importance(backend, storage_config.tp_rank, self.eviction_policy, metrics)
        return backend

    def attach_scheduler(self, scheduler: Scheduler) -> None:
        """After ``Scheduler.__init__``: the scheduler the caches' states read, and the
        state of its tree cache (the fold's)."""
        self._scheduler = weakref.ref(scheduler)
        self.cache_state = state_of(scheduler.tree_cache)


# The registry: the process's runtime (see the module docstring).
_current: Optional[Runtime] = None


def current() -> Runtime:
    """The process's runtime, built with default settings if no scheduler started one."""
    global _current
    if _current is None:
        _current = Runtime()
    return _current


def config_of(server_args: ServerArgs) -> ImportanceConfig:
    """The config a process was started with (defaults when built without the CLI):
    read here, once, as the runtime is built."""
    # Absent where ServerArgs was built without from_cli_args (the Engine API, tests).
    config = getattr(server_args, "_importance", None)
    return config if isinstance(config, ImportanceConfig) else ImportanceConfig()


def start(owner: Any, server_args: ServerArgs, *args: Any, **kwargs: Any) -> Runtime:
    """Before ``Scheduler.__init__(server_args, ...)`` (or ``TokenizerManager.__init__``
    in the HTTP process): a fresh runtime from the flags."""
    global _current
    _current = Runtime(config_of(server_args), server_args)
    return _current


def reset() -> None:
    """Forget the process's runtime (tests)."""
    global _current
    _current = None
