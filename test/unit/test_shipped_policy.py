"""The simulator's ``shipped`` policy evicts what the server's strategy evicts.

A seeded sequence of 40 requests over a small radix tree drives both sides:

- live: the real ``ImportanceStrategy`` (its ``get_priority``, its
  ``ImportanceAggregator`` folding a real ``PageImportanceTable`` step by step) on a
  small radix tree of ``support.fake_tree.FakeNode`` (SGLang's node attributes), evicted the way SGLang's
  ``FullComponent._evict_device_start`` / ``_evict_device_next_node`` do (a heap of the
  evictable leaves' priorities; a parent that becomes a leaf is pushed with its
  priority then), stamped by a logical access clock like SGLang's;
- simulated: the same requests written as a trace (``accesses`` + ``requests``),
  replayed by ``sim.prefix.replay_prefix`` with ``shipped``.

The full eviction order must be the same; and the sequence is rich enough that
changing any config key of the priority, or counting the sink page into a node's
density, changes the simulated order. The access clock and hit counting follow one
rule on both sides (SGLang's, simplified: one tick per match, one per new node; a
hit per matched node): what is compared is the priority, the importance fold and
the eviction procedure.
"""

from __future__ import annotations

import heapq
import json
import random

import numpy as np
import pytest
import torch

from sgl_importance.cache.strategy import ImportanceStrategy
from sgl_importance.importance.aggregator import Observation
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.prefix import prepare_prefix, replay_prefix
from sgl_importance.sim.shipped import ANCESTOR_STEP, Shipped
from sgl_importance.trace.tables import Accesses, Requests
from support.fake_tree import FakeNode

PAGE = 4
# Every term of the priority matters at this scale: a short horizon, reuse, sinks.
CONFIG = {"recency_horizon": 6, "reuse_weight": 0.4, "decay": 0.9, "sink_pages": 1}
# The credit form at this scale: a credit of a fraction of the budget's turnover.
CREDIT = {"form": "credit", "reuse_credit": 0.6, "importance_credit": 0.3, "decay": 0.9, "sink_pages": 1}
BUDGET = 15 * PAGE

# node id -> (parent id or -1, pages)
TREE = {
    1: (-1, 2),  # system prompt; its first page is the sink
    15: (-1, 1),  # another prompt's first page: a sink node of its own
    16: (15, 2),
    2: (1, 3),  # document A
    3: (2, 1),  # question on A
    4: (2, 1),  # another question on A
    5: (1, 4),  # document B
    6: (5, 1),
    7: (1, 2),  # one-off chat
    8: (7, 2),
    9: (5, 2),
    10: (1, 5),  # document C
    11: (10, 1),
    12: (2, 2),
    13: (10, 2),
    14: (7, 1),
}
LEAVES = [n for n in TREE if all(parent != n for parent, _ in TREE.values())]


def random_requests(seed: int, n: int) -> list[tuple[int, int, dict[int, float]]]:
    """(leaf, decode steps, mass per page of each node on the path), seeded; some
    documents are drawn more often and attended more, so importance, recency and
    reuse disagree."""
    rng = random.Random(seed)
    weight = {leaf: rng.choice((1, 1, 3)) for leaf in LEAVES}
    out = []
    for _ in range(n):
        leaf = rng.choices(LEAVES, [weight[x] for x in LEAVES])[0]
        masses = {nid: rng.uniform(0.01, 0.3) * weight[leaf] for nid in path_of(leaf)}
        out.append((leaf, rng.randint(1, 8), masses))
    return out


# The sink page draws more than any content page; the server leaves it out of densities.
SINK_MASS = 0.7


def page_masses(leaf: int, masses: dict[int, float]) -> list[tuple[int, float]]:
    """(node, mass) per page of the request's sequence, in order."""
    out = [(nid, masses[nid]) for nid in path_of(leaf) for _ in range(TREE[nid][1])]
    out[0] = (out[0][0], SINK_MASS)
    return out


def path_of(leaf: int) -> list[int]:
    path = []
    while leaf != -1:
        path.append(leaf)
        leaf = TREE[leaf][0]
    return path[::-1]


class LiveTree:
    """A radix tree of SGLang-like nodes under the real strategy."""

    def __init__(self, strategy: ImportanceStrategy, budget_tokens: int) -> None:
        self.strategy = strategy
        self.clock = 1.0  # SGLang's counter: hands out its value, then adds one
        strategy.clock = lambda: self.clock
        self.nodes: dict[int, FakeNode] = {}
        self.pages: dict[int, list[int]] = {}
        self.budget = budget_tokens
        # The credit form's clock over a device pool of the budget's size.
        strategy.state.turnover.pool_tokens = float(budget_tokens)
        self.used = 0
        self.free_pages = list(range(1, 64))
        self.table = PageImportanceTable(64, page_size=PAGE)
        self.evicted: list[int] = []

    def tick(self) -> float:
        value = self.clock
        self.clock += 1.0
        return value

    def serve(self, leaf: int, steps: int, masses: dict[int, float]) -> None:
        path = path_of(leaf)
        hit = 0
        while hit < len(path) and path[hit] in self.nodes:
            hit += 1
        # Match: one tick for the matched path, ancestors slightly earlier.
        now = self.tick()
        for depth, nid in enumerate(reversed(path[:hit])):
            self.nodes[nid].last_access_time = now - depth * ANCESTOR_STEP
            self.nodes[nid].hit_count += 1
        need = sum(TREE[n][1] * PAGE for n in path[hit:])
        if self.used + need > self.budget:
            self.evict(need, locked=set(path[:hit]))
        for nid in path[hit:]:
            parent = self.nodes.get(TREE[nid][0])
            node = FakeNode(nid, parent, TREE[nid][1] * PAGE)
            node.last_access_time = self.tick()
            # SGLang counts the inserting request as the node's first hit, and its
            # FULL component records the new leaf's tokens on the turnover clock.
            node.hit_count = 1
            self.strategy.state.turnover.record(node.last_access_time, TREE[nid][1] * PAGE)
            if parent is not None:
                parent.children[nid] = node
            self.nodes[nid] = node
            self.pages[nid] = [self.free_pages.pop(0) for _ in range(TREE[nid][1])]
            self.used += TREE[nid][1] * PAGE
        for _ in range(steps):
            self.decode_step(leaf, masses)

    def evictable(self, node: FakeNode, locked: set[int]) -> bool:
        return not node.children and node.id not in locked

    def evict(self, need: int, locked: set[int]) -> None:
        get = self.strategy.get_priority
        heap = [(get(n), n.id) for n in self.nodes.values() if self.evictable(n, locked)]
        heapq.heapify(heap)
        while self.used + need > self.budget and heap:
            _, nid = heapq.heappop(heap)
            node = self.nodes.pop(nid)
            self.evicted.append(nid)
            pages = self.pages.pop(nid)
            self.free_pages += pages
            self.used -= len(pages) * PAGE
            parent = node.parent
            if parent is not None:
                del parent.children[nid]
                if self.evictable(parent, locked):
                    heapq.heappush(heap, (get(parent), parent.id))

    def decode_step(self, leaf: int, masses: dict[int, float]) -> None:
        pages, observations, start = [], [], 0
        for nid in path_of(leaf):
            node_pages = self.pages[nid]
            pages += node_pages
            observations.append(Observation(self.nodes[nid], start, torch.tensor(node_pages)))
            start += len(node_pages) * PAGE
        values = [m for _, m in page_masses(leaf, masses)]
        slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])
        self.table.add_layer(
            torch.tensor([values], dtype=torch.float32),
            torch.tensor([0, slots.numel()], dtype=torch.int32),
            slots,
        )
        self.table.finish_step()
        self.strategy.state.aggregator.fold(self.table, observations)


def live_eviction_order(requests: list, config: dict) -> list[int]:
    # SGLang hands the strategy the flag's JSON object as keywords.
    tree = LiveTree(ImportanceStrategy(**json.loads(json.dumps(config))), BUDGET)
    for leaf, steps, masses in requests:
        tree.serve(leaf, steps, masses)
    return tree.evicted


def as_trace(requests: list) -> tuple[Requests, Accesses]:
    """The same requests as a recorded trace: paths, and per-step page masses."""
    cols = {k: [] for k in ("step", "request_id", "page", "node_id", "position", "importance")}
    step = 0
    for r, (leaf, steps, masses) in enumerate(requests):
        for _ in range(steps):
            for position, (nid, mass) in enumerate(page_masses(leaf, masses)):
                cols["step"].append(step)
                cols["request_id"].append(r)
                cols["page"].append(1000 * r + position)
                cols["node_id"].append(nid)
                cols["position"].append(position)
                cols["importance"].append(mass)
            step += 1
    paths = [path_of(leaf) for leaf, _, _ in requests]
    table = Requests.from_lists(
        list(range(len(requests))),
        list(range(len(requests))),
        paths,
        [[TREE[n][1] * PAGE for n in p] for p in paths],
        [0] * len(requests),
    )
    return table, Accesses.from_columns({k: np.asarray(v) for k, v in cols.items()})


def simulated_eviction_order(requests: list, policy: Shipped) -> list[int]:
    table, trace = as_trace(requests)
    pd = prepare_prefix(table, trace, page_size=PAGE)
    order: list[int] = []
    replay_prefix(pd, policy, BUDGET, evictions=order)
    return order


@pytest.mark.parametrize("config", [CONFIG, CREDIT], ids=["blend", "credit"])
@pytest.mark.parametrize("seed", [11, 1, 2, 3])
def test_shipped_replays_the_live_strategys_eviction_order(seed, config):
    requests = random_requests(seed, n=40)
    live = live_eviction_order(requests, config)
    # The simulator takes the flag's JSON text, parsed by the same code.
    simulated = simulated_eviction_order(requests, Shipped(config=json.dumps(config)))
    assert len(live) >= 30
    assert simulated == live


def test_defaults_and_spec_parameters_replay_the_same_strategy():
    requests = random_requests(11, n=40)
    assert simulated_eviction_order(requests, make_policy("shipped")) == live_eviction_order(requests, {})
    spec = make_policy("shipped:recency_horizon=6:reuse_weight=0.4:decay=0.9:sink_pages=1")
    assert simulated_eviction_order(requests, spec) == live_eviction_order(requests, CONFIG)
    lru = {**CONFIG, "importance_weight": 0, "reuse_weight": 0, "pin_sinks": False}
    assert simulated_eviction_order(requests, Shipped(config=lru)) == live_eviction_order(requests, lru)


@pytest.mark.parametrize(
    "change",
    [
        {"importance_weight": 0, "reuse_weight": 0, "pin_sinks": False},  # LRU
        {"decay": 0.95},
        {"reuse_weight": 0.1},
        {"recency_horizon": 12},
        {"sink_pages": 0},
        {"importance_weight": 0.3},
        {"pin_sinks": False},
    ],
)
def test_the_sequence_tells_every_config_key_of_the_priority_apart(change):
    # Otherwise the equality above could hold for a simulator that ignored that key.
    requests = random_requests(11, n=40)
    assert simulated_eviction_order(requests, Shipped(config={**CONFIG, **change})) != (
        live_eviction_order(requests, CONFIG)
    )


@pytest.mark.parametrize(
    "change",
    [
        {"form": "blend"},
        {"reuse_credit": 0.2},
        {"importance_credit": 0.0},
        {"reuse_credit": 0, "importance_credit": 0, "pin_sinks": False},  # LRU on the turnover
    ],
)
def test_the_sequence_tells_every_credit_key_apart(change):
    requests = random_requests(11, n=40)
    assert simulated_eviction_order(requests, Shipped(config={**CREDIT, **change})) != (
        live_eviction_order(requests, CREDIT)
    )


def test_the_credit_forms_lru_is_lru_on_the_access_clock():
    # The turnover is a monotone map of the access clock: without credits and sink
    # pins the credit form evicts exactly what the blend's LRU configuration evicts.
    requests = random_requests(2, n=40)
    lru = {"importance_weight": 0, "reuse_weight": 0, "pin_sinks": False}
    credit_lru = {"form": "credit", "reuse_credit": 0, "pin_sinks": False}
    assert live_eviction_order(requests, credit_lru) == live_eviction_order(requests, lru)


def test_the_sequence_tells_a_density_with_the_sink_page_apart(monkeypatch):
    requests = random_requests(11, n=40)
    live = live_eviction_order(requests, CONFIG)
    real = Shipped.decoded

    def with_sink_mass(self, r, keys, lo):
        self.ctx.ev_head_mass[r][:] = 0.0  # nothing to subtract: the sink counts
        real(self, r, keys, lo)

    monkeypatch.setattr(Shipped, "decoded", with_sink_mass)
    assert simulated_eviction_order(requests, Shipped(config=CONFIG)) != live
