"""CacheState: everything the ``importance`` policy keeps for one SGLang cache.

The runtime (``runtime.py``) builds one per tree core when SGLang asks for the
``importance`` eviction strategy, and hands it to that strategy; the cache layer's
hooks reach it from the cache they were given (``state_of.state_of``), scheduler-side
code from the runtime (``Runtime.cache_state``). It holds:

- ``config``: the policy's ``--radix-eviction-policy-config``;
- ``aggregator``: the fold of the page importance table into node importance, and its scale;
- ``turnover``: KV tokens the tree inserted, by access tick (the ``credit`` form's clock);
- ``admission``: the L3 admission rule; ``warm``: the prefetch's warm candidates;
  ``stored``: the importance of pages dropped to the storage tier;
- what the runtime shares with it: the process's metrics, and, read
  through the runtime when needed (they come later than the cache), the scheduler
  and the shared importance; the prefill adder of the batch being built (a weak
  reference, set by its hook).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from sgl_importance.cache.admission import StorageAdmission
from sgl_importance.cache.prefetch import WarmIndex
from sgl_importance.cache.stored import StoredImportance
from sgl_importance.importance.aggregator import ImportanceAggregator
from sgl_importance.importance.priority import ImportancePolicyConfig
from sgl_importance.importance.turnover import TurnoverClock
from sgl_importance.metrics import Metrics

if TYPE_CHECKING:
    from sgl_importance.sglang_types.scheduler import PrefillAdder, Scheduler
    from sgl_importance.storage.shared_importance import SharedImportance


class CacheState:
    """The ``importance`` policy's state for one cache (see the module docstring).

    Args:
        config: the strategy's keywords (``ImportancePolicyConfig.from_mapping``).
        metrics: the process's series (``Metrics``).
        scheduler: the process's scheduler, or None before it is built (or in a test).
        shared: the importance shared through a Mooncake store (``storage/``), or None.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        metrics: Optional[Metrics] = None,
        *,
        scheduler: Callable[[], Optional[Scheduler]] = lambda: None,
        shared: Callable[[], Optional[SharedImportance]] = lambda: None,
    ) -> None:
        self.config = ImportancePolicyConfig.from_mapping(config)
        c = self.config
        self.aggregator = ImportanceAggregator(decay=c.decay, sink_pages=c.sink_pages)
        # Recorded by the FULL component at each new leaf (cache/components.py).
        self.turnover = TurnoverClock()
        self.admission = StorageAdmission(min_hits=c.storage_min_hits, min_importance=float(c.storage_min_importance))
        # Nodes demoted while important: what the prefetch warms back.
        self.warm = WarmIndex()
        # Importance of pages dropped to the storage tier, for the nodes rebuilt from it.
        self.stored = StoredImportance(shared=shared)
        self.metrics = metrics if metrics is not None else Metrics()
        self._scheduler = scheduler
        self._shared = shared
        self._adder: Optional[weakref.ref[PrefillAdder]] = None

    @property
    def scheduler(self) -> Optional[Scheduler]:
        """The scheduler of this process (None before it is built, or in a test)."""
        return self._scheduler()

    @property
    def shared(self) -> Optional[SharedImportance]:
        """Importance shared through a Mooncake store, None without one."""
        return self._shared()

    def note_adder(self, adder: PrefillAdder) -> None:
        """The prefill adder of the batch being built (its memory budget)."""
        self._adder = weakref.ref(adder)

    def take_adder(self) -> Optional[PrefillAdder]:
        """The noted adder, once: it belongs to the batch whose load-back starts next."""
        ref, self._adder = self._adder, None
        return ref() if ref is not None else None
