"""The offline page model of a trace replay: the same pages, SGLang's radix rules, any policy.

A scaled slice (``production_trace.py``) is replayed by the simulator's prefix cache
(``sgl_importance.sim.prefix.replay_prefix``) on radix nodes of whole pages, split
where SGLang's tree splits them (where a prompt or a sequence ends, where paths part):

- a request's path is its full prompt pages (one per block that scales to a whole
  page), then the pages its own output fills: SGLang keeps the prompt and the KV of
  all but the last generated token, page-aligned, so a prompt ending in a partial
  page plus ``new_tokens - 1`` generated tokens may fill one more page, which no
  later request shares;
- a hit is a resident prefix of the path, at most ``(prompt - 1) // page`` pages
  (SGLang computes at least one prompt token);
- the budget is the device pool's tokens; requests are served one after another (the
  live replay's closed loop at concurrency 1), and before each, room is made for its
  uncached prompt tokens plus one page, as SGLang's paged allocator asks.

The pages carry no attention mass (the trace releases no text; the replay's token ids
are synthetic), so importance plays no part here: ``shipped`` folds nothing.
``ideal`` is the infinite cache (every prefix seen before is a hit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from benchmark.hit_rate.production_trace import ScaledRequest
from sgl_importance.importance.priority import SINK_PAGES_MAX
from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.policy_base import Policy
from sgl_importance.sim.prefix import PrefixData, replay_prefix

PAGE = 16


@dataclass
class PageModel:
    """A slice as radix paths of pages, and what a request may hit."""

    data: PrefixData
    # Per request (arrival order): the most hit tokens SGLang can report, and the prompt's tokens.
    hit_cap: np.ndarray
    prompt_tokens: np.ndarray

    @property
    def n_requests(self) -> int:
        return self.data.n_requests


def build(requests: Sequence[ScaledRequest], new_tokens: int = 4, page: int = PAGE) -> PageModel:
    """The page model of ``requests`` (in the order they are sent).

    Pages are grouped into radix nodes as SGLang's tree splits them: a node ends
    where a request's prompt or sequence ends, or where paths part, so every request
    path is whole nodes and an eviction frees a whole node, as SGLang's does.

    Args:
        requests: the scaled slice.
        new_tokens: tokens each request generates.
        page: tokens per page (``--page-size``).
    """
    index: dict[tuple[int, int], int] = {}
    parent: list[int] = []
    depth_of: list[int] = []
    paths: list[list[int]] = []
    ends: set[int] = set()
    for r in requests:
        path, up = [], -1
        for depth, block in enumerate(r.full_blocks):
            key = (up, block)
            p = index.get(key)
            if p is None:
                p = index[key] = len(parent)
                parent.append(up)
                depth_of.append(depth)
            path.append(p)
            up = p
        if path:
            ends.add(path[-1])  # the prompt, inserted when its prefill ends
        kept = (len(r.token_ids) + new_tokens - 1) // page
        for depth in range(len(path), kept):  # pages of this request alone
            parent.append(up)
            depth_of.append(depth)
            up = len(parent) - 1
            path.append(up)
        if path:
            ends.add(path[-1])
        paths.append(path)
    children = np.bincount(np.asarray([p for p in parent if p >= 0], np.int64), minlength=len(parent))
    node_of = np.empty(len(parent), np.int64)
    node_parent, node_pages, node_start = [], [], []
    for p, up in enumerate(parent):  # parents come before their children
        if up < 0 or children[up] > 1 or up in ends:
            node_of[p] = len(node_pages)
            node_parent.append(int(node_of[up]) if up >= 0 else -1)
            node_pages.append(1)
            node_start.append(depth_of[p] * page)
        else:
            node_of[p] = node_of[up]
            node_pages[node_of[up]] += 1
    node_paths = [list(dict.fromkeys(node_of[path].tolist())) for path in paths]
    n = len(node_pages)
    lens = np.asarray([len(p) for p in node_paths], np.int64)
    ptr = np.zeros(len(paths) + 1, np.int64)
    np.cumsum(lens, out=ptr[1:])
    flat = np.fromiter((x for p in node_paths for x in p), np.int64, count=int(ptr[-1]))
    tokens = np.asarray(node_pages, np.int64) * page
    path_tokens = np.repeat(np.add.reduceat(tokens[flat], ptr[:-1]) if flat.size else np.zeros(0), lens)
    data = PrefixData(
        node_parent=np.asarray(node_parent, np.int64),
        node_tokens=tokens,
        node_ids=np.arange(n, dtype=np.int64),
        path_ptr=ptr,
        path_node=flat,
        path_mass=tokens[flat] / np.maximum(path_tokens, 1),  # token shares: no attention here
        request_id=np.arange(len(paths), dtype=np.int64),
        has_importance=False,
        page_size=page,
        node_start=np.asarray(node_start, np.int64),
        request_steps=np.zeros(len(paths), np.int64),
        head_mass=np.zeros((len(paths), SINK_PAGES_MAX)),
    )
    prompt = np.asarray([len(r.token_ids) for r in requests], np.int64)
    # SGLang evicts for a prefill's uncached tokens plus a page (its allocation margin);
    # what of that is not a node the request inserts is held only while it runs.
    data.transient_tokens = np.maximum(prompt + page - lens_tokens(node_paths, tokens), 0)
    return PageModel(data, (prompt - 1) // page * page, prompt)


def lens_tokens(paths: list[list[int]], tokens: np.ndarray) -> np.ndarray:
    """Tokens of each path's nodes."""
    return np.asarray([int(tokens[p].sum()) for p in paths], np.int64)


def cached_tokens(model: PageModel, policy: str | Policy, pool_tokens: int) -> np.ndarray:
    """Cached prompt tokens of each request when ``policy`` (a spec or a built policy)
    runs a ``pool_tokens`` pool."""
    policy = make_policy(policy) if isinstance(policy, str) else policy
    _, hits = replay_prefix(model.data, policy, pool_tokens)
    return np.minimum(hits, model.hit_cap)


def ideal(model: PageModel) -> np.ndarray:
    """Cached prompt tokens of each request with a cache that never evicts."""
    return cached_tokens(model, "lru", max(1, model.data.unique_tokens))
