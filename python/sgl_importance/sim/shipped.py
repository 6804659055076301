"""Policy ``shipped``: the server's eviction priority, replayed on the simulator's state.

The priority is ``importance.priority.eviction_priority`` — the function
``cache/strategy.py`` hands SGLang — with the same ``ImportancePolicyConfig`` (the
keys of ``--radix-eviction-policy-config``, parsed by the same code). What the
simulator supplies is the node state the server keeps, rebuilt from the trace:

- importance: the EMA of ``importance/aggregator.py`` (its ``importance.ema.ema_fold``) —
  per attended decode step ``old * decay + density * (1 - decay)``, density = attention mass per content
  page (sink pages left out), and the aggregator's running maximum ``scale``
  (the largest importance folded, decaying by ``decay`` per step);
- pinned: the key lies inside the first ``sink_pages`` pages of its sequence;
- last access: a logical clock like SGLang's (below), and ``now`` = its next tick;
- reuses: re-reads while resident, reset when the key is admitted again (the server
  reads SGLang's ``hit_count`` less the inserting request);
- the ``credit`` form's turnover: tokens inserted so far, and at each key's last
  access, over the budget (the server's ``TurnoverClock`` over its device pool).

Unlike the research variants, the priority depends on ``now`` and on ``scale``, so
it is not time-invariant: it is ranked when an eviction happens, over every
evictable key, as SGLang's ``_evict_device_start`` does (a heap of the current
leaves; a parent that becomes a leaf is pushed with its priority at that moment).

Where the state lives:

- prefix regime (keys = radix nodes): one state per node, as on the server's tree.
  Per request: the match takes one clock tick (the hit nodes get it, ancestors
  slightly earlier, as SGLang stamps a matched path) and adds one hit to each hit
  node; each inserted node takes a tick and starts bare (an evicted node left the
  tree, its state with it); then the request's decode steps are folded at once:
  ``keep = decay ** steps`` with the request's mean per-step mass (the trace keeps
  no finer split in this regime), which is what the aggregator computes for a node
  whose density stays constant over those steps.
- hot-set regime (keys = pages of one stream): each page is treated as a one-page
  node. One clock tick per event (a decode step) stamps its demanded pages; every
  attended page of the event is folded (the server folds every node a running
  request attends); pages at positions below ``sink_pages`` are pinned; importance
  survives eviction (a demoted page keeps its host copy and its EMA). The server's
  per-request hot set is chosen by ``hot_set/plan/selection.py``, not by this priority:
  hot-regime rows of ``shipped`` say what the radix formula would do on pages.
"""

from __future__ import annotations

import heapq
import json
from typing import Any

import numpy as np

from sgl_importance.importance.ema import ema_fold
from sgl_importance.importance.priority import (
    ImportancePolicyConfig,
    PriorityWeights,
    eviction_priority,
    parse_policy_config,
)
from sgl_importance.sim.policy_base import Policy, StreamContext

# SGLang stamps a matched path from the leaf up, each ancestor this much earlier.
ANCESTOR_STEP = 1e-5


def _spec_value(text: Any) -> Any:
    """``shipped:key=value`` values are JSON (``pin_sinks=false``, ``sink_pages=2``)."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # the config's check names the key and the allowed range


class Shipped(Policy):
    """The deployed radix eviction priority (``cache/strategy.py``), ranked at eviction time.

    Built from ``shipped`` (defaults), ``shipped:key=value[:key=value]`` or
    ``Shipped(config=<JSON text or mapping>)`` — the same keys and checks as
    ``--radix-eviction-policy-config``.
    """

    name = "shipped"
    ranks_at_eviction = True
    raw_params = True

    def __init__(self, config: Any = None, **params: Any) -> None:
        base = dict(parse_policy_config(config).__dict__) if config is not None else {}
        explicit = {k: _spec_value(v) for k, v in params.items()}
        self.config = ImportancePolicyConfig.from_mapping({**_changed(base), **explicit})
        self.weights = PriorityWeights.of(self.config)
        self.params = _changed(self.config.__dict__)
        self.queue = None

    @property
    def label(self) -> str:
        changed = [f"{k}={json.dumps(v)}" for k, v in self.params.items()]
        return ":".join([self.name, *changed])

    # -- state ---------------------------------------------------------------------
    def reset(self, ctx: StreamContext) -> None:
        n = ctx.n_keys
        self.ctx = ctx
        self.importance = np.zeros(n, np.float64)
        self.pinned = np.zeros(n, bool)
        self.last = np.zeros(n, np.float64)
        self.hits = np.zeros(n, np.int64)
        self.scale = 0.0
        # Tokens (prefix regime; pages in the hot set) inserted so far, and at each key's last access.
        self.inserted_tokens = 0.0
        self.last_inserted = np.zeros(n, np.float64)
        self.pool = float(max(ctx.budget, 1))
        # SGLang's counter starts at 1 and "now" is the value it would hand out next.
        self.clock = 1.0

    def priority(self, key: int, now: float) -> tuple[int, float, float]:
        return eviction_priority(
            self.weights,
            float(self.importance[key]),
            bool(self.pinned[key]),
            float(self.last[key]),
            int(self.hits[key]),
            now,
            self.scale,
            (self.inserted_tokens - self.last_inserted[key]) / self.pool,
        )

    def _fold(self, keys: np.ndarray, density: np.ndarray, pinned: np.ndarray, steps: int) -> None:
        """The aggregator's fold of ``steps`` decode steps at constant density."""
        if steps <= 0 or keys.shape[0] == 0:
            return
        keep = self.config.decay**steps
        value = ema_fold(self.importance[keys], density, keep)
        self.importance[keys] = value
        self.pinned[keys] = pinned
        content = value[~pinned]
        fold_max = float(content.max()) if content.shape[0] else 0.0
        self.scale = max(fold_max, self.scale * keep)

    # -- prefix regime (called by sim.prefix.replay_prefix) ------------------------
    def matched(self, path: list[int], hit: int) -> None:
        """A request matched the first ``hit`` nodes of its path."""
        tick = self.clock
        self.clock += 1.0
        for depth, x in enumerate(path[:hit]):
            self.last[x] = tick - (hit - 1 - depth) * ANCESTOR_STEP
            self.hits[x] += 1
            self.last_inserted[x] = self.inserted_tokens

    def inserted(self, keys: list[int]) -> None:
        """New tree nodes, ancestors first: bare state, one tick each."""
        for x in keys:
            self.importance[x] = 0.0
            self.pinned[x] = False
            self.hits[x] = 0
            self.last[x] = self.clock
            self.clock += 1.0
            self.inserted_tokens += float(self.ctx.key_tokens[x])
            self.last_inserted[x] = self.inserted_tokens

    def decoded(self, r: int, keys: np.ndarray, lo: int) -> None:
        """Fold request ``r``'s decode steps into its path nodes ``keys`` (rows ``lo:``)."""
        ctx = self.ctx
        steps = int(ctx.ev_steps[r])
        if steps <= 0:
            return
        n = keys.shape[0]
        mass = ctx.row_mass[lo : lo + n].astype(np.float64)
        ps = ctx.page_size
        start = ctx.key_start[keys]
        pages = -(-ctx.key_tokens[keys] // ps)
        first = start // ps
        sinks = np.minimum(pages, np.maximum(0, self.config.sink_pages - first))
        pinned = sinks == pages
        # Mass on the node's sink pages leaves its density (it says "position 0").
        head = ctx.ev_head_mass[r]
        sink_mass = np.zeros(n)
        for i in np.flatnonzero((sinks > 0) & ~pinned):
            sink_mass[i] = head[first[i] : first[i] + sinks[i]].sum()
        content_pages = np.where(pinned, pages, pages - sinks)
        density = np.where(pinned, mass, mass - sink_mass) / np.maximum(content_pages, 1)
        self._fold(keys, density, pinned, steps)

    def rank(self, keys: list[int]) -> list[tuple[int, float, float]]:
        now = self.clock
        return [self.priority(x, now) for x in keys]

    # -- hot-set regime (called by sim.replay.replay_stream) ------------------------
    def attach(self, ctx: StreamContext, resident: np.ndarray) -> None:
        self.resident = resident
        self.reset(ctx)

    def touch(self, keys: np.ndarray, masses: np.ndarray, t: int, hit: np.ndarray, lo: int, hi: int) -> None:
        ctx = self.ctx
        self.hits[keys] = np.where(hit, self.hits[keys] + 1, 0)
        self.inserted_tokens += float(np.count_nonzero(~hit))
        self.last_inserted[keys] = self.inserted_tokens
        self.last[keys] = self.clock
        self.clock += 1.0
        end = int(ctx.ev_row_ptr[t + 1])
        rows = ctx.row_keys[lo:end]
        if ctx.row_position is None:
            pinned = np.zeros(rows.shape[0], bool)
        else:
            position = ctx.row_position[lo:end]  # -1: unknown, not a sink
            pinned = (position >= 0) & (position < self.config.sink_pages)
        self._fold(rows, ctx.row_mass[lo:end].astype(np.float64), pinned, 1)

    def victims(self, n: int, pinned: np.ndarray) -> np.ndarray:
        candidates = np.flatnonzero(self.resident)
        if pinned.shape[0]:
            candidates = candidates[~np.isin(candidates, pinned)]
        now = self.clock
        ranked = heapq.nsmallest(n, ((self.priority(int(x), now), int(x)) for x in candidates))
        return np.asarray([x for _, x in ranked], np.int64)

    def evicted(self, keys: np.ndarray) -> None:
        pass

    def priorities(self, keys, masses, t, hit, lo, hi):  # touch() and rank() instead
        raise NotImplementedError


def _changed(config: dict[str, Any]) -> dict[str, Any]:
    """Keys that differ from the defaults (what a label needs to rebuild the policy)."""
    default = ImportancePolicyConfig()
    return {k: v for k, v in config.items() if getattr(default, k) != v}
