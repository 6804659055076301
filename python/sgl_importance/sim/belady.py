"""Belady's optimum (MIN/OPT): evict the page whose next use is farthest away.

Offline: it reads the rest of the trace. For unit-size pages with demand fetch
(every demanded page must be resident after its event) this maximises the hit
count, also when an event demands a set of pages (the exchange argument holds
event by event because the demanded pages are pinned). It optimises hits, not
mass recall. In the prefix regime node sizes differ and ancestors must stay, so
there it is the farthest-next-use heuristic, not a proven optimum.

Cost: next uses come from one sort of the demanded rows, O(N log N); the
replay then pushes ``-next_use`` into the lazy queue like any policy.
"""

from __future__ import annotations

import numpy as np

from sgl_importance.sim.policy_base import Policy, StreamContext


def demanded_rows(ev_row_ptr: np.ndarray, ev_demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices that are demanded, and the event each belongs to."""
    lens = np.diff(ev_row_ptr)
    n_ev = lens.shape[0]
    ev_of_row = np.repeat(np.arange(n_ev, dtype=np.int64), lens)
    rank = np.arange(ev_row_ptr[-1] - ev_row_ptr[0], dtype=np.int64) - (ev_row_ptr[ev_of_row] - ev_row_ptr[0])
    rows = np.flatnonzero(rank < ev_demand[ev_of_row]) + ev_row_ptr[0]
    return rows, ev_of_row[rows - ev_row_ptr[0]]


def next_use(row_keys: np.ndarray, ev_row_ptr: np.ndarray, ev_demand: np.ndarray) -> np.ndarray:
    """For every row, the next event that demands the same key (``n_events`` if none).

    Only demanded rows are considered, as uses and as positions; other rows get
    ``n_events``.
    """
    n_ev = ev_row_ptr.shape[0] - 1
    out = np.full(row_keys.shape[0], n_ev, np.int64)
    rows, ev = demanded_rows(ev_row_ptr, ev_demand)
    if rows.shape[0] == 0:
        return out
    keys = row_keys[rows]
    order = np.lexsort((ev, keys))
    ks, es = keys[order], ev[order]
    same = ks[1:] == ks[:-1]
    nxt = np.full(rows.shape[0], n_ev, np.int64)
    nxt[order[:-1][same]] = es[1:][same]
    out[rows] = nxt
    return out


class Belady(Policy):
    """Belady's MIN: evict the page whose next demand is farthest in the future (offline)."""

    name = "belady"
    offline = True

    def reset(self, ctx: StreamContext) -> None:
        self.next = next_use(ctx.row_keys, ctx.ev_row_ptr, ctx.ev_demand).astype(np.float64)

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return -self.next[lo:hi]


class ReReadOracle(Policy):
    """Offline: evict first what will never be demanded again, LRU within each class.

    Knows *whether* a page is re-read, not *when* (Belady knows when): the bound of
    any priority whose only job is to predict re-reads.
    """

    name = "reread_oracle"
    offline = True

    def reset(self, ctx: StreamContext) -> None:
        self.again = next_use(ctx.row_keys, ctx.ev_row_ptr, ctx.ev_demand) < ctx.n_events
        self.scale = float(ctx.n_events + 1)

    def priorities(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return self.again[lo:hi] * self.scale + t + np.arange(keys.shape[0]) / (keys.shape[0] + 1.0)
