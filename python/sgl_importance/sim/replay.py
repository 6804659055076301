"""Regime (a), the intra-request hot set: replay page demands through a cache of a budget.

The trace is cut into *streams*, each replayed as its own cache:

- ``scope="request"`` (default): one stream per (request, layer, kv_head). This is the
  per-request GPU hot set of sparse attention over long contexts.
- ``scope="global"``: one stream per (layer, kv_head) over all requests, in
  (step, request) order; pages with the same id are shared between requests.

Each stream is a sequence of *events*, one per (step, request). An event's
rows are all pages the request attended at that step, with their mass; it
*demands* a prefix of them in descending mass (``demand``):

- ``"topk:K"``: the K heaviest pages;
- ``"mass:P"``: the fewest heaviest pages covering a share P of the step's mass;
- ``"all"``: every page in the row.

A demanded page is a hit if resident before the event; misses are fetched
(demand fetch) and the policy names victims among resident pages the event
does not demand. If an event demands more pages than the budget, the heaviest
that fit are kept and the rest bypass the cache. Budgets are fractions of each
stream's working set (its unique pages, attended or demanded).

Mass recall counts, per event, the mass of *all* the row's pages (not only the
demanded ones) that was resident before the fetches.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from sgl_importance.sim.metrics import Counts, ReplayResult
from sgl_importance.sim.policies import replay_points
from sgl_importance.sim.policy_base import HotCache, Policy, StreamContext
from sgl_importance.trace.tables import Accesses


@dataclass
class HotStreams:
    """A trace prepared for hot-set replay (struct of arrays).

    Streams own contiguous event ranges ``stream_ev_ptr[s]:stream_ev_ptr[s+1]``;
    events own contiguous row ranges ``ev_row_ptr[e]:ev_row_ptr[e+1]`` sorted by
    mass, descending, of which the first ``ev_demand[e]`` are demanded.
    ``row_key`` is the page's dense index within its stream (0..stream_nkeys-1).
    """

    demand: str
    scope: str
    stream_ev_ptr: np.ndarray
    stream_nkeys: np.ndarray
    stream_layer: np.ndarray
    stream_kv_head: np.ndarray
    stream_request_id: np.ndarray
    ev_row_ptr: np.ndarray
    ev_demand: np.ndarray
    ev_step: np.ndarray
    ev_request_id: np.ndarray
    row_key: np.ndarray
    row_mass: np.ndarray
    row_page: np.ndarray
    row_position: np.ndarray

    @property
    def n_streams(self) -> int:
        return int(self.stream_nkeys.shape[0])

    @property
    def n_events(self) -> int:
        return int(self.ev_demand.shape[0])

    @property
    def n_rows(self) -> int:
        return int(self.row_key.shape[0])

    @property
    def n_demanded(self) -> int:
        return int(self.ev_demand.sum())


def parse_demand(demand: str) -> tuple[str, float]:
    """``"topk:K"`` / ``"mass:P"`` / ``"all"`` -> (kind, value); raises ValueError."""
    kind, _, val = demand.partition(":")
    if kind == "all" and not val:
        return kind, 0.0
    if kind == "topk":
        k = int(val)
        if k < 1:
            raise ValueError(f"demand topk:K needs K >= 1, got {val!r}")
        return kind, float(k)
    if kind == "mass":
        p = float(val)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"demand mass:P needs 0 < P <= 1, got {val!r}")
        return kind, p
    raise ValueError(f"demand must be topk:K, mass:P or all; got {demand!r}")


def _dense(a: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes 0..m-1 preserving order; O(N) through a presence table when the range is small."""
    a = np.asarray(a, dtype=np.int64)
    if a.shape[0] == 0:
        return a, 0
    lo, hi = int(a.min()), int(a.max())
    if hi - lo < max(1 << 16, 4 * a.shape[0]):
        present = np.zeros(hi - lo + 1, np.int64)
        present[a - lo] = 1
        code = np.cumsum(present) - 1
        return code[a - lo], int(code[-1]) + 1
    uniq, inv = np.unique(a, return_inverse=True)
    return inv.astype(np.int64).reshape(-1), int(uniq.shape[0])


def _event_order(stream_raw: np.ndarray, step: np.ndarray, req: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """Row order by (stream, step, request, mass descending)."""
    st, n_st = _dense(stream_raw)
    sp, n_sp = _dense(step)
    _, n_rq = _dense(req)
    if n_st * n_sp * max(n_rq, 1) < (1 << 31):
        # One int64 key (event in the high bits, mass descending in the low 32:
        # the bits of a non-negative float32 order like the float) makes this
        # one argsort instead of a four-key lexsort, several times faster.
        ev_key = (st * n_sp + sp) * max(n_rq, 1) + req
        m = np.nan_to_num(np.maximum(mass.astype(np.float32), 0.0))
        inv_bits = np.int64(0xFFFFFFFF) - m.view(np.uint32).astype(np.int64)
        return np.argsort((ev_key << 32) | inv_bits, kind="stable")
    return np.lexsort((-mass, req, step, stream_raw))


def prepare_hot(trace: Accesses, demand: str = "mass:0.9", scope: str = "request") -> HotStreams:
    """Sort and index a trace for :func:`replay_hot` (vectorised, O(N log N)).

    Duplicate rows of one (step, request, layer, kv_head, page) are merged by
    summing their mass.
    """
    kind, val = parse_demand(demand)
    if scope not in ("request", "global"):
        raise ValueError(f"scope must be 'request' or 'global', got {scope!r}")
    n = len(trace)
    req, n_req = _dense(trace.request_id)
    lh_raw = (trace.layer.astype(np.int64) + 1) * 65536 + (trace.kv_head.astype(np.int64) + 1)
    lh, n_lh = _dense(lh_raw)
    stream_raw = req * n_lh + lh if scope == "request" else lh
    page, n_page = _dense(trace.page)
    mass = trace.importance.astype(np.float32)
    step = trace.step.astype(np.int64)

    order = _event_order(stream_raw, step, req, mass)
    stream_raw, req, step, page, mass = stream_raw[order], req[order], step[order], page[order], mass[order]
    layer, head = trace.layer[order], trace.kv_head[order]
    position = trace.position[order]
    page_id = trace.page[order]

    new_ev = np.ones(n, bool)
    if n:
        new_ev[1:] = (stream_raw[1:] != stream_raw[:-1]) | (step[1:] != step[:-1]) | (req[1:] != req[:-1])
    ev_of_row = np.cumsum(new_ev) - 1
    n_ev = int(ev_of_row[-1]) + 1 if n else 0

    # Duplicate (event, page) rows would give a key two live queue entries: merge them.
    code = ev_of_row * n_page + page
    uniq, first, inv = np.unique(code, return_index=True, return_inverse=True)
    if uniq.shape[0] != n:
        summed = np.bincount(inv.reshape(-1), weights=mass.astype(np.float64), minlength=uniq.shape[0])
        keep = first
        stream_raw, req, step, page = stream_raw[keep], req[keep], step[keep], page[keep]
        layer, head, position, page_id = layer[keep], head[keep], position[keep], page_id[keep]
        ev_of_row = ev_of_row[keep]
        mass = summed.astype(np.float32)
        o2 = np.lexsort((-mass, ev_of_row))
        stream_raw, req, step, page, mass = stream_raw[o2], req[o2], step[o2], page[o2], mass[o2]
        layer, head, position, page_id, ev_of_row = layer[o2], head[o2], position[o2], page_id[o2], ev_of_row[o2]
        n = mass.shape[0]
        new_ev = np.ones(n, bool)
        new_ev[1:] = ev_of_row[1:] != ev_of_row[:-1]

    ev_start = np.flatnonzero(new_ev)
    ev_row_ptr = np.append(ev_start, n).astype(np.int64)
    lens = np.diff(ev_row_ptr)

    new_stream = np.ones(n_ev, bool)
    sr_ev = stream_raw[ev_start]
    if n_ev:
        new_stream[1:] = sr_ev[1:] != sr_ev[:-1]
    st_start = np.flatnonzero(new_stream)
    stream_ev_ptr = np.append(st_start, n_ev).astype(np.int64)
    stream_of_ev = np.cumsum(new_stream) - 1
    stream_of_row = np.repeat(stream_of_ev, lens)

    # Dense page index within each stream: unique (stream, page) pairs are
    # stream-major, so each stream's keys form one contiguous block.
    gkey, _ = _dense(stream_of_row * n_page + page)
    first_key = np.zeros(st_start.shape[0] + 1, np.int64)
    if n:
        first_key[:-1] = np.minimum.reduceat(gkey, ev_row_ptr[st_start])
        first_key[-1] = gkey.max() + 1
    row_key = gkey - first_key[stream_of_row]
    stream_nkeys = np.diff(first_key)

    if kind == "all":
        ev_demand = lens.copy()
    elif kind == "topk":
        ev_demand = np.minimum(lens, int(val))
    else:
        csum = np.cumsum(mass, dtype=np.float64)
        before = np.concatenate([[0.0], csum])[ev_row_ptr[:-1]]
        total = csum[ev_row_ptr[1:] - 1] - before if n_ev else np.zeros(0)
        excl = csum - mass - np.repeat(before, lens)
        # A row is demanded while the mass before it is short of the target
        # (with slack for float32 rounding, so an exact cover needs no extra page).
        need = excl < np.repeat(total, lens) * (val - 1e-6)
        ev_demand = np.add.reduceat(need.astype(np.int64), ev_start) if n_ev else np.zeros(0, np.int64)
        ev_demand = np.maximum(ev_demand, np.minimum(lens, 1))

    ridx = ev_row_ptr[st_start] if n_ev else np.zeros(0, np.int64)
    return HotStreams(
        demand=demand,
        scope=scope,
        stream_ev_ptr=stream_ev_ptr,
        stream_nkeys=stream_nkeys.astype(np.int64),
        stream_layer=layer[ridx].astype(np.int16),
        stream_kv_head=head[ridx].astype(np.int16),
        stream_request_id=(req[ridx] if scope == "request" else np.full(ridx.shape[0], -1)).astype(np.int64),
        ev_row_ptr=ev_row_ptr,
        ev_demand=ev_demand.astype(np.int64),
        ev_step=step[ev_start],
        ev_request_id=req[ev_start],
        row_key=row_key.astype(np.int64),
        row_mass=mass.astype(np.float32),
        row_page=page_id.astype(np.int64),
        row_position=position.astype(np.int32),
    )


@dataclass
class StreamTrace:
    """Per-event outcome of one stream, kept only when asked for (analyses)."""

    hits: np.ndarray
    probe_hits: np.ndarray | None


def budget_pages(n_keys: int, frac: float) -> int:
    """Budget in pages for a working set of ``n_keys`` pages (at least one page)."""
    return max(1, int(math.floor(frac * n_keys + 0.5)))


def replay_stream(
    hs: HotStreams,
    s: int,
    policy: Policy,
    budget: int,
    *,
    seed: int = 0,
    probe_k: int = 0,
    record: bool = False,
) -> tuple[Counts, StreamTrace | None]:
    """Replay stream ``s`` with ``budget`` pages; returns its counters.

    Args:
        probe_k: with ``record``, also count per event how many of the row's
            ``probe_k`` heaviest pages were resident before the event.
        record: keep per-event hits (and probe hits).
    """
    e0, e1 = int(hs.stream_ev_ptr[s]), int(hs.stream_ev_ptr[s + 1])
    r0, r1 = int(hs.ev_row_ptr[e0]), int(hs.ev_row_ptr[e1])
    rp = hs.ev_row_ptr[e0 : e1 + 1] - r0
    keys_all = hs.row_key[r0:r1]
    mass_all = hs.row_mass[r0:r1]
    dem = hs.ev_demand[e0:e1]
    n_keys = int(hs.stream_nkeys[s])
    n_ev = e1 - e0

    cache = HotCache(n_keys, budget, policy)
    ctx = StreamContext(
        n_keys=n_keys,
        budget=int(budget),
        n_events=n_ev,
        row_keys=keys_all,
        row_mass=mass_all,
        ev_row_ptr=rp,
        ev_demand=dem,
        rng=np.random.default_rng(seed + s),
        row_position=hs.row_position[r0:r1],
    )
    policy.attach(ctx, cache.resident)

    resident = cache.resident
    touch, victims, evicted, after = policy.touch, policy.victims, policy.evicted, policy.after_step
    has_after = type(policy).after_step is not Policy.after_step
    count_nonzero = np.count_nonzero
    # Residency of every row before its event; mass recall is one dot product at the end.
    row_res = np.zeros(r1 - r0, bool)
    rp_l = rp.tolist()
    dem_l = dem.tolist()
    hits_total = 0
    fetched = 0
    ev_hits = np.zeros(n_ev, np.int64) if record else None
    ev_probe = np.zeros(n_ev, np.int64) if record and probe_k > 0 else None
    for e in range(n_ev):
        a, b = rp_l[e], rp_l[e + 1]
        nd = dem_l[e]
        k = keys_all[a:b]
        ra = resident[k]
        row_res[a:b] = ra
        hd = ra[:nd]
        nh = count_nonzero(hd)
        hits_total += nh
        if record:
            ev_hits[e] = nh
            if ev_probe is not None:
                ev_probe[e] = count_nonzero(ra[:probe_k])
        if nh == nd:
            touch(k[:nd], mass_all[a : a + nd], e, hd, a, a + nd)
        else:
            d = k[:nd]
            miss = d[~hd]
            need = cache.n_res + miss.shape[0] - cache.budget
            bypass = None
            if need > 0:
                v = victims(need, d)
                if v.shape[0]:
                    resident[v] = False
                    cache.n_res -= v.shape[0]
                    evicted(v)
                room = cache.budget - cache.n_res
                if room < miss.shape[0]:
                    # Demand larger than the cache: the heaviest misses stay, the rest bypass.
                    bypass = miss[max(0, room) :]
                    miss = miss[: max(0, room)]
            resident[miss] = True
            cache.n_res += miss.shape[0]
            fetched += miss.shape[0]
            touch(d, mass_all[a : a + nd], e, hd, a, a + nd)
            if bypass is not None:
                evicted(bypass)
        if has_after:
            after(cache, e)

    st = policy.stats()
    counts = Counts(
        events=n_ev,
        accesses=float(dem.sum()),
        hits=float(hits_total),
        mass_total=float(mass_all.sum(dtype=np.float64)),
        # Masked sum, not np.dot: a BLAS call can cost milliseconds in thread wake-ups.
        mass_resident=float(mass_all[row_res].sum(dtype=np.float64)),
        fetched=float(fetched),
        prefetched=st.get("prefetched", 0.0),
        prefetch_used=st.get("prefetch_used", 0.0),
    )
    return counts, (StreamTrace(ev_hits, ev_probe) if record else None)


def replay_hot(
    hs: HotStreams,
    policies: Sequence[str | Policy],
    budget_fracs: Iterable[float],
    *,
    seed: int = 0,
    progress: bool = False,
) -> list[ReplayResult]:
    """Replay every stream for each (policy, budget fraction).

    Returns:
        One :class:`ReplayResult` per (policy, budget), with counters summed
        over streams and broken down by layer when the trace has layers.
    """
    points = replay_points("hot", policies, budget_fracs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=hs.n_demanded * len(points), unit="acc", unit_scale=True, desc="replay")
    layered = bool((hs.stream_layer >= 0).any())
    out = []
    for pol, frac in points:
        total = Counts()
        per_layer: dict[int, Counts] = {}
        budget_sum = 0
        t0 = time.perf_counter()
        for s in range(hs.n_streams):
            budget = budget_pages(int(hs.stream_nkeys[s]), frac)
            budget_sum += budget
            c, _ = replay_stream(hs, s, pol, budget, seed=seed)
            total.add(c)
            if layered:
                per_layer.setdefault(int(hs.stream_layer[s]), Counts()).add(c)
            if bar is not None:
                bar.update(int(c.accesses))
        out.append(
            ReplayResult(
                regime="hot",
                policy=pol.label,
                budget_frac=frac,
                budget=budget_sum,
                counts=total,
                per_layer=per_layer,
                seconds=time.perf_counter() - t0,
            )
        )
    if bar is not None:
        bar.close()
    return out
