"""A min-priority queue over integer keys with lazy deletion, batched in numpy.

Every policy in ``sim`` changes a key's priority only when the key is touched
(accessed, admitted, demoted), so the cache never re-ranks untouched keys. The
queue exploits that: a push appends (priority, key, stamp) to a pending buffer
and records the stamp as the key's current one; an entry is alive while its
stamp is its key's current stamp. Removing a key (eviction, or pinning it for
one event) just gives it a fresh stamp. Dead entries are skipped when met,
never searched for.

Pending entries are folded into one sorted run in bulk (appended when they all
sort after it, as recency priorities do; otherwise one stable sort), so a push
costs a few numpy element operations and a replay O(N log N) overall.

Small key spaces (a per-request stream of a few hundred pages) take a dense
path instead: current priorities in one array and a partial sort of the
members on each query. That is O(keys) per query but only a handful of numpy
calls, which is what costs time at this size.
"""

from __future__ import annotations

import numpy as np

_MIN_CAP = 256
DENSE_MAX_KEYS = 1024


class LazyMinQueue:
    """Keys ``0 .. n_keys-1`` with float64 priorities; smallest first.

    Args:
        n_keys: size of the key space.
        dense: force (True) or forbid (False) the dense path; None picks it
            for at most ``DENSE_MAX_KEYS`` keys.
    """

    def __init__(self, n_keys: int, dense: bool | None = None) -> None:
        self.dense = n_keys <= DENSE_MAX_KEYS if dense is None else bool(dense)
        if self.dense:
            self.member = np.zeros(n_keys, bool)
            self.cur = np.zeros(n_keys, np.float64)
        self.stamp = np.zeros(n_keys, np.int64)
        self._tick = 1
        cap = _MIN_CAP
        self._sp = np.empty(cap, np.float64)
        self._sk = np.empty(cap, np.int64)
        self._sv = np.empty(cap, np.int64)
        self._h = 0
        self._n = 0
        self._pp = np.empty(cap, np.float64)
        self._pk = np.empty(cap, np.int64)
        self._pv = np.empty(cap, np.int64)
        self._c = 0

    def __len__(self) -> int:
        """Entries held, dead ones included (an upper bound on live keys)."""
        return self._n - self._h + self._c

    def push(self, keys: np.ndarray, prios: np.ndarray) -> None:
        """Set the priority of ``keys`` (unique within one call); they become members."""
        n = keys.shape[0]
        if n == 0:
            return
        if self.dense:
            self.member[keys] = True
            self.cur[keys] = prios
            return
        tick = self._tick
        self._tick = tick + 1
        self.stamp[keys] = tick
        c = self._c
        if c + n > self._pp.shape[0]:
            self._merge()
            c = 0
            if n > self._pp.shape[0]:
                cap = max(2 * self._pp.shape[0], n)
                self._pp = np.empty(cap, np.float64)
                self._pk = np.empty(cap, np.int64)
                self._pv = np.empty(cap, np.int64)
        self._pp[c : c + n] = prios
        self._pk[c : c + n] = keys
        self._pv[c : c + n] = tick
        self._c = c + n

    def remove(self, keys: np.ndarray) -> None:
        """Make ``keys`` non-members (all their entries die)."""
        if self.dense:
            self.member[keys] = False
            return
        self.stamp[keys] = self._tick
        self._tick += 1

    def _merge(self) -> None:
        """Fold the pending buffer into the sorted run."""
        c = self._c
        if c == 0:
            return
        pk, pp, pv = self._pk[:c], self._pp[:c], self._pv[:c]
        ok = self.stamp[pk] == pv
        pk, pp, pv = pk[ok], pp[ok], pv[ok]
        self._c = 0
        m = pk.shape[0]
        if m == 0:
            return
        order = np.argsort(pp, kind="stable")
        pk, pp, pv = pk[order], pp[order], pv[order]
        h, n = self._h, self._n
        if n == h or pp[0] >= self._sp[n - 1]:
            # Recency-like priorities: the new run sorts after the old one.
            if n + m > self._sp.shape[0]:
                live = n - h
                cap = max(_MIN_CAP, 2 * (live + m))
                sp, sk, sv = np.empty(cap), np.empty(cap, np.int64), np.empty(cap, np.int64)
                sp[:live], sk[:live], sv[:live] = self._sp[h:n], self._sk[h:n], self._sv[h:n]
                self._sp, self._sk, self._sv = sp, sk, sv
                h, n = 0, live
                self._h = 0
            self._sp[n : n + m] = pp
            self._sk[n : n + m] = pk
            self._sv[n : n + m] = pv
            self._n = n + m
            return
        # General case: keep the live part of the old run and sort the two runs together.
        ok = self.stamp[self._sk[h:n]] == self._sv[h:n]
        ap = np.concatenate([self._sp[h:n][ok], pp])
        ak = np.concatenate([self._sk[h:n][ok], pk])
        av = np.concatenate([self._sv[h:n][ok], pv])
        order = np.argsort(ap, kind="stable")
        tot = ap.shape[0]
        cap = max(_MIN_CAP, 2 * tot)
        self._sp, self._sk, self._sv = np.empty(cap), np.empty(cap, np.int64), np.empty(cap, np.int64)
        self._sp[:tot], self._sk[:tot], self._sv[:tot] = ap[order], ak[order], av[order]
        self._h, self._n = 0, tot

    def _scan_sorted(self, want: int) -> tuple[np.ndarray, np.ndarray]:
        """First ``want`` live entries of the sorted run (dropping dead ones at its head)."""
        pos = self._h
        if pos >= self._n:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        width = max(64, 4 * want)
        end = min(self._n, pos + width)
        k = self._sk[pos:end]
        sel = np.flatnonzero(self.stamp[k] == self._sv[pos:end])
        if sel.shape[0] >= want or end == self._n:
            # Dead entries never come back (a returning key gets a new stamp).
            self._h = pos + (int(sel[0]) if sel.shape[0] else end - pos)
            sel = sel[:want]
            return k[sel], self._sp[pos:end][sel]
        got_k, got_p = [k[sel]], [self._sp[pos:end][sel]]
        self._h = pos + (int(sel[0]) if sel.shape[0] else end - pos)
        have = sel.shape[0]
        pos = end
        while have < want and pos < self._n:
            width *= 2
            end = min(self._n, pos + width)
            k = self._sk[pos:end]
            sel = np.flatnonzero(self.stamp[k] == self._sv[pos:end])[: want - have]
            if have == 0 and sel.shape[0]:
                self._h = pos + int(sel[0])
            elif have == 0:
                self._h = end
            got_k.append(k[sel])
            got_p.append(self._sp[pos:end][sel])
            have += sel.shape[0]
            pos = end
        return np.concatenate(got_k), np.concatenate(got_p)

    def smallest(self, want: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``want`` member keys of lowest priority, ascending, with their priorities.

        Nothing is removed: the caller evicts (``remove``) or pushes again.
        """
        if want <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        if self.dense:
            return self._smallest_dense(want)
        c = self._c
        # A large pending buffer is cheaper merged than scanned on every call.
        if c > max(64, (self._n - self._h) >> 3):
            self._merge()
            c = 0
        k, p = self._scan_sorted(want)
        if c == 0:
            return k, p
        pp = self._pp[:c]
        if k.shape[0] == want and pp.min() >= p[-1]:
            return k, p  # nothing pending can beat the sorted run's candidates
        pk = self._pk[:c]
        ok = np.flatnonzero(self.stamp[pk] == self._pv[:c])
        if ok.shape[0] == 0:
            return k, p
        k = np.concatenate([k, pk[ok]])
        p = np.concatenate([p, pp[ok]])
        order = np.argsort(p, kind="stable")[:want]
        return k[order], p[order]

    def _smallest_dense(self, want: int) -> tuple[np.ndarray, np.ndarray]:
        cand = np.flatnonzero(self.member)
        p = self.cur[cand]
        if cand.shape[0] > want:
            if want == 1:
                i = int(p.argmin())
                return cand[i : i + 1], p[i : i + 1]
            sel = np.argpartition(p, want - 1)[:want]
            cand, p = cand[sel], p[sel]
        order = np.argsort(p, kind="stable")
        return cand[order], p[order]
