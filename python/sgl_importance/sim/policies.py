"""Eviction policies for the replay, one small class each, found by name in a registry.

A policy sees, at each event (one decode step of one request in the hot-set
regime, one request arrival in the prefix regime), the keys touched, their
attention mass and whether each was a hit; it returns each touched key's new
priority. Lower priority is evicted first. Because a key's priority changes only
when it is touched, the cache keeps priorities in a lazy queue
(:mod:`sim.queue`) instead of re-ranking every resident key.

Policies that decay over time (importance, blend) keep scores in a
time-normalised log domain: every score decays by the same factor per event,
so multiplying all of them by ``decay**-t`` leaves their order unchanged and
makes the untouched keys' priorities constant.

The policy the server runs is ``shipped`` (``sim/shipped.py``: the server's own
priority function, ranked at eviction time). ``importance`` (a decayed sum of
attention mass) and ``blend`` (that sum blended with recency) are research
variants under their own names; a verdict about them is not about the server.

Specs: ``"name"`` or ``"name:param=value:param=value"`` (see :func:`make_policy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from sgl_importance.sim.queue import LazyMinQueue

if TYPE_CHECKING:
    from sgl_importance.sim.replay import HotCache

_TINY = 1e-30


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


POLICIES: dict[str, type["Policy"]] = {}


def register(name: str):
    """Class decorator adding a policy to :data:`POLICIES` under ``name``."""

    def deco(cls: type["Policy"]) -> type["Policy"]:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return deco


class Policy:
    """Base class: a priority rule plus the lazy queue that orders resident keys.

    Subclasses set ``defaults`` (parameter -> default value, whose type is the
    parameter's type), implement :meth:`reset` and :meth:`priorities`, and may
    override the hooks used by cleverer policies (SLRU, prefetch).
    """

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

    def after_step(self, cache: "HotCache", t: int) -> None:
        """Called once per event after demand fetches (prefetchers act here)."""

    def stats(self) -> dict[str, float]:
        return {}


def make_policy(spec: str) -> Policy:
    """Build a policy from ``"name"`` or ``"name:param=value[:param=value...]"``."""
    name, *parts = spec.strip().split(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    params = {}
    for part in parts:
        if "=" not in part:
            raise ValueError(f"policy spec {spec!r}: expected param=value, got {part!r}")
        k, v = part.split("=", 1)
        params[k.strip()] = v.strip() if POLICIES[name].raw_params else float(v)
    return POLICIES[name](**params)


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


def _check_unit(name: str, value: float, lo_open: bool = True) -> None:
    ok = (0.0 < value <= 1.0) if lo_open else (0.0 <= value <= 1.0)
    if not ok:
        rng = "(0, 1]" if lo_open else "[0, 1]"
        raise ValueError(f"{name}={value} out of range {rng}")


@register("lru")
class LRU(Policy):
    """Least recently used; pages touched in the same event are ordered at random."""

    def reset(self, ctx: StreamContext) -> None:
        # One tie-breaker per row, drawn up front: cheaper than a draw per event.
        self.tie = 0.5 * ctx.rng.random(ctx.row_keys.shape[0])

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return self.tie[lo:hi] + t


@register("lru_mass")
class LRUMass(Policy):
    """Least recently used; ties within one event broken by attention mass.

    Differs from ``lru`` exactly when several pages share their last event,
    which under top-k demand is the common case.
    """

    def reset(self, ctx: StreamContext) -> None:
        self.tie = 0.5 * np.clip(ctx.row_mass, 0.0, 1.0).astype(np.float64)

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return self.tie[lo:hi] + t


@register("lfu")
class LFU(Policy):
    """Least frequently used (in-cache count, reset on admission); ties by recency."""

    def reset(self, ctx: StreamContext) -> None:
        self.count = np.zeros(ctx.n_keys, np.float64)
        self.scale = float(ctx.n_events + 1)

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        c = np.where(hit, self.count[keys], 0.0) + 1.0
        self.count[keys] = c
        return c * self.scale + t


@register("tlru")
class TLRU(Policy):
    """Recency with a time-to-live bonus: LRU where frequent pages live longer.

    A page expires at ``last access + ttl * min(hits, cap)`` (hits counted while
    resident) and the earliest expiry is evicted, so a page hit often survives
    ``ttl * cap`` events of disuse that would evict a one-off page. In the
    spirit of time-aware LRU (TLRU, Bilal & Kang 2014).
    """

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


@register("h2o")
class H2O(Policy):
    """Heavy hitters: evict the page with the least attention mass accumulated so far.

    After H2O (Zhang et al. 2023): a few pages collect most of the mass over
    a generation. Accumulation is over the page's whole life, not only its
    current residency, and never decays.
    """

    def reset(self, ctx: StreamContext) -> None:
        self.acc = np.zeros(ctx.n_keys, np.float64)

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        a = self.acc[keys] + masses
        self.acc[keys] = a
        return a


@register("importance")
class Importance(Policy):
    """Research variant: exponentially decayed attention mass (not the server's policy).

    score(t) = sum over accesses s <= t of mass(s) * decay**(t - s); the lowest
    score is evicted. Kept as log(score * decay**-t), which untouched pages
    never change.
    """

    defaults = {"decay": 0.95}

    def check(self) -> None:
        _check_unit("importance: decay", self.decay)

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


@register("blend")
class Blend(Policy):
    """Research variant: alpha * normalised importance + (1 - alpha) * normalised recency.

    Recency is normalised as ``decay**age`` (1 when just touched). Importance is
    the decayed score of ``importance`` normalised as ``(1-decay) * score / m``,
    where ``m`` is the stream's mean mass of a demanded page: a page that gets
    the typical demanded mass at every event scores 1, like a page touched just
    now does on recency. Both terms decay at the same rate, so the blend's
    ranking is time-invariant (a lazy queue works). alpha=0 is LRU, alpha=1 is
    ``importance``.
    """

    defaults = {"alpha": 0.5, "decay": 0.95}

    def check(self) -> None:
        _check_unit("blend: alpha", self.alpha, lo_open=False)
        _check_unit("blend: decay", self.decay)

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


@register("slru")
class SLRU(Policy):
    """Segmented LRU: new pages enter a probation segment, a hit promotes to protected.

    Evicts from probation first; when protected exceeds ``protected`` x budget its
    least recent pages drop back to probation (Karedla et al. 1994). One-off
    pages therefore never displace pages that were reused.
    """

    defaults = {"protected": 0.8}
    regimes = frozenset({"hot"})

    def check(self) -> None:
        _check_unit("slru: protected", self.protected, lo_open=False)

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


@register("prefetch")
class PrefetchImportance(Importance):
    """``importance`` eviction plus prefetch of the pages predicted to be needed next.

    After each event the ``k`` non-resident pages with the highest decayed
    importance are brought in, into free slots or in place of resident pages of
    lower importance. Prefetched pages are counted apart from demand fetches
    (``prefetched``) with how many were hit before eviction (``prefetch_used``).
    """

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

    def after_step(self, cache: "HotCache", t: int) -> None:
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
