"""The scheduler process's runtime: the one owner of the plugin's state.

SGLang runs one scheduler per process (per tensor-parallel rank); everything the
plugin keeps across calls in that process lives on its :class:`Runtime` — the page
table, each cache's ``CachePolicy``, the shared importance, the storage grading,
the hot set's release record and per-request parameters, the metrics and the
tracing. ``plugin.py`` builds it before ``Scheduler.__init__`` runs (from the
validated ``--importance-*`` flags), attaches the scheduler after, and passes the
parts each hook needs into it: the owner of state is passed in, never found.

:func:`current` is the one accessor (the registry below is the only module-level
state of the package; ``tools/state.py`` checks it). Outside a scheduler process
(tests, tools) it builds a runtime with default settings on first use.

May import any layer below it (``importance/``, ``cache/``, ``hot_set/``,
``trace/``, ``metrics``, ``config``); ``attention/``, ``scheduler/`` and
``plugin.py`` import it, never the other way round.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Mapping, Optional

from sgl_importance.cache.policy import CachePolicy
from sgl_importance.cache.strategy import ImportanceStrategy
from sgl_importance.config import ImportanceConfig, config_of
from sgl_importance.hot_set.release import RELEASED, Released
from sgl_importance.hot_set.request_params import REQUEST_PARAMS, RequestParams
from sgl_importance.importance.page_table import PageTables
from sgl_importance.metrics import Metrics
from sgl_importance.trace.tracing import Tracing

logger = logging.getLogger(__name__)


class Runtime:
    """Everything the plugin keeps in one scheduler process.

    Args:
        config: the validated ``--importance-*`` flags (defaults when None).
    """

    def __init__(self, config: Optional[ImportanceConfig] = None) -> None:
        self.config = config if config is not None else ImportanceConfig()
        self.page_tables = PageTables()
        self.metrics = Metrics()
        # One per cache under --radix-eviction-policy importance (SGLang builds one).
        self.policies: list[CachePolicy] = []
        self.released: Released = RELEASED
        self.request_params: RequestParams = REQUEST_PARAMS
        self.tracing = Tracing()
        self._scheduler: Optional[weakref.ref] = None

    @property
    def scheduler(self) -> Any:
        """The process's scheduler, None before it is built (and in tests)."""
        return self._scheduler() if self._scheduler is not None else None

    def eviction_strategy(self, **config: Any) -> ImportanceStrategy:
        """SGLang's factory for ``--radix-eviction-policy importance``: a strategy over a
        new ``CachePolicy`` this runtime owns."""
        return ImportanceStrategy(self.cache_policy(config))

    def cache_policy(self, config: Mapping[str, Any]) -> CachePolicy:
        """A new cache's policy state, sharing this runtime's page tables and metrics."""
        policy = CachePolicy(config, self.page_tables, self.metrics)
        policy.scheduler = self.scheduler
        self.policies.append(policy)
        return policy

    def attach_scheduler(self, scheduler: Any) -> None:
        """After ``Scheduler.__init__``: the caches are built; hand them the scheduler."""
        self._scheduler = weakref.ref(scheduler)
        for policy in self.policies:
            policy.scheduler = scheduler


# The registry: the process's runtime (see the module docstring).
_current: Optional[Runtime] = None


def current() -> Runtime:
    """The process's runtime, built with default settings if no scheduler started one."""
    global _current
    if _current is None:
        _current = Runtime()
    return _current


def start(scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> Runtime:
    """Before ``Scheduler.__init__(server_args, ...)``: a fresh runtime from the flags."""
    global _current
    _current = Runtime(config_of(server_args))
    return _current


def reset() -> None:
    """Forget the process's runtime (tests)."""
    global _current
    _current = None
