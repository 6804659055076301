"""The eviction priority the server ships, as one pure function, and its configuration.

``cache/strategy.py`` (SGLang's radix tree) and the simulator's ``shipped`` policy
(``sim/policies.py``) both call :func:`eviction_priority`, with the same
:class:`ImportancePolicyConfig` parsed from the same ``--radix-eviction-policy-config``
JSON (:func:`parse_policy_config`), so a replay verdict about ``shipped`` is a verdict
about the deployed policy. Plain Python: no SGLang, no torch, no numpy.

Two forms (the ``form`` key). ``blend`` (the default) blends three O(1) fields of a node:

- persistent importance (an EMA of attention density, ``importance/aggregator.py``)
  divided by the aggregator's running maximum and clipped to [0, 1];
- recency ``exp(-age / recency_horizon)`` on SGLang's logical access clock;
- reuse ``r / (r + 1)``, r = the requests that re-read the node after the one that
  inserted it (SGLang's ``hit_count`` less that first one).

``credit`` is LRU on the device pool's turnover (``importance/turnover.py``: KV tokens
inserted since the node's last access, in pools) with credits: a node re-read r times
counts as ``reuse_credit * r / (r + 1)`` pools younger, and ``importance_credit`` pools
younger per unit of normalised importance. On production conversation traffic a
history re-read once is more likely to be re-read again than a one-off prompt is to
come back at all (``benchmark/hit_rate/RESULTS.md``, the production-trace replay).

Attention-sink nodes form a band (the priority's first element) evicted after every
other node when ``pin_sinks`` is on; ties fall back to the last access time, so with
``importance_weight=0, reuse_weight=0, pin_sinks=false`` (blend) or ``reuse_credit=0,
pin_sinks=false`` (credit) the order is exactly LRU.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, NamedTuple, Optional, Union

from sgl_importance.validate import int_in, invalid, is_number, number_in

POLICY_NAME = "importance"
FLAG = "--radix-eviction-policy-config"
WEIGHT_MAX = 1000.0
HORIZON_MAX = 1e12
HITS_MAX = 1_000_000
PREFETCH_TOKENS_MAX = 1 << 24
DECAY_RANGE = "a number in (0, 1)"
FORMS = ("blend", "credit")
CREDIT_MAX = 1000.0
SINK_PAGES_MAX = 64


def validate_decay(decay: Any, name: str = "decay") -> float:
    if not (is_number(decay) and 0.0 < decay < 1.0):
        raise invalid(f"{name}={decay!r}", DECAY_RANGE)
    return float(decay)


def validate_sink_pages(sink_pages: Any, name: str = "sink_pages") -> int:
    if not int_in(sink_pages, 0, SINK_PAGES_MAX):
        raise invalid(f"{name}={sink_pages!r}", f"an integer in [0, {SINK_PAGES_MAX}]")
    return sink_pages


def _number(key: str, value: Any, low: float, high: float, allowed: str) -> float:
    if not number_in(value, low, high):
        raise invalid(f"{FLAG} {key}={value!r}", allowed)
    return float(value)


def _integer(key: str, value: Any, high: int) -> int:
    if not int_in(value, 0, high):
        raise invalid(f"{FLAG} {key}={value!r}", f"an integer in [0, {high}]")
    return value


@dataclass(frozen=True)
class ImportancePolicyConfig:
    """The JSON keys of ``--radix-eviction-policy-config`` for ``importance``."""

    # Weight of normalised persistent importance in the priority.
    importance_weight: float = 1.0
    # Weight of recency, exp(-age / recency_horizon).
    recency_weight: float = 1.0
    # Weight of reuse, r / (r + 1), r = re-reads after the inserting request.
    reuse_weight: float = 0.5
    # Age, in ticks of SGLang's logical access clock (one tick per node touched or
    # created), at which recency has fallen to 1/e.
    recency_horizon: float = 1024.0
    # Evict attention-sink nodes after every other node.
    pin_sinks: bool = True
    # EMA factor per attended decode step (see importance/aggregator.py).
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
    # The priority's form: "blend" (the weights above) or "credit" (LRU on the device
    # pool's turnover, with the two credits below; the blend's weights, horizon and
    # importance EMA's role in the order are then unused).
    form: str = "blend"
    # credit: pools of turnover a node re-read r times is credited, times r / (r + 1).
    reuse_credit: float = 1.0
    # credit: pools of turnover credited per unit of normalised importance.
    importance_credit: float = 0.0

    def __post_init__(self) -> None:
        weight_range = f"a number in [0, {WEIGHT_MAX:g}]"
        for key in ("importance_weight", "recency_weight", "reuse_weight"):
            _number(key, getattr(self, key), 0.0, WEIGHT_MAX, weight_range)
        horizon = self.recency_horizon
        horizon_range = f"a number in (0, {HORIZON_MAX:g}]"
        if _number("recency_horizon", horizon, 0.0, HORIZON_MAX, horizon_range) == 0:
            raise invalid(f"{FLAG} recency_horizon={horizon!r}", horizon_range)
        if not isinstance(self.pin_sinks, bool):
            raise invalid(f"{FLAG} pin_sinks={self.pin_sinks!r}", "true, false")
        validate_decay(self.decay, name=f"{FLAG} decay")
        validate_sink_pages(self.sink_pages, name=f"{FLAG} sink_pages")
        _integer("storage_min_hits", self.storage_min_hits, HITS_MAX)
        _number("storage_min_importance", self.storage_min_importance, 0.0, 1.0, "a number in [0, 1]")
        _integer("prefetch_max_tokens", self.prefetch_max_tokens, PREFETCH_TOKENS_MAX)
        _number("prefetch_min_importance", self.prefetch_min_importance, 0.0, 1.0, "a number in [0, 1]")
        if self.form not in FORMS:
            raise invalid(f"{FLAG} form={self.form!r}", ", ".join(map(repr, FORMS)))
        credit_range = f"a number in [0, {CREDIT_MAX:g}]"
        for key in ("reuse_credit", "importance_credit"):
            _number(key, getattr(self, key), 0.0, CREDIT_MAX, credit_range)

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


def parse_policy_config(config: Union[str, Mapping[str, Any], None]) -> ImportancePolicyConfig:
    """The flag's value (JSON text, or the object SGLang already decoded) -> config.

    Raises:
        ValueError: not JSON, not an object, or a key or value the config refuses;
            the message names the flag.
    """
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"{FLAG} {config!r} is not JSON ({e}); allowed: a JSON object") from None
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(
            f"{FLAG} {config!r} is invalid for --radix-eviction-policy {POLICY_NAME}; allowed: a JSON object"
        )
    return ImportancePolicyConfig.from_mapping(config)


class PriorityWeights(NamedTuple):
    """The part of the config :func:`eviction_priority` reads, resolved once."""

    importance: float
    recency: float
    reuse: float
    inv_horizon: float
    pin_sinks: bool
    credit: bool = False
    reuse_credit: float = 0.0
    importance_credit: float = 0.0

    @classmethod
    def of(cls, config: ImportancePolicyConfig) -> "PriorityWeights":
        return cls(
            config.importance_weight,
            config.recency_weight,
            config.reuse_weight,
            1.0 / config.recency_horizon,
            config.pin_sinks,
            config.form == "credit",
            config.reuse_credit,
            config.importance_credit,
        )


def eviction_priority(
    weights: PriorityWeights,
    importance: float,
    pinned: bool,
    last_access: float,
    reuses: int,
    now: float,
    scale: float,
    pools_since_access: float = 0.0,
) -> tuple[int, float, float]:
    """(band, score, last access); the smallest is evicted first.

    The band is 1 for a pinned sink node (``pin_sinks`` on), else 0: it orders before
    the score, so every other node is evicted first.

    Args:
        weights: the resolved config.
        importance: the node's persistent importance (0 if never attended).
        pinned: the node lies inside its sequence's attention-sink pages.
        last_access: the node's last access time on the access clock.
        reuses: requests that re-read the node after the one that inserted it.
        now: the access clock's current value.
        scale: the aggregator's running maximum of importance (0: none yet).
        pools_since_access: device pools' worth of KV inserted since the last access
            (``TurnoverClock.pools_since``); read by the ``credit`` form only.
    """
    band = 1 if weights.pin_sinks and pinned else 0
    share = 0.0
    if scale > 0.0 and (weights.importance or weights.importance_credit):
        share = importance / scale
        share = share if share < 1.0 else 1.0
    if weights.credit:
        credited = pools_since_access - weights.reuse_credit * reuses / (reuses + 1.0)
        return (band, weights.importance_credit * share - credited, last_access)
    score = weights.importance * share
    if weights.recency:
        age = now - last_access
        score += weights.recency * (math.exp(-age * weights.inv_horizon) if age > 0 else 1.0)
    if weights.reuse:
        score += weights.reuse * reuses / (reuses + 1.0)
    return (band, score, last_access)
