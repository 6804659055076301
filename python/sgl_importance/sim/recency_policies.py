"""Policies that rank a page by when, and how often, it was used: LRU and its relatives.

None of them reads attention mass except to break ties (``lru_mass``). Each is a
small class found by name in :mod:`sim.policies`; the base class and the stream a
policy sees are in :mod:`sim.policy_base`.
"""

from __future__ import annotations

import numpy as np

from sgl_importance.sim.policy_base import Policy, StreamContext, check_unit
from sgl_importance.sim.queue import LazyMinQueue


class LRU(Policy):
    """Least recently used; pages touched in the same event are ordered at random."""

    name = "lru"

    def reset(self, ctx: StreamContext) -> None:
        # One tie-breaker per row, drawn up front: cheaper than a draw per event.
        self.tie = 0.5 * ctx.rng.random(ctx.row_keys.shape[0])

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return self.tie[lo:hi] + t


class LRUMass(Policy):
    """Least recently used; ties within one event broken by attention mass.

    Differs from ``lru`` exactly when several pages share their last event,
    which under top-k demand is the common case.
    """

    name = "lru_mass"

    def reset(self, ctx: StreamContext) -> None:
        self.tie = 0.5 * np.clip(ctx.row_mass, 0.0, 1.0).astype(np.float64)

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return self.tie[lo:hi] + t


class LFU(Policy):
    """Least frequently used (in-cache count, reset on admission); ties by recency."""

    name = "lfu"

    def reset(self, ctx: StreamContext) -> None:
        self.count = np.zeros(ctx.n_keys, np.float64)
        self.scale = float(ctx.n_events + 1)

    def counted(self, keys: np.ndarray, hit: np.ndarray) -> np.ndarray:
        """Count this use of ``keys`` (a key admitted again starts over at 1)."""
        c = np.where(hit, self.count[keys], 0.0) + 1.0
        self.count[keys] = c
        return c

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return self.counted(keys, hit) * self.scale + t


class TLRU(Policy):
    """Recency with a time-to-live bonus: LRU where frequent pages live longer.

    A page expires at ``last access + ttl * min(hits, cap)`` (hits counted while
    resident) and the earliest expiry is evicted, so a page hit often survives
    ``ttl * cap`` events of disuse that would evict a one-off page. In the
    spirit of time-aware LRU (TLRU, Bilal & Kang 2014).
    """

    name = "tlru"
    defaults = {"ttl": 16.0, "cap": 4.0}

    def check(self) -> None:
        if self.ttl < 0 or self.cap < 0:
            raise ValueError(f"tlru: ttl={self.ttl} and cap={self.cap} must be >= 0")

    def reset(self, ctx: StreamContext) -> None:
        self.hits = np.zeros(ctx.n_keys, np.float64)
        self.tie = 0.5 * ctx.rng.random(ctx.row_keys.shape[0])

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        h = np.where(hit, self.hits[keys] + 1.0, 0.0)
        self.hits[keys] = h
        return t + self.ttl * np.minimum(h, self.cap) + self.tie[lo:hi]


class SLRU(Policy):
    """Segmented LRU: new pages enter a probation segment, a hit promotes to protected.

    Evicts from probation first; when protected exceeds ``protected`` x budget its
    least recent pages drop back to probation (Karedla et al. 1994). One-off
    pages therefore never displace pages that were reused.
    """

    name = "slru"
    defaults = {"protected": 0.8}
    regimes = frozenset({"hot"})

    def check(self) -> None:
        check_unit("slru: protected", self.protected, lo_open=False)

    def attach(self, ctx: StreamContext, resident: np.ndarray) -> None:
        self.queue = LazyMinQueue(ctx.n_keys)  # probation
        self.prot = LazyMinQueue(ctx.n_keys)
        self.resident = resident
        self.seg = np.zeros(ctx.n_keys, np.int8)  # 0 out, 1 probation, 2 protected
        self.n_prot = 0
        self.cap_prot = int(self.protected * ctx.budget)
        self.tie = 0.5 * ctx.rng.random(ctx.row_keys.shape[0])

    def reset(self, ctx: StreamContext) -> None:
        pass

    def touch(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> None:
        resident = self.resident[keys]
        seg = self.seg[keys]
        tie = self.tie[lo:hi] + t
        to_prot = hit & (seg > 0)
        new = resident & ~hit
        pk = keys[to_prot]
        if pk.shape[0]:
            self.n_prot += int(np.count_nonzero(seg[to_prot] == 1))
            self.seg[pk] = 2
            self.queue.remove(pk)
            self.prot.push(pk, tie[to_prot])
        nk = keys[new]
        if nk.shape[0]:
            self.seg[nk] = 1
            self.queue.push(nk, tie[new])
        over = self.n_prot - self.cap_prot
        if over > 0:
            dk, dp = self.prot.smallest(over)
            self.seg[dk] = 1
            self.n_prot -= dk.shape[0]
            self.prot.remove(dk)
            # Demoted pages become the most recent of probation, keeping their order.
            self.queue.push(dk, t - 0.5 + 0.25 * np.arange(dk.shape[0]) / max(1, dk.shape[0]))

    def priorities(
        self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int
    ) -> np.ndarray:  # touch() is overridden instead
        raise NotImplementedError

    def victims(self, n: int, pinned: np.ndarray) -> np.ndarray:
        self.queue.remove(pinned)
        self.prot.remove(pinned)
        k, _ = self.queue.smallest(n)
        if k.shape[0] < n:
            k2, _ = self.prot.smallest(n - k.shape[0])
            k = np.concatenate([k, k2])
        return k

    def evicted(self, keys: np.ndarray) -> None:
        self.queue.remove(keys)
        self.prot.remove(keys)
        self.n_prot -= int(np.count_nonzero(self.seg[keys] == 2))
        self.seg[keys] = 0


class SGLangSLRU(LFU):
    """SGLang's ``slru`` on the prefix cache: a node covered by ``protected_hits``
    requests or more (the one that inserted it counts, as SGLang's ``hit_count`` does)
    is evicted after every other node; ties by recency.

    Unlike :class:`SLRU` the protected segment has no cap: what SGLang runs.
    """

    name = "sglang_slru"
    defaults = {"protected_hits": 2.0}
    regimes = frozenset({"prefix"})

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        protected = self.counted(keys, hit) >= self.protected_hits
        return protected * self.scale + t + np.arange(keys.shape[0]) / (keys.shape[0] + 1.0)
