"""Policies that rank a page by the attention mass it received: H2O, decayed mass, blend, prefetch.

``decayed_mass`` (a decayed sum of attention mass), ``blend`` (that sum blended with
recency) and ``prefetch`` are research variants under their own names; the policy
the server runs is ``shipped`` (:mod:`sim.shipped`), and a verdict about these is
not about the server.

Policies that decay over time (decayed_mass, blend) keep scores in a
time-normalised log domain: every score decays by the same factor per event,
so multiplying all of them by ``decay**-t`` leaves their order unchanged and
makes the untouched keys' priorities constant.
"""

from __future__ import annotations

import math

import numpy as np

from sgl_importance.sim.policy_base import HotCache, Policy, StreamContext, check_unit
from sgl_importance.sim.queue import LazyMinQueue

_TINY = 1e-30


def _log_mass(masses: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(masses, _TINY).astype(np.float64))


def _mean_demanded_mass(ctx: StreamContext) -> float:
    lens = np.diff(ctx.ev_row_ptr)
    if lens.shape[0] == 0:
        return 1.0
    ev = np.repeat(np.arange(lens.shape[0]), lens)
    rank = np.arange(ctx.row_keys.shape[0]) - ctx.ev_row_ptr[ev]
    m = ctx.row_mass[rank < ctx.ev_demand[ev]]
    mean = float(m.mean(dtype=np.float64)) if m.shape[0] else 0.0
    return mean if mean > 0 else 1.0


class H2O(Policy):
    """Heavy hitters: evict the page with the least attention mass accumulated so far.

    After H2O (Zhang et al. 2023): a few pages collect most of the mass over
    a generation. Accumulation is over the page's whole life, not only its
    current residency, and never decays.
    """

    name = "h2o"

    def reset(self, ctx: StreamContext) -> None:
        self.acc = np.zeros(ctx.n_keys, np.float64)

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        a = self.acc[keys] + masses
        self.acc[keys] = a
        return a


class DecayedMass(Policy):
    """Research variant: exponentially decayed attention mass (not the server's policy).

    score(t) = sum over accesses s <= t of mass(s) * decay**(t - s); the lowest
    score is evicted. Kept as log(score * decay**-t), which untouched pages
    never change.
    """

    name = "decayed_mass"
    defaults = {"decay": 0.95}

    def check(self) -> None:
        check_unit("decayed_mass: decay", self.decay)

    def reset(self, ctx: StreamContext) -> None:
        self.logscore = np.full(ctx.n_keys, -np.inf)
        self.lam = -math.log(self.decay)
        self.logm = _log_mass(ctx.row_mass)

    def _update(self, keys: np.ndarray, lo: int, hi: int, t: int) -> np.ndarray:
        s = np.logaddexp(self.logscore[keys], self.logm[lo:hi] + self.lam * t)
        self.logscore[keys] = s
        return s

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return self._update(keys, lo, hi, t)


class Blend(Policy):
    """Research variant: alpha * normalised importance + (1 - alpha) * normalised recency.

    Recency is normalised as ``decay**age`` (1 when just touched). Importance is
    the decayed score of ``decayed_mass`` normalised as ``(1-decay) * score / m``,
    where ``m`` is the stream's mean mass of a demanded page: a page that gets
    the typical demanded mass at every event scores 1, like a page touched just
    now does on recency. Both terms decay at the same rate, so the blend's
    ranking is time-invariant (a lazy queue works). alpha=0 is LRU, alpha=1 is
    ``decayed_mass``.
    """

    name = "blend"
    defaults = {"alpha": 0.5, "decay": 0.95}

    def check(self) -> None:
        check_unit("blend: alpha", self.alpha, lo_open=False)
        check_unit("blend: decay", self.decay)

    def reset(self, ctx: StreamContext) -> None:
        self.logscore = np.full(ctx.n_keys, -np.inf)
        self.lam = -math.log(self.decay)
        a = self.alpha
        m = _mean_demanded_mass(ctx)
        self.log_wi = math.log(a * (1.0 - self.decay) / m) if a > 0 and self.decay < 1 else -math.inf
        self.log_wr = math.log(1.0 - a) if a < 1 else -math.inf
        self.logm = _log_mass(ctx.row_mass)

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        s = np.logaddexp(self.logscore[keys], self.logm[lo:hi] + self.lam * t)
        self.logscore[keys] = s
        # Recency term in the same time-normalised domain: log(decay**(t-t) * decay**-t).
        rec = self.log_wr + self.lam * t
        return np.logaddexp(self.log_wi + s, rec)


class PrefetchDecayedMass(DecayedMass):
    """``decayed_mass`` eviction plus prefetch of the pages predicted to be needed next.

    After each event the ``k`` non-resident pages with the highest decayed
    importance are brought in, into free slots or in place of resident pages of
    lower importance. Prefetched pages are counted apart from demand fetches
    (``prefetched``) with how many were hit before eviction (``prefetch_used``).
    """

    name = "prefetch"
    defaults = {"decay": 0.95, "k": 8.0}
    regimes = frozenset({"hot"})

    def check(self) -> None:
        super().check()
        if self.k < 0:
            raise ValueError(f"prefetch: k={self.k} must be >= 0")

    def attach(self, ctx: StreamContext, resident: np.ndarray) -> None:
        super().attach(ctx, resident)
        # Non-resident pages seen before, by descending importance (priority = -score).
        self.cold = LazyMinQueue(ctx.n_keys)
        self.pref = np.zeros(ctx.n_keys, bool)
        self.n_prefetched = 0
        self.n_used = 0

    def touch(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> None:
        s = self._update(keys, lo, hi, t)
        self.queue.push(keys, s)
        if not hit.all():
            self.cold.remove(keys[~hit])
        used = self.pref[keys] & hit
        if used.any():
            self.n_used += int(np.count_nonzero(used))
            self.pref[keys[used]] = False

    def evicted(self, keys: np.ndarray) -> None:
        self.queue.remove(keys)
        self.pref[keys] = False
        self.cold.push(keys, -self.logscore[keys])

    def after_step(self, cache: HotCache, t: int) -> None:
        k = int(self.k)
        if k == 0:
            return
        cand, negs = self.cold.smallest(k)
        if cand.shape[0] == 0:
            return
        free = cache.budget - cache.n_res
        take = cand[: max(0, free)]
        rest, rest_s = cand[take.shape[0] :], -negs[take.shape[0] :]
        out = np.zeros(0, np.int64)
        if rest.shape[0]:
            low, low_p = self.queue.smallest(rest.shape[0])
            m = min(low.shape[0], rest.shape[0])
            # Candidates descend and victims ascend in score: swap while it gains.
            j = int(np.count_nonzero(rest_s[:m] > low_p[:m]))
            out = low[:j]
            take = np.concatenate([take, rest[:j]])
        if out.shape[0]:
            cache.evict(out)
        if take.shape[0]:
            cache.admit(take)
            self.cold.remove(take)
            self.queue.push(take, self.logscore[take])
            self.pref[take] = True
            self.n_prefetched += take.shape[0]

    def stats(self) -> dict[str, float]:
        return {"prefetched": float(self.n_prefetched), "prefetch_used": float(self.n_used)}
