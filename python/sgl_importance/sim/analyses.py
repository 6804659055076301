"""Trace analyses that say which cache policy can work, before any replay.

All work on a trace prepared by :func:`sim.replay.prepare_hot`; "accesses" are
demanded rows in replay order (events in order, pages by descending mass).

- :func:`reuse_distances`: LRU stack distance of each access = number of
  distinct pages of the same stream accessed since the previous access to
  this page (cold accesses have none). An LRU cache of C pages fed one access
  at a time hits exactly the accesses with distance < C, so the CDF is LRU's
  hit-rate curve.
- :func:`top_share`: share of accesses (and of mass) that falls on the 20 %
  most accessed pages.
- :func:`recency_recall`: recall@k of recency, per decode segment: at each
  event, the share of the k heaviest pages of the step that are among the k
  most recently accessed pages (accessed = demanded at an earlier event of the
  stream; pages accessed at the same event are ordered by their mass there).
  Segments split each stream's events into equal parts (early ... late decode).
- :func:`head_stability`: per kv_head (and layer), mean overlap
  |top-k(t) ∩ top-k(t-1)| / k of consecutive steps of a request.
- :func:`aggregate_jaccard`: per decode segment, Jaccard of the per-step top
  10 % pages and the top 10 % by aggregate importance (EMA or plain
  accumulation of the mass of earlier steps), over the same step's pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sgl_importance.sim.belady import demanded_rows
from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.replay import HotStreams, replay_stream

_INF = np.iinfo(np.int64).max


def _access_sequence(hs: HotStreams, max_accesses: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Demanded rows as one sequence of stream-unique keys (streams concatenated)."""
    rows, ev = demanded_rows(hs.ev_row_ptr, hs.ev_demand)
    stream_of_ev = np.repeat(np.arange(hs.n_streams), np.diff(hs.stream_ev_ptr))
    key_off = np.concatenate([[0], np.cumsum(hs.stream_nkeys)])
    keys = hs.row_key[rows] + key_off[stream_of_ev[ev]]
    if max_accesses is not None and keys.shape[0] > max_accesses:
        keys = keys[:max_accesses]
        ev = ev[:max_accesses]
    return keys, stream_of_ev[ev]


def stack_distances(keys: np.ndarray) -> np.ndarray:
    """LRU stack distance of each access in ``keys`` (-1 for a first access).

    Counts, for access i with previous access j to the same key, the positions
    p in (j, i) whose next access lies after i (each distinct key once).
    Vectorised with a merge-sort tree: O(N log^2 N) numpy work.
    """
    n = keys.shape[0]
    out = np.full(n, -1, np.int64)
    if n == 0:
        return out
    order = np.lexsort((np.arange(n), keys))
    ks = keys[order]
    same = ks[1:] == ks[:-1]
    prev = np.full(n, -1, np.int64)
    nxt = np.full(n, n, np.int64)
    prev[order[1:][same]] = order[:-1][same]
    nxt[order[:-1][same]] = order[1:][same]
    q = np.flatnonzero(prev >= 0)
    if q.shape[0] == 0:
        return out
    thr = q.astype(np.int64)  # count p with next[p] > i
    lo = prev[q] + 1
    hi = q.astype(np.int64)  # [lo, hi) = (j, i)
    count = np.zeros(q.shape[0], np.int64)
    pos = np.arange(n, dtype=np.int64)
    levels = max(1, int(math.ceil(math.log2(n))) + 1)
    left, right = lo.copy(), hi.copy()
    for lev in range(levels):
        active = left < right
        if not active.any():
            break
        # Entries sorted by (block, next): a block's entries are contiguous.
        comb = np.sort((pos >> lev) << 32 | nxt, kind="stable")
        for side in (0, 1):
            if side == 0:
                take = active & ((left & 1) == 1)
                b = left[take]
                left[take] += 1
            else:
                take = active & ((right & 1) == 1)
                right[take] -= 1
                b = right[take]
            if b.shape[0] == 0:
                continue
            end = np.minimum(n, (b + 1) << lev)
            first_gt = np.searchsorted(comb, (b << 32) | thr[take], side="right")
            count[take] += end - first_gt
        left >>= 1
        right >>= 1
    out[q] = count
    return out


@dataclass
class ReuseCDF:
    distances: np.ndarray  # sorted finite stack distances
    cold: int  # first accesses (infinite distance)
    total: int

    def cdf(self, x: np.ndarray) -> np.ndarray:
        """Share of all accesses with distance < x (what LRU of x pages would hit)."""
        return np.searchsorted(self.distances, x, side="left") / max(1, self.total)


def reuse_distances(hs: HotStreams, max_accesses: int | None = 1_000_000) -> ReuseCDF:
    """Stack distances of the (first ``max_accesses``) demanded accesses."""
    keys, _ = _access_sequence(hs, max_accesses)
    d = stack_distances(keys)
    fin = np.sort(d[d >= 0])
    return ReuseCDF(distances=fin, cold=int((d < 0).sum()), total=int(d.shape[0]))


def top_share(hs: HotStreams, frac: float = 0.2) -> dict[str, float]:
    """Share of demanded accesses and of total mass on the top ``frac`` of pages.

    Pages are ranked by access count for the access share and by total mass for
    the mass share; a page is (stream, page).
    """
    stream_of_ev = np.repeat(np.arange(hs.n_streams), np.diff(hs.stream_ev_ptr))
    stream_of_row = np.repeat(stream_of_ev, np.diff(hs.ev_row_ptr))
    key_off = np.concatenate([[0], np.cumsum(hs.stream_nkeys)])
    gkey = hs.row_key + key_off[stream_of_row]
    n_pages = int(key_off[-1])
    rows, _ = demanded_rows(hs.ev_row_ptr, hs.ev_demand)
    acc = np.bincount(gkey[rows], minlength=n_pages).astype(np.float64)
    mass = np.bincount(gkey, weights=hs.row_mass.astype(np.float64), minlength=n_pages)
    top = max(1, int(math.ceil(frac * n_pages)))

    def share(x: np.ndarray) -> float:
        tot = x.sum()
        return float(np.sort(x)[::-1][:top].sum() / tot) if tot else 0.0

    return {"pages": float(n_pages), "top_pages": float(top), "access_share": share(acc), "mass_share": share(mass)}


def _segment_of_events(hs: HotStreams, n_segments: int) -> np.ndarray:
    lens = np.diff(hs.stream_ev_ptr)
    idx = np.arange(hs.n_events) - np.repeat(hs.stream_ev_ptr[:-1], lens)
    return np.minimum(n_segments - 1, (idx * n_segments) // np.repeat(np.maximum(lens, 1), lens))


def _per_segment(values: np.ndarray, seg: np.ndarray, ok: np.ndarray, n_segments: int) -> list[float]:
    out = []
    for g in range(n_segments):
        m = ok & (seg == g)
        out.append(float(values[m].mean()) if m.any() else float("nan"))
    return out


def recency_recall(hs: HotStreams, k: int = 16, n_segments: int = 4) -> dict[str, object]:
    """Recall@k of the k most recently accessed pages, per decode segment.

    Replays LRU with mass tie-breaking and a budget of k pages (its resident set
    is exactly the k most recent pages) and probes the k heaviest pages of
    each step before the step's own accesses. When one event demands more than k
    pages, the cache keeps its hits and then the heaviest misses, which can
    differ slightly from "the k heaviest of that event".
    """
    recall = np.zeros(hs.n_events)
    ok = np.zeros(hs.n_events, bool)
    pol = make_policy("lru_mass")
    for s in range(hs.n_streams):
        e0, e1 = int(hs.stream_ev_ptr[s]), int(hs.stream_ev_ptr[s + 1])
        _, tr = replay_stream(hs, s, pol, k, probe_k=k, record=True)
        n_rows = np.diff(hs.ev_row_ptr[e0 : e1 + 1])
        recall[e0:e1] = tr.probe_hits / np.minimum(k, np.maximum(n_rows, 1))
        ok[e0 + 1 : e1] = True  # the first event of a stream has no history
    seg = _segment_of_events(hs, n_segments)
    return {
        "k": k,
        "overall": float(recall[ok].mean()) if ok.any() else float("nan"),
        "per_segment": _per_segment(recall, seg, ok, n_segments),
    }


def _topk_overlap(hs: HotStreams, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per event: |top-k(e) ∩ top-k(e-1)| / k and whether e has a predecessor."""
    lens = np.diff(hs.ev_row_ptr)
    kk = np.minimum(lens, k)
    ev_of_row = np.repeat(np.arange(hs.n_events), lens)
    rank = np.arange(hs.n_rows) - hs.ev_row_ptr[ev_of_row]
    sel = np.flatnonzero(rank < kk[ev_of_row])
    ev = ev_of_row[sel]
    key = hs.row_key[sel]
    big = int(hs.stream_nkeys.max()) + 1 if hs.n_streams else 1
    code = ev * big + key
    sorted_code = np.sort(code)
    prevcode = (ev - 1) * big + key
    pos = np.minimum(np.searchsorted(sorted_code, prevcode), sorted_code.shape[0] - 1)
    found = sorted_code[pos] == prevcode
    first = np.zeros(hs.n_events, bool)
    first[hs.stream_ev_ptr[:-1]] = True
    found &= ~first[ev]
    inter = np.bincount(ev, weights=found.astype(np.float64), minlength=hs.n_events)
    return inter / np.maximum(kk, 1), ~first


def head_stability(hs: HotStreams, k: int = 16) -> dict[str, object]:
    """Mean top-k overlap of consecutive steps, per (layer, kv_head) and overall."""
    ov, ok = _topk_overlap(hs, k)
    stream_of_ev = np.repeat(np.arange(hs.n_streams), np.diff(hs.stream_ev_ptr))
    lay = hs.stream_layer[stream_of_ev]
    head = hs.stream_kv_head[stream_of_ev]
    per = {}
    for layer, h in sorted(set(zip(lay[ok].tolist(), head[ok].tolist()))):
        m = ok & (lay == layer) & (head == h)
        per[f"{layer}/{h}"] = float(ov[m].mean())
    return {"k": k, "overall": float(ov[ok].mean()) if ok.any() else float("nan"), "per_layer_head": per}


def aggregate_jaccard(
    hs: HotStreams, frac: float = 0.1, decay: float | None = 0.95, n_segments: int = 4
) -> dict[str, object]:
    """Jaccard of per-step top ``frac`` pages vs top ``frac`` by aggregate importance.

    Args:
        decay: EMA decay per event; None accumulates without decay (H2O-like).
    """
    jac = np.zeros(hs.n_events)
    ok = np.zeros(hs.n_events, bool)
    lam = -math.log(decay) if decay is not None else 0.0
    logm = np.log(np.maximum(hs.row_mass.astype(np.float64), 1e-30))
    rp = hs.ev_row_ptr
    for s in range(hs.n_streams):
        e0, e1 = int(hs.stream_ev_ptr[s]), int(hs.stream_ev_ptr[s + 1])
        score = np.full(int(hs.stream_nkeys[s]), -np.inf)
        flag = np.zeros(int(hs.stream_nkeys[s]), bool)
        for e in range(e0, e1):
            a, b = int(rp[e]), int(rp[e + 1])
            k = hs.row_key[a:b]
            m = max(1, int(math.ceil(frac * (b - a))))
            if e > e0:
                agg = score[k]
                top = k[np.argpartition(-agg, m - 1)[:m]] if m < b - a else k
                flag[k[:m]] = True
                inter = int(np.count_nonzero(flag[top]))
                flag[k[:m]] = False
                jac[e] = inter / (2 * m - inter)
                ok[e] = True
            score[k] = np.logaddexp(score[k], logm[a:b] + lam * (e - e0))
    seg = _segment_of_events(hs, n_segments)
    return {
        "frac": frac,
        "decay": decay,
        "overall": float(jac[ok].mean()) if ok.any() else float("nan"),
        "per_segment": _per_segment(jac, seg, ok, n_segments),
    }


def analyze(
    hs: HotStreams, k: int = 16, n_segments: int = 4, max_accesses: int | None = 1_000_000
) -> dict[str, object]:
    """All analyses in one dictionary (JSON-ready), plus the reuse CDF object."""
    rd = reuse_distances(hs, max_accesses)
    xs = np.unique(np.concatenate([[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096], [k]]))
    return {
        "streams": hs.n_streams,
        "events": hs.n_events,
        "accesses": hs.n_demanded,
        "demand": hs.demand,
        "reuse": {
            "accesses": rd.total,
            "cold": rd.cold,
            "median": float(np.median(rd.distances)) if rd.distances.shape[0] else float("nan"),
            "cdf": {int(x): float(v) for x, v in zip(xs, rd.cdf(xs))},
        },
        "top20": top_share(hs, 0.2),
        "recency_recall": recency_recall(hs, k, n_segments),
        "head_stability": head_stability(hs, k),
        "jaccard_ema": aggregate_jaccard(hs, 0.1, 0.95, n_segments),
        "jaccard_accumulated": aggregate_jaccard(hs, 0.1, None, n_segments),
        "_reuse_cdf": rd,
    }
