"""Resolving radix splits: paths recorded before SGLang split a node, rewritten.

SGLang splits a node in place: the suffix keeps the id and a new node takes the
prefix, so a node's end offset on the path never changes while its start can only
grow. Paths recorded before a split therefore name the unsplit node;
:func:`resolve_splits` rewrites every path and access row to the finest split seen
anywhere in the trace, after which every node has one parent and requests sharing
a prefix share the node ids of the shared pages. Synthetic traces are already in
that form (resolution leaves them unchanged).
"""

from __future__ import annotations

import warnings

import numpy as np

from sgl_importance.trace.schema import ACCESS_DTYPES, REQUEST_EXTRA
from sgl_importance.trace.tables import Accesses, Requests


def resolve_splits(
    requests: Requests, accesses: Accesses | None = None, page_size: int | None = None
) -> tuple[Requests, Accesses | None]:
    """Rewrite paths and access rows recorded before a radix split to the finest split seen.

    SGLang splits a node by giving its prefix to a new parent and keeping the id on
    the suffix, so a node's end offset is fixed and its final start is the largest
    start any path shows for it; its final parent is the parent in that path. An
    entry that covered more (an earlier start) becomes the chain of final
    ancestors covering the same tokens. A piece no recorded path names (its
    request was never recorded) becomes a new node id above the largest one.

    Args:
        requests: the ``requests`` table.
        accesses: the ``accesses`` table; rows are re-assigned by token offset
            ``position * page_size`` (rows without a position keep their node).
        page_size: tokens per page; default ``accesses.meta.page_size``.

    Returns:
        Both tables rewritten (the inputs themselves when nothing was split).
    """
    ptr = requests.node_ptr
    ids = requests.node_ids.astype(np.int64)
    tok = requests.node_tokens.astype(np.int64)
    n_ent = ids.shape[0]
    if n_ent == 0:
        return requests, accesses
    lens = np.diff(ptr)
    row_start = np.repeat(ptr[:-1], lens)
    csum = np.cumsum(tok)
    end = csum - np.repeat(np.concatenate([[0], csum])[ptr[:-1]], lens)
    start = end - tok
    first = np.arange(n_ent) == row_start
    parent = np.where(first, -1, np.concatenate([[-1], ids[:-1]]))

    uniq, inv = np.unique(ids, return_inverse=True)
    inv = inv.reshape(-1)
    node_end = np.full(uniq.shape[0], -1, np.int64)
    node_end[inv] = end
    if (node_end[inv] != end).any():
        warnings.warn(
            "resolve_splits: a node id ends at different offsets in different paths; "
            "node ids do not follow SGLang's split rule, paths left as recorded",
            RuntimeWarning,
            stacklevel=2,
        )
        return requests, accesses
    final_start = np.full(uniq.shape[0], -1, np.int64)
    np.maximum.at(final_start, inv, start)
    if (start == final_start[inv]).all():
        return requests, accesses
    final_parent = np.full(uniq.shape[0], -1, np.int64)
    at_final = start == final_start[inv]
    final_parent[inv[at_final]] = parent[at_final]
    index = {int(n): i for i, n in enumerate(uniq)}
    S, E, P = final_start.tolist(), node_end.tolist(), final_parent.tolist()
    next_id = int(uniq.max()) + 1
    gaps: dict[tuple[int, int], int] = {}

    def chain(n: int, s: int) -> list[tuple[int, int]]:
        """(node, tokens) from offset ``s`` down to node ``n``'s end."""
        nonlocal next_id
        i = index[n]
        out = [(n, E[i] - S[i])]
        cur = i
        while S[cur] > s:
            p = P[cur]
            pi = index.get(p) if p >= 0 else None
            if pi is None or E[pi] != S[cur] or S[pi] < s:
                key = (s, S[cur])
                if key not in gaps:
                    gaps[key] = next_id
                    next_id += 1
                out.append((gaps[key], S[cur] - s))
                break
            out.append((p, E[pi] - S[pi]))
            cur = pi
        return out[::-1]

    new_ids: list[int] = []
    new_tok: list[int] = []
    new_ptr = [0]
    ids_l, start_l, ptr_l = ids.tolist(), start.tolist(), ptr.tolist()
    for r in range(len(requests)):
        for k in range(ptr_l[r], ptr_l[r + 1]):
            for n, t in chain(ids_l[k], start_l[k]):
                new_ids.append(n)
                new_tok.append(t)
        new_ptr.append(len(new_ids))
    out_req = Requests(
        request_id=requests.request_id,
        arrival_step=requests.arrival_step,
        node_ptr=np.asarray(new_ptr, np.int64),
        node_ids=np.asarray(new_ids, np.int64),
        node_tokens=np.asarray(new_tok, np.int32),
        output_tokens=requests.output_tokens,
        request_labels=requests.request_labels,
        **{name: getattr(requests, name) for name in REQUEST_EXTRA},
    )
    if accesses is None or len(accesses) == 0:
        return out_req, accesses
    ps = int(page_size if page_size is not None else accesses.meta.page_size)
    node = accesses.node_id.astype(np.int64)
    pos = np.searchsorted(uniq, node)
    known = (node >= 0) & (accesses.position >= 0) & (pos < uniq.shape[0])
    known[known] = uniq[pos[known]] == node[known]
    cur = np.where(known, pos, -1)
    offset = accesses.position.astype(np.int64) * ps
    par_idx = np.array([index.get(p, -1) if p >= 0 else -1 for p in P], np.int64)
    # Walk each row up the final parents until its node starts at or before the row's offset.
    while True:
        move = (cur >= 0) & (offset < np.where(cur >= 0, final_start[np.maximum(cur, 0)], 0))
        move &= par_idx[np.maximum(cur, 0)] >= 0
        if not move.any():
            break
        cur[move] = par_idx[cur[move]]
    new_node = np.where(cur >= 0, uniq[np.maximum(cur, 0)], node)
    out_acc = Accesses(
        **{**{name: getattr(accesses, name) for name in ACCESS_DTYPES}, "node_id": new_node},
        request_labels=accesses.request_labels,
        meta=accesses.meta,
    )
    return out_req, out_acc
