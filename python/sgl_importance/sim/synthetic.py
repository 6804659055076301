"""Seeded synthetic traces with known structure, in the recorded trace format.

Every decode step of every request gets a softmax over the pages in its
context. A page's logit is the sum of

- a structural part fixed per page (attention sink, system prompt, a
  document's key passages, tool schemas, chain-of-thought anchors);
- a recency bump ``recency * exp(-distance_in_pages / width)``;
- AR(1) noise over steps (``noise``, correlation ``rho``), independent per
  (layer, kv_head) so heads differ.

Kinds (what each one is for):

- ``multi_turn``: conversations of several turns sharing one system prompt;
  old turns hold a few topic pages. Prefix reuse across turns.
- ``rag``: a handful of shared documents, one of them (document 0) asked about
  by most requests and heavily attended at its key passages.
- ``agent``: agent loops that resend one long tool-laden system prompt and grow a
  scratchpad of actions and observations; the tool-schema pages stay hot.
- ``cot``: long chain-of-thought: the problem statement and periodic anchor
  pages, all old, carry the mass, recency little. Importance beats recency.
- ``loop``: attention sweeps cyclically over more pages than a small cache holds,
  each page with a fixed weight: LRU gets no hits, importance keeps the heavy pages.

Page ids follow the recorder's scheme ``node_id * 2**20 + page offset``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sgl_importance.trace.schema import TraceMeta
from sgl_importance.trace.tables import Accesses, Requests, TraceSet

NODE_SHIFT = 20
KINDS = ("multi_turn", "rag", "agent", "cot", "loop")


@dataclass
class _Req:
    """One request to synthesise: its prompt path and how it attends."""

    rid: int
    turn: int
    arrival: int
    nodes: list[int]
    node_tokens: list[int]
    out_node: int
    n_decode: int
    # Structural logit per prompt page (same order as the prompt's pages).
    base: np.ndarray
    gen_base: float = 0.0
    gen_anchor_every: int = 0
    gen_anchor_gain: float = 0.0
    recency: float = 3.0
    width: float = 2.0
    # Intermittently attended pages (context indices; generated pages count
    # from the end of the prompt): each step each one fires with probability q.
    active: np.ndarray | None = None
    q: float = 0.0
    gain: float = 0.0
    focus: np.ndarray | None = None  # loop kind: (n_decode, n_prompt_pages) extra logits


def _pages_of(nodes: list[int], tokens: list[int], page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page ids, owning node and position of every page of a path."""
    ids, own = [], []
    for n, t in zip(nodes, tokens):
        k = max(1, math.ceil(t / page_size))
        ids.append((np.int64(n) << NODE_SHIFT) + np.arange(k, dtype=np.int64))
        own.append(np.full(k, n, np.int64))
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32)
    p = np.concatenate(ids)
    return p, np.concatenate(own), np.arange(p.shape[0], dtype=np.int32)


def _decode_rows(
    req: _Req,
    page_size: int,
    layers: int,
    kv_heads: int,
    noise: float,
    rho: float,
    sharpness: float,
    rng: np.random.Generator,
    chunk: int = 256,
) -> dict[str, np.ndarray]:
    pages, owner, _ = _pages_of(req.nodes, req.node_tokens, page_size)
    n_p = pages.shape[0]
    n_g = max(1, math.ceil(req.n_decode / page_size))
    ctx_pages = np.concatenate([pages, (np.int64(req.out_node) << NODE_SHIFT) + np.arange(n_g, dtype=np.int64)])
    ctx_node = np.concatenate([owner, np.full(n_g, req.out_node, np.int64)])
    gen = np.full(n_g, req.gen_base)
    active = req.active if req.active is not None else np.zeros(0, np.int64)
    if req.gen_anchor_every > 0:
        anchors = np.arange(req.gen_anchor_every - 1, n_g, req.gen_anchor_every)
        gen[anchors] += req.gen_anchor_gain
        active = np.concatenate([active, n_p + anchors])
    base = np.concatenate([req.base, gen])
    n_c = n_p + n_g
    pos = np.arange(n_c)
    lh = [(layer, h) for layer in range(layers) for h in range(kv_heads)]
    reduced = layers == 1 and kv_heads == 1
    out: dict[str, list[np.ndarray]] = {
        k: [] for k in ("step", "layer", "kv_head", "page", "node_id", "position", "importance")
    }
    for layer, h in lh:
        # Heads see the same structure with their own perturbation of it.
        head_base = base + (0.0 if reduced else 0.5 * rng.standard_normal(n_c))
        eps = rng.standard_normal(n_c) * noise
        for j0 in range(0, req.n_decode, chunk):
            j1 = min(req.n_decode, j0 + chunk)
            js = np.arange(j0, j1)
            noise_m = np.empty((j1 - j0, n_c))
            for i in range(j1 - j0):
                eps = rho * eps + math.sqrt(1 - rho * rho) * noise * rng.standard_normal(n_c)
                noise_m[i] = eps
            last = n_p + js // page_size
            dist = last[:, None] - pos[None, :]
            exists = dist >= 0
            logit = head_base[None, :] + req.recency * np.exp(-np.maximum(dist, 0) / req.width) + noise_m
            if req.focus is not None:
                logit[:, :n_p] += req.focus[j0:j1]
            if active.shape[0] and req.q > 0:
                fire = rng.random((j1 - j0, active.shape[0])) < req.q
                logit[:, active] += req.gain * fire
            logit = np.where(exists, sharpness * logit, -np.inf)
            logit -= logit.max(axis=1, keepdims=True)
            w = np.exp(logit)
            w /= w.sum(axis=1, keepdims=True)
            ji, ci = np.nonzero(exists)
            out["step"].append(req.arrival + js[ji])
            out["layer"].append(np.full(ji.shape[0], -1 if reduced else layer, np.int16))
            out["kv_head"].append(np.full(ji.shape[0], -1 if reduced else h, np.int16))
            out["page"].append(ctx_pages[ci])
            out["node_id"].append(ctx_node[ci])
            out["position"].append(ci.astype(np.int32))
            out["importance"].append(w[ji, ci].astype(np.float32))
    cols = {k: np.concatenate(v) for k, v in out.items()}
    n = cols["step"].shape[0]
    cols["request_id"] = np.full(n, req.rid, np.int64)
    cols["turn"] = np.full(n, req.turn, np.int32)
    cols["time_ns"] = cols["step"] * 20_000_000  # a nominal 20 ms per decode step
    return cols


def _base_for(
    nodes: list[int], tokens: list[int], page_size: int, gains: dict[int, float], sink: float = 3.0
) -> np.ndarray:
    """Structural logits: per-node gain for all its pages, plus the sink on page 0."""
    _, owner, _ = _pages_of(nodes, tokens, page_size)
    base = np.array([gains.get(int(n), 0.0) for n in owner], np.float64)
    if base.shape[0]:
        base[0] += sink
    return base


def _topical(
    rid: int,
    turn: int,
    arrival: int,
    nodes: list[int],
    tokens: list[int],
    out_node: int,
    n_decode: int,
    base: np.ndarray,
    *,
    active: np.ndarray,
    q: float,
) -> _Req:
    """A chat-like request: its prompt's structure, a recency bump 1.5 pages wide, and
    ``active`` pages that each fire (gain 4) with probability ``q`` per step.

    The path lists are copied: the generators keep growing theirs for the next turn.
    """
    return _Req(
        rid,
        turn,
        arrival,
        list(nodes),
        list(tokens),
        out_node,
        n_decode,
        base,
        recency=3.0,
        width=1.5,
        active=active,
        q=q,
        gain=4.0,
    )


class _Ids:
    def __init__(self) -> None:
        self.next = 1

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


def _multi_turn(rng: np.random.Generator, scale: float, ps: int) -> list[_Req]:
    new = _Ids()
    system = new()
    sys_tok = 512
    reqs: list[_Req] = []
    rid = 0
    for _ in range(max(1, round(6 * scale))):
        nodes, toks = [system], [sys_tok]
        t0 = int(rng.integers(0, 200))
        topical = np.zeros(0, np.int64)
        for turn in range(5):
            prev_pages = sum(max(1, math.ceil(x / ps)) for x in toks)
            user = new()
            nodes.append(user)
            toks.append(int(rng.integers(80, 300)))
            n_dec = int(rng.integers(64, 192))
            base = _base_for(nodes, toks, ps, {system: 0.5, user: 1.5})
            # Three pages of each finished turn stay topical for the rest of the
            # conversation: attended now and then, strongly.
            if turn > 0:
                cand = np.arange(math.ceil(sys_tok / ps), prev_pages)
                cand = np.setdiff1d(cand, topical)
                topical = np.concatenate([topical, rng.choice(cand, size=min(3, cand.shape[0]), replace=False)])
            out = new()
            reqs.append(_topical(rid, turn, t0, nodes, toks, out, n_dec, base, active=topical.copy(), q=0.2))
            rid += 1
            nodes.append(out)
            toks.append(n_dec)
            t0 += n_dec + int(rng.integers(20, 120))
    return reqs


def _rag(rng: np.random.Generator, scale: float, ps: int) -> list[_Req]:
    new = _Ids()
    system = new()
    docs = [new() for _ in range(8)]
    doc_tok = 1024
    key_pages = {d: rng.choice(doc_tok // ps, size=5, replace=False) for d in docs}
    p = 1.0 / np.arange(1, len(docs) + 1) ** 1.5
    p /= p.sum()
    reqs = []
    t = 0
    for rid in range(max(1, round(24 * scale))):
        d = docs[int(rng.choice(len(docs), p=p))]
        q = new()
        nodes, toks = [system, d, q], [128, doc_tok, 64]
        hot = d == docs[0]
        base = _base_for(nodes, toks, ps, {d: 1.5 if hot else 0.5, q: 2.0})
        off = math.ceil(128 / ps)
        n_dec = int(rng.integers(96, 160))
        reqs.append(
            _topical(rid, 0, t, nodes, toks, new(), n_dec, base, active=off + key_pages[d], q=0.4 if hot else 0.25)
        )
        t += int(rng.integers(20, 60))
    return reqs


def _agent(rng: np.random.Generator, scale: float, ps: int) -> list[_Req]:
    new = _Ids()
    system = new()
    sys_tok = 1024
    tool_pages = rng.choice(sys_tok // ps, size=4, replace=False)
    reqs = []
    rid = 0
    for _ in range(max(1, round(3 * scale))):
        task = new()
        nodes, toks = [system, task], [sys_tok, int(rng.integers(64, 160))]
        t = int(rng.integers(0, 100))
        for it in range(8):
            gains = {system: 0.3, task: 1.5}
            if it > 0:
                gains[nodes[-1]] = 1.5  # the latest observation
            base = _base_for(nodes, toks, ps, gains)
            n_dec = int(rng.integers(48, 96))
            act = new()
            reqs.append(_topical(rid, it, t, nodes, toks, act, n_dec, base, active=tool_pages, q=0.3))
            rid += 1
            obs = new()
            nodes += [act, obs]
            toks += [n_dec, int(rng.integers(100, 400))]
            t += n_dec + int(rng.integers(5, 30))
    return reqs


def _cot(rng: np.random.Generator, scale: float, ps: int) -> list[_Req]:
    new = _Ids()
    reqs = []
    t = 0
    for rid in range(max(1, round(1 * scale))):
        prob = new()
        nodes, toks = [prob], [256]
        base = _base_for(nodes, toks, ps, {prob: 1.0})
        n_dec = 4096
        # Problem pages and every 12th reasoning page are revisited now and then,
        # long after they were written; recency explains little.
        reqs.append(
            _Req(
                rid,
                0,
                t,
                nodes,
                toks,
                new(),
                n_dec,
                base,
                gen_base=0.0,
                gen_anchor_every=12,
                gen_anchor_gain=1.0,
                recency=3.0,
                width=1.0,
                active=np.arange(1, base.shape[0]),
                q=0.15,
                gain=5.0,
            )
        )
        t += 64
    return reqs


def _loop(rng: np.random.Generator, scale: float, ps: int) -> list[_Req]:
    new = _Ids()
    reqs = []
    t = 0
    w_pages = 64
    for rid in range(max(1, round(1 * scale))):
        ctx = new()
        nodes, toks = [ctx], [w_pages * ps]
        n_dec = 2048
        weight = rng.uniform(0.0, 3.0, size=w_pages)
        focus = np.zeros((n_dec, w_pages))
        step_pages = 8
        for j in range(n_dec):
            sel = (j * step_pages + np.arange(step_pages)) % w_pages
            focus[j, sel] = 6.0 + weight[sel]
        base = np.zeros(w_pages)
        reqs.append(
            _Req(rid, 0, t, nodes, toks, new(), n_dec, base, gen_base=-2.0, recency=0.0, width=1.0, focus=focus)
        )
        t += n_dec
    return reqs


_GEN = {"multi_turn": _multi_turn, "rag": _rag, "agent": _agent, "cot": _cot, "loop": _loop}


def synthesize(
    kind: str,
    *,
    seed: int = 0,
    scale: float = 1.0,
    page_size: int = 16,
    layers: int = 1,
    kv_heads: int = 1,
    noise: float = 1.0,
    rho: float = 0.5,
    sharpness: float = 1.5,
) -> TraceSet:
    """Generate a synthetic trace (both tables) of the given kind.

    Args:
        kind: one of :data:`KINDS`.
        seed: the same seed gives the same trace.
        scale: multiplies the number of conversations / requests / agents.
        layers, kv_heads: 1 and 1 give a reduced trace (layer = kv_head = -1).
        noise, rho: AR(1) logit noise level and its step-to-step correlation.
        sharpness: inverse softmax temperature; higher concentrates the mass on
            fewer pages (real long-context attention is concentrated).
    """
    if kind not in _GEN:
        raise ValueError(f"unknown synthetic kind {kind!r}; known: {', '.join(KINDS)}")
    if scale <= 0 or page_size < 1 or layers < 1 or kv_heads < 1:
        raise ValueError("scale > 0, page_size >= 1, layers >= 1 and kv_heads >= 1 are required")
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"rho={rho} out of range [0, 1)")
    rng = np.random.default_rng(seed)
    reqs = _GEN[kind](rng, scale, page_size)
    parts = [_decode_rows(r, page_size, layers, kv_heads, noise, rho, sharpness, rng) for r in reqs]
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.lexsort((cols["page"], cols["kv_head"], cols["layer"], cols["request_id"], cols["step"]))
    cols = {k: v[order] for k, v in cols.items()}
    meta = TraceMeta(
        page_size=page_size,
        model="synthetic",
        workload=kind,
        extra={
            "seed": seed,
            "scale": scale,
            "layers": layers,
            "kv_heads": kv_heads,
            "noise": noise,
            "rho": rho,
            "sharpness": sharpness,
        },
    )
    trace = Accesses.from_columns(cols, meta)
    requests = Requests.from_lists(
        [r.rid for r in reqs],
        [r.arrival for r in reqs],
        [r.nodes for r in reqs],
        [r.node_tokens for r in reqs],
        [r.n_decode for r in reqs],
    )
    meta.access_rows, meta.request_rows = len(trace), len(requests)
    return TraceSet(meta=meta, accesses=trace, requests=requests)
