"""What a replay and its policies share: the stream a policy sees, the cache it acts on, its base class.

A policy sees, at each event (one decode step of one request in the hot-set
regime, one request arrival in the prefix regime), the keys touched, their
attention mass and whether each was a hit; it returns each touched key's new
priority. Lower priority is evicted first. Because a key's priority changes only
when it is touched, the cache keeps priorities in a lazy queue
(:mod:`sim.queue`) instead of re-ranking every resident key.

The replays (:mod:`sim.replay`, :mod:`sim.prefix`) build a :class:`StreamContext`
per stream and drive a :class:`Policy` through its hooks; a prefetching policy
acts back on the replay's :class:`HotCache`. Policies live in
:mod:`sim.recency_policies`, :mod:`sim.mass_policies`, :mod:`sim.belady` and
:mod:`sim.shipped`, and are found by name in :mod:`sim.policies`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from sgl_importance.sim.queue import LazyMinQueue


@dataclass
class StreamContext:
    """What a policy may know about the stream it is attached to.

    Rows are the stream's accesses in replay order; event ``e`` owns rows
    ``ev_row_ptr[e]:ev_row_ptr[e+1]`` sorted by importance, descending, and
    demands the first ``ev_demand[e]`` of them. Only offline policies (Belady)
    may look ahead in these arrays.
    """

    n_keys: int
    budget: int
    n_events: int
    row_keys: np.ndarray
    row_mass: np.ndarray
    ev_row_ptr: np.ndarray
    ev_demand: np.ndarray
    rng: np.random.Generator
    # What ``shipped`` (sim/shipped.py) needs to rebuild the server's node state;
    # the replays fill what their regime knows. Hot set: each row's page position.
    row_position: np.ndarray | None = None
    # Prefix: each key's (node's) token count and start offset in its sequence, the
    # page size, each event's (request's) decode steps and its mass per step on the
    # sequence's first pages (``PrefixData.head_mass``).
    key_tokens: np.ndarray | None = None
    key_start: np.ndarray | None = None
    page_size: int = 1
    ev_steps: np.ndarray | None = None
    ev_head_mass: np.ndarray | None = None


class HotCache:
    """Residency of one stream's pages under a page budget (hot-set regime).

    The replay owns it; a prefetching policy admits and evicts through it.
    """

    def __init__(self, n_keys: int, budget: int, policy: Policy) -> None:
        self.resident = np.zeros(n_keys, bool)
        self.n_res = 0
        self.budget = int(budget)
        self.policy = policy

    def evict(self, keys: np.ndarray) -> None:
        self.resident[keys] = False
        self.n_res -= keys.shape[0]
        self.policy.evicted(keys)

    def admit(self, keys: np.ndarray) -> None:
        self.resident[keys] = True
        self.n_res += keys.shape[0]


class Policy:
    """Base class: a priority rule plus the lazy queue that orders resident keys.

    Subclasses set ``name`` and ``defaults`` (parameter -> default value, whose
    type is the parameter's type), implement :meth:`reset` and :meth:`priorities`,
    and may override the hooks used by cleverer policies (SLRU, prefetch).
    """

    # The policy's name in specs, reports and :data:`sim.policies.POLICIES`.
    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, float]] = {}
    regimes: ClassVar[frozenset[str]] = frozenset({"hot", "prefix"})
    offline: ClassVar[bool] = False
    # Priorities that depend on the time of eviction (not only on the last touch) are
    # ranked when an eviction happens, through matched/inserted/decoded/rank in the
    # prefix regime and victims in the hot set (sim/shipped.py), not a lazy queue.
    ranks_at_eviction: ClassVar[bool] = False
    # Spec values handed over as text (the class parses them) instead of floats.
    raw_params: ClassVar[bool] = False

    def __init__(self, **params: Any) -> None:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise ValueError(
                f"policy {self.name!r}: unknown parameter(s) {sorted(unknown)}; allowed {sorted(self.defaults)}"
            )
        for key, default in self.defaults.items():
            setattr(self, key, type(default)(params.get(key, default)))
        self.params = {k: getattr(self, k) for k in self.defaults}
        self.check()
        self.queue: LazyMinQueue | None = None

    @property
    def label(self) -> str:
        """The spec that rebuilds this policy; used as its name in reports."""
        changed = [f"{k}={v:g}" for k, v in self.params.items() if v != self.defaults[k]]
        return ":".join([self.name, *changed])

    def check(self) -> None:
        """Validate parameters; raise ValueError naming the parameter and range."""

    # -- state ----------------------------------------------------------------
    def reset(self, ctx: StreamContext) -> None:
        """Allocate per-key state for a new stream."""
        raise NotImplementedError

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Update state for the touched ``keys`` and return their new priorities.

        Args:
            keys: touched keys, unique.
            masses: their attention mass at this event.
            t: event index within the stream.
            hit: whether each key was resident before the event.
            lo, hi: the keys' row range in ``StreamContext.row_keys``.
        """
        raise NotImplementedError

    # -- hooks used by the hot-set cache ----------------------------------------
    def attach(self, ctx: StreamContext, resident: np.ndarray) -> None:
        """Start a stream; ``resident`` is the cache's residency flags (read-only here)."""
        self.queue = LazyMinQueue(ctx.n_keys)
        self.resident = resident
        self.reset(ctx)

    def touch(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> None:
        """The event's demanded keys, after its fetches (misses are resident now)."""
        self.queue.push(keys, self.priorities(keys, masses, t, hit, lo, hi))

    def victims(self, n: int, pinned: np.ndarray) -> np.ndarray:
        """Up to ``n`` resident keys to evict, none of ``pinned``.

        ``pinned`` (the event's demanded keys) leave the queue here; :meth:`touch`
        pushes them back right after.
        """
        self.queue.remove(pinned)
        return self.queue.smallest(n)[0]

    def evicted(self, keys: np.ndarray) -> None:
        """``keys`` left the cache (evicted, or bypassed a full cache)."""
        self.queue.remove(keys)

    def after_step(self, cache: HotCache, t: int) -> None:
        """Called once per event after demand fetches (prefetchers act here)."""

    def stats(self) -> dict[str, float]:
        return {}


def check_unit(name: str, value: float, lo_open: bool = True) -> None:
    """Raise ValueError naming ``name`` unless ``value`` lies in (0, 1] (``lo_open``) or [0, 1]."""
    ok = (0.0 < value <= 1.0) if lo_open else (0.0 <= value <= 1.0)
    if not ok:
        rng = "(0, 1]" if lo_open else "[0, 1]"
        raise ValueError(f"{name}={value} out of range {rng}")
