"""What a replay counts, and the ratios reported from the counts.

- hit rate: demanded accesses (hot set: pages; prefix: tokens) found resident.
- mass recall: the share of each event's attention mass that the resident set
  covers before the event's fetches. Under sparse attention over the resident
  pages this is the part of the softmax the model still sees, so it is what
  decides quality; a policy can trade a lower hit rate for a higher recall.
- relative gain vs LRU: ``(x - x_lru) / x_lru``; fraction of Belady: ``x / x_belady``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable


@dataclass
class Counts:
    """Additive counters of one replay (or one stream / layer of it). Units are the
    regime's: pages for the hot set, tokens for the prefix cache."""

    events: int = 0  # hot set: (step, request) events; prefix: requests
    accesses: float = 0.0  # demanded pages / tokens on the requests' paths
    hits: float = 0.0  # ... of which resident before the event
    mass_total: float = 0.0  # attention mass of every page / node the events attended
    mass_resident: float = 0.0  # ... of which resident before the event's fetches
    fetched: float = 0.0  # misses loaded on demand (bypassed pages not included)
    prefetched: float = 0.0  # loaded ahead of demand by a prefetching policy
    prefetch_used: float = 0.0  # ... of which hit before they were evicted

    def add(self, other: "Counts") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def mass_recall(self) -> float:
        return self.mass_resident / self.mass_total if self.mass_total else 0.0


@dataclass
class ReplayResult:
    """One (policy, budget) point of a replay."""

    regime: str
    policy: str
    budget_frac: float
    budget: int
    counts: Counts
    per_layer: dict[int, Counts] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.counts.hit_rate

    @property
    def mass_recall(self) -> float:
        return self.counts.mass_recall

    @property
    def accesses_per_s(self) -> float:
        return self.counts.accesses / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        out = {
            "regime": self.regime,
            "policy": self.policy,
            "budget_frac": self.budget_frac,
            "budget": self.budget,
            "hit_rate": self.hit_rate,
            "mass_recall": self.mass_recall,
            "seconds": self.seconds,
            "counts": asdict(self.counts),
        }
        if self.per_layer:
            out["per_layer"] = {
                str(k): {"hit_rate": c.hit_rate, "mass_recall": c.mass_recall, **asdict(c)}
                for k, c in sorted(self.per_layer.items())
            }
        return out


def relative_gain(value: float, baseline: float) -> float:
    """``(value - baseline) / baseline``; NaN when the baseline is zero."""
    return (value - baseline) / baseline if baseline else float("nan")


def fraction_of(value: float, best: float) -> float:
    """``value / best``; NaN when the best is zero."""
    return value / best if best else float("nan")


def baseline_name(names: Iterable[str], want: str) -> str | None:
    """The policy label that is ``want`` or starts with ``want:``, if present."""
    for n in names:
        if n == want:
            return n
    for n in names:
        if n.split(":")[0] == want:
            return n
    return None
