"""Eviction strategy ``importance``: attention decides which radix-tree leaves go first.

SGLang's device eviction (``FullComponent._evict_device_start``) and host eviction
(``drive_host_eviction``) pop the leaf with the smallest ``get_priority(node)``; this
strategy reads three O(1) node fields and hands them to the pure
``importance.priority.eviction_priority`` (the function the simulator's ``shipped``
policy replays), which blends:

- persistent importance (the node's ``NodeState.importance``, folded from the
  decode kernels' page importance by ``importance/aggregator.py``), normalised by
  the aggregator's running maximum to [0, 1];
- recency: ``exp(-age / recency_horizon)`` over SGLang's logical access clock
  (``node.last_access_time``);
- reuse: ``r / (r + 1)``, r = ``hit_count - 1`` (SGLang counts the inserting request
  as the node's first hit; the simulator counts re-reads only).

Under ``form: "credit"`` the order is instead LRU on the device pool's turnover (the
cache's ``TurnoverClock``) with reuse and importance credits.

Attention-sink nodes (``NodeState.pinned``) form a band evicted after all
others when ``pin_sinks`` is on. Ties fall back to ``last_access_time``, so with
``importance_weight=0, reuse_weight=0, pin_sinks=false`` the order is exactly LRU —
the A/B baseline inside the same code path (under ``credit``: ``reuse_credit=0,
pin_sinks=false``).

The strategy is SGLang's shape and nothing more: priorities. The cache's state (the
aggregator, L3 admission, the prefetch's candidates, stored importance) is a
``CacheState`` (``cache/state.py``) the runtime owns and hands in.
Configured through SGLang's ``--radix-eviction-policy-config`` JSON (the
strategy's constructor keywords, ``importance.priority.ImportancePolicyConfig``); an unknown key or
an out-of-range value fails at start-up naming the flag, the key, the value and the
allowed range.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from sgl_importance.cache.state import CacheState
from sgl_importance.importance.priority import (
    POLICY_NAME,
    PriorityWeights,
    eviction_priority,
    parse_policy_config,
)
from sgl_importance.node_state import node_importance, node_pinned

if TYPE_CHECKING:
    import argparse

    from sgl_importance.sglang_types.tree import TreeNode


class SGLangAccessClock:
    """The current value of SGLang's logical clock behind ``last_access_time``.

    The unified tree stamps nodes from a module-level counter; reading it (without
    advancing it) gives "now" on the same scale. The module is resolved once per
    clock: this runs per leaf.
    """

    def __init__(self) -> None:
        from sglang.srt.mem_cache.unified_cache.components import base

        self._base = base

    def __call__(self) -> float:
        return float(self._base._LAST_ACCESS_TIME_COUNTER_FLOAT)


class ImportanceStrategy(EvictionStrategy):
    """Importance-aware eviction (accumulated attention mass: H2O, Zhang et al.,
    arXiv:2306.14048; ArkVale, Chen et al., NeurIPS 2024; Quest, Tang et al.,
    arXiv:2406.10774).

    Pages that decoding attended heavily keep being attended, so the attention mass
    a radix node's pages accumulated over past steps and requests predicts its
    reuse better than its last access time. Leaves are evicted in increasing order
    of that normalised mass blended with recency and hit count; attention sinks last.

    ``get_priority`` reads only plain Python fields: three on the node, and the
    scale of the cache's aggregator (``state``, a ``CacheState``).

    Args:
        state: the cache's state, from the runtime (``Runtime.new_cache_state``).
            SGLang's own factory call (keywords only) builds a private one.
        **config: the policy's keywords, when no ``state`` is given.
    """

    def __init__(self, state: Optional[CacheState] = None, **config: Any) -> None:
        self.state = state if state is not None else CacheState(config)
        # Resolved once: get_priority runs once per evictable leaf per pass.
        self._weights = PriorityWeights.of(self.state.config)
        self._aggregator = self.state.aggregator
        self._turnover = self.state.turnover
        # "Now" on last_access_time's scale; tests substitute their own clock.
        self.clock: Callable[[], float] = SGLangAccessClock()

    def fresh_priority(self) -> tuple[int, float, float]:
        """The priority of a node inserted now, never attended nor hit: what every
        new request's KV gets. A node below it is evicted before any of those."""
        now = self.clock()
        return eviction_priority(self._weights, 0.0, False, now, 0, now, self._aggregator.scale)

    def get_priority(self, node: TreeNode) -> tuple[int, float, float]:
        """(band, score, last_access_time); smaller is evicted first."""
        last = node.last_access_time
        return eviction_priority(
            self._weights,
            node_importance(node),
            node_pinned(node),
            last,
            reuses(node),
            self.clock(),
            self._aggregator.scale,
            self._turnover.pools_since(last) if self._weights.credit else 0.0,
        )


def reuses(node: TreeNode) -> int:
    """Requests that re-read the node after the one that inserted it: SGLang's
    ``hit_count`` counts every request whose prompt covered the node, the first too."""
    return max(node.hit_count - 1, 0)


def check_cli_args(args: argparse.Namespace) -> None:
    """Validate ``--radix-eviction-policy-config`` when the policy is ``importance``.

    Args:
        args: the parsed ``argparse.Namespace`` of ``python -m sglang.launch_server``.
    """
    policy = args.radix_eviction_policy
    if isinstance(policy, str) and policy.lower() == POLICY_NAME:
        parse_policy_config(args.radix_eviction_policy_config)
