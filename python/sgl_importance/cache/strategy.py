"""Eviction strategy ``importance``: attention decides which radix-tree leaves go first.

SGLang's device eviction (``FullComponent._evict_device_start``) and host eviction
(``drive_host_eviction``) pop the leaf with the smallest ``get_priority(node)``; this
strategy blends three O(1) node fields into that priority:

- persistent importance (the node's ``NodeImportance.importance``, folded from the
  decode kernels' page importance by ``importance/persistent.py``), normalised by
  the aggregator's running maximum to [0, 1];
- recency: ``exp(-age / recency_horizon)`` over SGLang's logical access clock
  (``node.last_access_time``);
- reuse: ``hit_count / (hit_count + 1)``.

Attention-sink nodes (``NodeImportance.pinned``) form a tier evicted after all
others when ``pin_sinks`` is on. Ties fall back to ``last_access_time``, so with
``importance_weight=0, reuse_weight=0, pin_sinks=false`` the order is exactly LRU —
the A/B baseline inside the same code path.

The same instance carries the L3 admission rule (``cache/admission.py``) and the
prefetch's candidates (``cache/prefetch.py``).
Configured through SGLang's ``--radix-eviction-policy-config`` JSON (the
strategy's constructor keywords, :class:`ImportancePolicyConfig`); an unknown key or
an out-of-range value fails at start-up naming the flag, the key, the value and the
allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from sgl_importance.cache.admission import StorageAdmission
from sgl_importance.cache.prefetch import WarmIndex
from sgl_importance.cache.stored import StoredImportance
from sgl_importance.importance.node_state import node_importance, node_pinned
from sgl_importance.importance.persistent import (
    ImportanceAggregator,
    validate_decay,
    validate_sink_pages,
)

POLICY_NAME = "importance"
FLAG = "--radix-eviction-policy-config"
WEIGHT_MAX = 1000.0
HORIZON_MAX = 1e12
HITS_MAX = 1_000_000
PREFETCH_TOKENS_MAX = 1 << 24


def _number(key: str, value: Any, low: float, high: float, allowed: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not (low <= value <= high)
    ):
        raise ValueError(f"{FLAG} {key}={value!r} is invalid; allowed: {allowed}")
    return float(value)


@dataclass(frozen=True)
class ImportancePolicyConfig:
    """The JSON keys of ``--radix-eviction-policy-config`` for ``importance``."""

    # Weight of normalised persistent importance in the priority.
    importance_weight: float = 1.0
    # Weight of recency, exp(-age / recency_horizon).
    recency_weight: float = 1.0
    # Weight of reuse, hit_count / (hit_count + 1).
    reuse_weight: float = 0.5
    # Age, in ticks of SGLang's logical access clock (one tick per node touched or
    # created), at which recency has fallen to 1/e.
    recency_horizon: float = 1024.0
    # Evict attention-sink nodes after every other node.
    pin_sinks: bool = True
    # EMA factor per attended decode step (see importance/persistent.py).
    decay: float = 0.98
    # Leading pages of a sequence treated as attention sinks.
    sink_pages: int = 1
    # L3 admission (cache/admission.py): write a node to the storage tier once it
    # has this many hits (0: hits alone never qualify) ...
    storage_min_hits: int = 0
    # ... or this normalised importance (0: importance alone never qualifies).
    # Both 0: every node is written, as in SGLang.
    storage_min_importance: float = 0.0
    # Prefetch (cache/prefetch.py): device tokens loaded back ahead of need per
    # prefill batch (0: no prefetch) ...
    prefetch_max_tokens: int = 4096
    # ... and the normalised importance a demoted node needs to be warmed back
    # onto the device (0: warm nothing; waiting requests still prefetch). Off by
    # default: on the serving benchmark 92 % of warmed tokens were evicted unused
    # (benchmark/serving/RESULTS.md); it pays when a few hot documents recur.
    prefetch_min_importance: float = 0.0

    def __post_init__(self) -> None:
        weight_range = f"a number in [0, {WEIGHT_MAX:g}]"
        for key in ("importance_weight", "recency_weight", "reuse_weight"):
            _number(key, getattr(self, key), 0.0, WEIGHT_MAX, weight_range)
        horizon = self.recency_horizon
        horizon_range = f"a number in (0, {HORIZON_MAX:g}]"
        if _number("recency_horizon", horizon, 0.0, HORIZON_MAX, horizon_range) == 0:
            raise ValueError(
                f"{FLAG} recency_horizon={horizon!r} is invalid; allowed: {horizon_range}"
            )
        if not isinstance(self.pin_sinks, bool):
            raise ValueError(
                f"{FLAG} pin_sinks={self.pin_sinks!r} is invalid; allowed: true, false"
            )
        validate_decay(self.decay, name=f"{FLAG} decay")
        validate_sink_pages(self.sink_pages, name=f"{FLAG} sink_pages")
        hits = self.storage_min_hits
        if isinstance(hits, bool) or not isinstance(hits, int) or not 0 <= hits <= HITS_MAX:
            raise ValueError(
                f"{FLAG} storage_min_hits={hits!r} is invalid; "
                f"allowed: an integer in [0, {HITS_MAX}]"
            )
        importance = self.storage_min_importance
        _number("storage_min_importance", importance, 0.0, 1.0, "a number in [0, 1]")
        cap = self.prefetch_max_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= PREFETCH_TOKENS_MAX:
            raise ValueError(
                f"{FLAG} prefetch_max_tokens={cap!r} is invalid; "
                f"allowed: an integer in [0, {PREFETCH_TOKENS_MAX}]"
            )
        _number(
            "prefetch_min_importance", self.prefetch_min_importance, 0.0, 1.0, "a number in [0, 1]"
        )

    @classmethod
    def from_mapping(cls, config: Optional[Mapping[str, Any]]) -> "ImportancePolicyConfig":
        """Validate the policy's JSON object; unknown keys name the allowed ones."""
        config = dict(config or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(config) - set(allowed))
        if unknown:
            raise ValueError(
                f"{FLAG} has unknown key(s) {', '.join(map(repr, unknown))} for "
                f"--radix-eviction-policy {POLICY_NAME}; allowed keys: {', '.join(allowed)}"
            )
        return cls(**config)


_clock_module: Any = None


def sglang_access_clock() -> float:
    """The current value of SGLang's logical clock behind ``last_access_time``.

    The unified tree stamps nodes from a module-level counter; reading it (without
    advancing it) gives "now" on the same scale. Resolved once: this runs per leaf.
    """
    global _clock_module
    if _clock_module is None:
        from sglang.srt.mem_cache.unified_cache.components import base

        _clock_module = base
    return float(_clock_module._LAST_ACCESS_TIME_COUNTER_FLOAT)


class ImportanceStrategy(EvictionStrategy):
    """Importance-aware eviction (accumulated attention mass: H2O, Zhang et al.,
    arXiv:2306.14048; ArkVale, Chen et al., NeurIPS 2024; Quest, Tang et al.,
    arXiv:2406.10774).

    Pages that decoding attended heavily keep being attended, so the attention mass
    a radix node's pages accumulated over past steps and requests predicts its
    reuse better than its last access time. Leaves are evicted in increasing order
    of that normalised mass blended with recency and hit count; attention sinks last.

    Each instance owns the :class:`ImportanceAggregator` the scheduler folds the
    page table into (``self.aggregator``), the L3 admission rule
    (``self.admission``), the prefetch's warm candidates (``self.warm``) and the
    importance of pages dropped to the storage tier (``self.stored``);
    ``get_priority`` reads only plain Python fields.
    """

    def __init__(self, **config: Any) -> None:
        self.config = ImportancePolicyConfig.from_mapping(config)
        c = self.config
        self.aggregator = ImportanceAggregator(decay=c.decay, sink_pages=c.sink_pages)
        self.admission = StorageAdmission(
            min_hits=c.storage_min_hits, min_importance=float(c.storage_min_importance)
        )
        # Nodes demoted while important: what the prefetch warms back.
        self.warm = WarmIndex()
        # Importance of pages dropped to the storage tier, for the nodes rebuilt from it.
        self.stored = StoredImportance()
        # Plain attributes: get_priority runs once per evictable leaf per pass.
        self._w_importance = c.importance_weight
        self._w_recency = c.recency_weight
        self._w_reuse = c.reuse_weight
        self._inv_horizon = 1.0 / c.recency_horizon
        self._pin = c.pin_sinks
        # "Now" on last_access_time's scale; tests substitute their own clock.
        self.clock: Callable[[], float] = sglang_access_clock

    def fresh_priority(self) -> tuple[int, float, float]:
        """The priority of a node inserted now, never attended nor hit: what every
        new request's KV gets. A node below it is evicted before any of those."""
        return (0, self._w_recency, self.clock())

    def get_priority(self, node: Any) -> tuple[int, float, float]:
        """(tier, blended score, last_access_time); smaller is evicted first."""
        last = node.last_access_time
        score = 0.0
        if self._w_importance:
            scale = self.aggregator.scale
            if scale > 0.0:
                share = node_importance(node) / scale
                score += self._w_importance * (share if share < 1.0 else 1.0)
        if self._w_recency:
            age = self.clock() - last
            score += self._w_recency * (math.exp(-age * self._inv_horizon) if age > 0 else 1.0)
        if self._w_reuse:
            hits = node.hit_count
            score += self._w_reuse * hits / (hits + 1.0)
        tier = 1 if self._pin and node_pinned(node) else 0
        return (tier, score, last)


def check_cli_args(args: Any) -> None:
    """Validate ``--radix-eviction-policy-config`` when the policy is ``importance``.

    Args:
        args: the parsed ``argparse.Namespace`` of ``python -m sglang.launch_server``.
    """
    policy = getattr(args, "radix_eviction_policy", None)
    if isinstance(policy, str) and policy.lower() == POLICY_NAME:
        config = getattr(args, "radix_eviction_policy_config", None)
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(
                f"{FLAG} {config!r} is invalid for --radix-eviction-policy {POLICY_NAME}; "
                "allowed: a JSON object"
            )
        ImportancePolicyConfig.from_mapping(config)
