"""Regime (b), the prefix cache across requests: radix-node reuse under a token budget.

Each request arrives with its radix path (root -> leaf nodes, each of some
tokens). Like SGLang's radix cache:

- hit tokens are the tokens of the longest prefix of the path whose nodes are
  all resident (a resident node whose ancestor is not resident is not a hit);
- the rest of the path is inserted after the hit prefix, ancestors first;
- only leaves are evicted (resident nodes without resident children), and never
  a node of the request being served; a parent becomes evictable once its last
  child is gone.

If a path alone exceeds the budget, the prefix that fits is inserted and the
rest bypasses the cache. Budgets are fractions of the unique tokens of all
paths.

Live traces name SGLang's radix nodes as recorded; paths recorded before a
node was split are resolved to the finest split first (``resolve_splits``), and
a request's path covers its prompt and its output (SGLang inserts both when it
finishes), so the next turn of a conversation can hit the previous answer.

Node importance for one request is the node's attention mass per decode step
of that request (summed over the node's pages, averaged over the request's
(step, layer, kv_head) groups), taken from the ``accesses`` table; without it
each node gets its share of the path's tokens. Mass recall is the share of a
request's node importance that falls on hit nodes.

The replay is a Python loop over requests and path nodes (paths are short; a
few hundred thousand nodes per second) with a lazily cleaned binary heap.
Policies whose priority moves with time (``shipped``) are instead ranked at each
eviction pass over the evictable leaves, as SGLang does, and get the node state
they need (token offsets, decode steps per request, the mass on the sink pages)
from :class:`PrefixData`.
"""

from __future__ import annotations

import heapq
import time
import warnings
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from sgl_importance.importance.priority import SINK_PAGES_MAX
from sgl_importance.sim.metrics import Counts, ReplayResult
from sgl_importance.sim.policies import replay_points
from sgl_importance.sim.policy_base import Policy, StreamContext
from sgl_importance.trace.schema import TraceMeta
from sgl_importance.trace.splits import resolve_splits
from sgl_importance.trace.tables import Accesses, Requests


@dataclass
class PrefixData:
    """Requests in arrival order with dense node indices.

    Request ``r`` (arrival order) has path ``path_node[path_ptr[r]:path_ptr[r+1]]``
    and, at the same positions, each node's mass for that request.
    """

    node_parent: np.ndarray
    node_tokens: np.ndarray
    node_ids: np.ndarray
    path_ptr: np.ndarray
    path_node: np.ndarray
    path_mass: np.ndarray
    request_id: np.ndarray
    has_importance: bool
    # What ``shipped`` needs to rebuild the server's node state (sim/shipped.py):
    # tokens per page, each node's first token offset in its sequence, each
    # request's decode steps, and its mass per step on the sequence's first
    # SINK_PAGES_MAX pages (rows with a node id), to leave sink pages out of density.
    page_size: int = 16
    node_start: np.ndarray | None = None
    request_steps: np.ndarray | None = None
    head_mass: np.ndarray | None = None
    # Tokens each request holds while it runs beyond the nodes it inserts (its partial
    # last page, an allocator's margin): room the eviction before it must free too.
    transient_tokens: np.ndarray | None = None

    @property
    def n_nodes(self) -> int:
        return int(self.node_tokens.shape[0])

    @property
    def n_requests(self) -> int:
        return int(self.path_ptr.shape[0] - 1)

    @property
    def unique_tokens(self) -> int:
        return int(self.node_tokens.sum())


def _node_mass(
    trace: Accesses, tr_req: np.ndarray, req_codes: np.ndarray, path_node_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Mass per step of (request, node) for each path entry; and whether it was found.

    ``tr_req`` are the trace rows' request codes in the requests table's code space.
    """
    ok = (trace.node_id >= 0) & (tr_req >= 0)
    rq, nd, imp = tr_req[ok], trace.node_id[ok], trace.importance[ok].astype(np.float64)
    if rq.shape[0] == 0:
        return np.zeros(req_codes.shape[0]), np.zeros(req_codes.shape[0], bool)
    # Steps per request: distinct (step, layer, kv_head) groups, so per-layer traces average.
    grp = np.unique(
        np.stack([tr_req, trace.step, trace.layer.astype(np.int64), trace.kv_head.astype(np.int64)]), axis=1
    )
    greq, gcount = np.unique(grp[0], return_counts=True)
    node_u, node_c = np.unique(nd, return_inverse=True)
    key = rq * node_u.shape[0] + node_c.reshape(-1)
    ukey, inv = np.unique(key, return_inverse=True)
    msum = np.bincount(inv.reshape(-1), weights=imp, minlength=ukey.shape[0])
    steps = gcount[np.searchsorted(greq, ukey // node_u.shape[0])]
    mper = msum / np.maximum(steps, 1)
    # Look up each path entry (request, node id).
    pos_n = np.searchsorted(node_u, path_node_ids)
    pos_n = np.minimum(pos_n, node_u.shape[0] - 1)
    node_found = node_u[pos_n] == path_node_ids
    q = req_codes * node_u.shape[0] + pos_n
    pos = np.minimum(np.searchsorted(ukey, q), ukey.shape[0] - 1)
    found = node_found & (ukey[pos] == q)
    return np.where(found, mper[pos], 0.0), found


def _steps_and_head_mass(trace: Accesses, tr_req: np.ndarray, req_codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per request (``req_codes`` order): distinct decode steps, and mass per step on
    each of the first ``SINK_PAGES_MAX`` page positions (same per-step averaging as
    :func:`_node_mass`)."""
    n = req_codes.shape[0]
    steps = np.zeros(n, np.int64)
    head = np.zeros((n, SINK_PAGES_MAX), np.float64)
    ok = tr_req >= 0
    if not ok.any():
        return steps, head
    rq = tr_req[ok]
    n_codes = int(max(rq.max(), req_codes.max(initial=0))) + 1
    pairs = np.unique(np.stack([rq, trace.step[ok]]), axis=1)
    per_code_steps = np.bincount(pairs[0], minlength=n_codes)
    layer, kv_head = trace.layer[ok].astype(np.int64), trace.kv_head[ok].astype(np.int64)
    grp = np.unique(np.stack([rq, trace.step[ok], layer, kv_head]), axis=1)
    per_code_groups = np.bincount(grp[0], minlength=n_codes)
    pos = trace.position[ok].astype(np.int64)
    sel = (trace.node_id[ok] >= 0) & (pos >= 0) & (pos < SINK_PAGES_MAX)
    mass = trace.importance[ok][sel].astype(np.float64)
    flat = np.bincount(rq[sel] * SINK_PAGES_MAX + pos[sel], weights=mass, minlength=n_codes * SINK_PAGES_MAX)
    flat = flat.reshape(n_codes, SINK_PAGES_MAX)
    flat = flat / np.maximum(per_code_groups, 1)[:, None]
    known = (req_codes >= 0) & (req_codes < n_codes)
    steps[known] = per_code_steps[req_codes[known]]
    head[known] = flat[req_codes[known]]
    return steps, head


def prepare_prefix(requests: Requests, trace: Accesses | None = None, page_size: int | None = None) -> PrefixData:
    """Index the requests table (and node importance from ``trace`` if given).

    Paths recorded before a radix split are first resolved to the finest split
    (``trace.splits.resolve_splits``), so live traces replay like synthetic ones.
    Requests replay by ``arrival_step``, ties by ``arrival_ns``, then table order.

    Raises:
        ValueError: a node appears under two different parents.
    """
    if page_size is None and trace is not None:
        page_size = trace.meta.page_size
    requests, trace = resolve_splits(requests, trace, page_size)
    order = np.lexsort((requests.arrival_ns, requests.arrival_step))
    lens = np.diff(requests.node_ptr)[order]
    starts = requests.node_ptr[:-1][order]
    ptr = np.zeros(order.shape[0] + 1, np.int64)
    np.cumsum(lens, out=ptr[1:])
    idx = np.repeat(starts - ptr[:-1], lens) + np.arange(ptr[-1])
    raw_ids = requests.node_ids[idx]
    raw_tok = requests.node_tokens[idx].astype(np.int64)
    node_u, node = np.unique(raw_ids, return_inverse=True)
    node = node.reshape(-1).astype(np.int64)
    n_nodes = node_u.shape[0]

    first_in_path = np.zeros(ptr[-1], bool)
    first_in_path[ptr[:-1][lens > 0]] = True
    par_entry = np.where(first_in_path, -1, np.concatenate([[-1], node[:-1]]))
    pairs = np.unique(np.stack([node, par_entry]), axis=1)
    if pairs.shape[1] != n_nodes:
        bad = pairs[0][np.flatnonzero(pairs[0][1:] == pairs[0][:-1])]
        raise ValueError(f"prefix trace: node(s) {node_u[bad][:5].tolist()} appear under different parents")
    parent = np.full(n_nodes, -1, np.int64)
    parent[pairs[0]] = pairs[1]
    tokens = np.zeros(n_nodes, np.int64)
    tokens[node[::-1]] = raw_tok[::-1]  # first occurrence wins
    if (tokens[node] != raw_tok).any():
        warnings.warn(
            "prefix trace: a node id has different token counts in different paths; using the first",
            RuntimeWarning,
            stacklevel=2,
        )

    req_codes = requests.request_id[order]
    req_of_entry = np.repeat(req_codes, lens)
    fallback = raw_tok / np.maximum(np.repeat(np.add.reduceat(raw_tok, ptr[:-1]) if ptr[-1] else np.zeros(0), lens), 1)
    mass = fallback.astype(np.float64)
    has_imp = False
    # First token offset of each node: the tokens before it on (any) path through it.
    entry_start = np.cumsum(raw_tok) - raw_tok - np.repeat(np.concatenate([[0], np.cumsum(raw_tok)])[ptr[:-1]], lens)
    start = np.zeros(n_nodes, np.int64)
    start[node[::-1]] = entry_start[::-1]
    steps = np.zeros(order.shape[0], np.int64)
    head = np.zeros((order.shape[0], SINK_PAGES_MAX), np.float64)
    if trace is not None and len(trace):
        tr_codes = trace.request_id
        if trace.request_labels is not None or requests.request_labels is not None:
            tl = trace.request_labels if trace.request_labels is not None else None
            rl = requests.request_labels
            if tl is None or rl is None:
                raise ValueError("prefix trace: request ids are strings in one table and integers in the other")
            # Bring the trace's codes into the requests table's label space.
            tr_codes = np.searchsorted(rl.astype(str), tl.astype(str)[tr_codes])
            tr_codes = np.where(
                rl.astype(str)[np.minimum(tr_codes, len(rl) - 1)] == tl.astype(str)[trace.request_id], tr_codes, -1
            )
        m, found = _node_mass(trace, tr_codes, req_of_entry, raw_ids)
        if found.any():
            has_imp = True
            mass = np.where(found, m, 0.0)
        steps, head = _steps_and_head_mass(trace, tr_codes, req_codes)
    return PrefixData(
        node_parent=parent,
        node_tokens=tokens,
        node_ids=node_u.astype(np.int64),
        path_ptr=ptr,
        path_node=node,
        path_mass=mass,
        request_id=req_codes,
        has_importance=has_imp,
        page_size=int(page_size) if page_size else TraceMeta().page_size,
        node_start=start,
        request_steps=steps,
        head_mass=head,
    )


def longest_resident_prefix(path: Sequence[int], resident: Sequence[bool]) -> int:
    """Number of leading path nodes that are resident (stops at the first that is not)."""
    h = 0
    for x in path:
        if not resident[x]:
            break
        h += 1
    return h


def replay_prefix(
    pd: PrefixData,
    policy: Policy,
    budget_tokens: int,
    *,
    seed: int = 0,
    evictions: list[int] | None = None,
) -> tuple[Counts, np.ndarray]:
    """Replay all requests through a radix cache of ``budget_tokens`` tokens.

    Args:
        evictions: if given, the node ids evicted are appended to it, in order.

    Returns:
        Totals, and the hit tokens of each request (arrival order).
    """
    if "prefix" not in policy.regimes:
        raise ValueError(f"policy {policy.label!r} does not support the prefix regime")
    n = pd.n_nodes
    ptr = pd.path_ptr
    ctx = StreamContext(
        n_keys=n,
        budget=int(budget_tokens),
        n_events=pd.n_requests,
        row_keys=pd.path_node,
        row_mass=pd.path_mass,
        ev_row_ptr=ptr,
        ev_demand=np.diff(ptr),
        rng=np.random.default_rng(seed),
        key_tokens=pd.node_tokens,
        key_start=pd.node_start,
        page_size=pd.page_size,
        ev_steps=pd.request_steps,
        ev_head_mass=pd.head_mass,
    )
    policy.reset(ctx)
    # Priorities fixed at the last touch sit in a lazily cleaned heap; priorities
    # that move with time are ranked afresh at each eviction pass, like SGLang's.
    ranked = policy.ranks_at_eviction
    parent = pd.node_parent.tolist()
    tok = pd.node_tokens.tolist()
    resident = [False] * n
    nchild = [0] * n
    ver = [0] * n
    cur: list = [0.0] * n
    heap: list[tuple] = []
    seq = 0
    used = 0
    budget = int(budget_tokens)
    nodes_l = pd.path_node.tolist()
    mass_l = pd.path_mass.tolist()
    ptr_l = ptr.tolist()
    ids_l = pd.node_ids.tolist()
    hit_tokens = np.zeros(pd.n_requests, np.int64)
    c = Counts()
    for r in range(pd.n_requests):
        lo, hi = ptr_l[r], ptr_l[r + 1]
        path = nodes_l[lo:hi]
        h = longest_resident_prefix(path, resident)
        ht = sum(tok[x] for x in path[:h])
        hit_tokens[r] = ht
        c.events += 1
        c.accesses += sum(tok[x] for x in path)
        c.hits += ht
        c.mass_total += sum(mass_l[lo:hi])
        c.mass_resident += sum(mass_l[lo : lo + h])
        if ranked:
            policy.matched(path, h)
        need = sum(tok[x] for x in path[h:])
        if pd.transient_tokens is not None:
            need += int(pd.transient_tokens[r])
        pinned = set(path)
        if ranked and used + need > budget:
            leaves = [x for x in range(n) if resident[x] and not nchild[x] and x not in pinned]
            heap = [(p, x, ver[x]) for p, x in zip(policy.rank(leaves), leaves)]
            heapq.heapify(heap)
        while used + need > budget and heap:
            x, v = heapq.heappop(heap)[-2:]
            if v != ver[x] or not resident[x] or nchild[x] or x in pinned:
                continue  # stale entry, or not evictable now: it is pushed again when it becomes a leaf
            resident[x] = False
            used -= tok[x]
            if evictions is not None:
                evictions.append(ids_l[x])
            p = parent[x]
            if p >= 0:
                nchild[p] -= 1
                if nchild[p] == 0 and resident[p] and p not in pinned:
                    ver[p] += 1
                    if ranked:
                        heapq.heappush(heap, (policy.rank([p])[0], p, ver[p]))
                    else:
                        seq += 1
                        heapq.heappush(heap, (cur[p], seq, p, ver[p]))
        m = h
        for x in path[h:]:
            if used + tok[x] > budget:
                break
            resident[x] = True
            used += tok[x]
            p = parent[x]
            if p >= 0:
                nchild[p] += 1
            m += 1
        c.fetched += sum(tok[x] for x in path[h:m])
        if m == 0:
            continue
        keys = np.asarray(path[:m], np.int64)
        if ranked:
            policy.inserted(path[h:m])
            policy.decoded(r, keys, lo)
            for x in path[:m]:
                ver[x] += 1  # a node touched again leaves the pass's stale entries behind
            heap = []
            continue
        hit = np.zeros(m, bool)
        hit[:h] = True
        prios = policy.priorities(keys, pd.path_mass[lo : lo + m], r, hit, lo, lo + m).tolist()
        for x, pr in zip(path[:m], prios):
            cur[x] = pr
            ver[x] += 1
            if nchild[x] == 0:
                seq += 1
                heapq.heappush(heap, (pr, seq, x, ver[x]))
        if len(heap) > 4 * n + 1024:
            # Too many stale entries: rebuild from the live leaves.
            heap = [(cur[x], 0, x, ver[x]) for x in range(n) if resident[x] and nchild[x] == 0]
            heapq.heapify(heap)
    return c, hit_tokens


def replay_prefix_all(
    pd: PrefixData,
    policies: Sequence[str | Policy],
    budget_fracs: Iterable[float],
    *,
    seed: int = 0,
    progress: bool = False,
) -> list[ReplayResult]:
    """Replay each (policy, budget fraction of the unique tokens)."""
    it = replay_points("prefix", policies, budget_fracs)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="prefix replay", unit="run")
    out = []
    for pol, frac in it:
        budget = max(1, int(round(frac * pd.unique_tokens)))
        t0 = time.perf_counter()
        counts, _ = replay_prefix(pd, pol, budget, seed=seed)
        out.append(
            ReplayResult(
                regime="prefix",
                policy=pol.label,
                budget_frac=frac,
                budget=budget,
                counts=counts,
                seconds=time.perf_counter() - t0,
            )
        )
    return out
