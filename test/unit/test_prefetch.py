"""Prefetch planning (cache/prefetch.py) over hand-built trees: which host nodes are
loaded, and that nothing more important than what comes in is ever evicted."""

from __future__ import annotations

import types

import pytest

from sgl_importance.cache.prefetch import (
    WarmIndex,
    evicted_path,
    issue,
    lock_cost,
    mark_evicted,
    mark_used,
    plan,
    victims_less_important,
    waiting_candidates,
)
from sgl_importance.cache.strategy import ImportanceStrategy
from sgl_importance.node_state import node_state
from support.fake_tree import FULL, FakeCache, FakeTreeCore, detached_node, request


def make(free_tokens: int, **config):
    tree = FakeTreeCore()
    # Warming is opt-in; these tests are about it.
    strategy = ImportanceStrategy(**{"prefetch_min_importance": 0.25, **config})
    strategy.clock = lambda: 100.0
    strategy.state.aggregator.scale = 1.0
    tree.eviction_strategy = strategy
    return tree, strategy, FakeCache(tree, free_tokens)


def test_evicted_path_stops_at_the_first_device_resident_ancestor():
    tree = FakeTreeCore()
    a = tree.add(tokens=32)
    b = tree.add(a, device=False)
    c = tree.add(b, device=False)
    assert evicted_path(c) == [c, b]
    assert evicted_path(a) == []


def test_free_pages_warm_the_most_important_demoted_node_first():
    tree, strategy, cache = make(free_tokens=64)
    low = tree.add(tokens=32, device=False, importance=0.3)
    high = tree.add(tokens=32, device=False, importance=0.9)
    strategy.state.warm.add(low)
    strategy.state.warm.add(high)
    chosen = plan(cache, strategy, budget=32, waiting_queue=[])
    assert [(c.node, c.reason, c.tokens) for c in chosen] == [(high, "warm", 32)]


def test_nodes_below_the_warm_threshold_are_not_warmed():
    tree, strategy, cache = make(free_tokens=1024, prefetch_min_importance=0.5)
    strategy.state.warm.add(tree.add(device=False, importance=0.4))
    assert plan(cache, strategy, budget=1024, waiting_queue=[]) == []


def test_warming_evicts_only_leaves_less_important_than_the_node_it_brings():
    tree, strategy, cache = make(free_tokens=0, recency_weight=0.0, reuse_weight=0.0)
    doc = tree.add(tokens=64, device=False, importance=0.8)
    strategy.state.warm.add(doc)
    tree.add(tokens=32, importance=0.1)
    tree.add(tokens=32, importance=0.2)
    assert [c.node for c in plan(cache, strategy, budget=64, waiting_queue=[])] == [doc]


def test_warming_gives_up_when_a_victim_would_be_more_important():
    tree, strategy, cache = make(free_tokens=0, recency_weight=0.0, reuse_weight=0.0)
    strategy.state.warm.add(tree.add(tokens=64, device=False, importance=0.8))
    tree.add(tokens=32, importance=0.1)
    tree.add(tokens=32, importance=0.95)
    assert plan(cache, strategy, budget=64, waiting_queue=[]) == []


def test_the_victim_walk_exposes_parents_and_never_takes_the_incoming_path():
    tree, strategy, _ = make(free_tokens=0, recency_weight=0.0, reuse_weight=0.0)
    priority = strategy.get_priority
    shared = tree.add(tokens=32, importance=0.1)
    tree.add(shared, tokens=16, importance=0.05)
    # Freeing 48 takes the leaf, then its parent once exposed.
    bound = priority(detached_node(importance=0.5, last=0.0))
    assert victims_less_important(tree, priority, bound, 48, protected=set())
    assert not victims_less_important(tree, priority, bound, 48, protected={shared.id})
    assert not victims_less_important(tree, priority, bound, 49, protected=set())


def test_waiting_requests_host_matches_come_first_and_share_no_path():
    tree, strategy, cache = make(free_tokens=1024)
    doc = tree.add(tokens=64, device=False, importance=0.9)
    tail = tree.add(doc, tokens=16, device=False)
    strategy.state.warm.add(doc)
    reqs = [request(host_hit_length=80, best_match_node=tail.id), request()]
    assert waiting_candidates(tree, reqs) == [tail]
    chosen = plan(cache, strategy, budget=1024, waiting_queue=reqs)
    # The waiting request's load covers the document: it is not loaded twice.
    assert [(c.node, c.reason, c.tokens) for c in chosen] == [(tail, "waiting", 80)]


def test_the_budget_caps_what_one_batch_loads():
    tree, strategy, cache = make(free_tokens=1024)
    for importance in (0.9, 0.8, 0.7):
        strategy.state.warm.add(tree.add(tokens=64, device=False, importance=importance))
    assert len(plan(cache, strategy, budget=128, waiting_queue=[])) == 2
    assert plan(cache, strategy, budget=63, waiting_queue=[]) == []


def test_loaded_or_dropped_nodes_leave_the_warm_index():
    tree = FakeTreeCore()
    index = WarmIndex()
    back = tree.add(device=False)
    dropped = tree.add(device=False)
    index.add(back)
    index.add(dropped)
    back.component_data[FULL].value = back.component_data[FULL].host_value.clone()  # loaded back
    dropped.component_data[FULL].host_value = None  # dropped from the host tier
    assert index.nodes() == []


class Metrics:
    def __init__(self):
        self.calls = []

    def prefetch(self, reason, outcome, tokens):
        self.calls.append((reason, outcome, tokens))


def test_a_prefetched_node_is_used_or_wasted_once(monkeypatch):
    metrics = Metrics()
    tree = FakeTreeCore()
    used, wasted = tree.add(tokens=32), tree.add(tokens=16)
    node_state(used).prefetched = "warm"
    node_state(wasted).prefetched = "waiting"
    mark_used(metrics, [used, used])  # attended twice: counted once
    mark_evicted(metrics, wasted, 16)
    mark_evicted(metrics, used, 32)
    assert metrics.calls == [("warm", "used", 32), ("waiting", "wasted", 16)]


@pytest.mark.parametrize(
    "config,message",
    [
        ({"prefetch_max_tokens": -1}, "prefetch_max_tokens=-1 is invalid"),
        ({"prefetch_max_tokens": 1.5}, "prefetch_max_tokens=1.5 is invalid"),
        ({"prefetch_min_importance": 2}, "prefetch_min_importance=2 is invalid"),
    ],
)
def test_bad_prefetch_config_names_the_key(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ImportanceStrategy(**config)


class Budget:
    """SGLang's prefill budget with nothing reserved: free + evictable, live."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def remaining_total(self):
        return self.cache.free + self.cache.evictable_tokens()

    remaining_current = remaining_total


def test_issue_never_counts_or_evicts_the_admitted_requests_prefixes():
    tree = FakeTreeCore()
    # The admitted request's matched prefix: the only device leaf, unimportant.
    prefix = tree.add(tokens=256, importance=0.01)
    doc = tree.add(tokens=128, device=False, importance=0.9)
    cache = FakeCache(tree, free_tokens=32)
    strategy = ImportanceStrategy(recency_weight=0.0, reuse_weight=0.0, prefetch_min_importance=0.25)
    strategy.clock = lambda: 100.0
    strategy.state.aggregator.scale = 1.0
    strategy.state.warm.add(doc)
    adder = types.SimpleNamespace(memory_budget=Budget(cache), can_run_list=[request(last_node=prefix.id)])
    assert issue(cache, strategy, adder) == []
    assert cache.loaded == [] and prefix.component_data[FULL].lock_ref == 0
    # Once no request holds the prefix, evicting it for the document is allowed.
    adder.can_run_list = []
    assert [c.node for c in issue(cache, strategy, adder)] == [doc]
    assert cache.loaded == [doc.id]


def test_a_load_costs_the_resident_ancestors_it_locks():
    tree = FakeTreeCore()
    system = tree.add(tokens=512, importance=0.5)
    question = tree.add(system, tokens=64, device=False, importance=0.9)
    assert lock_cost([question]) == 576
    system.component_data[FULL].lock_ref = 1  # a running request holds it already
    assert lock_cost([question]) == 64
    system.component_data[FULL].lock_ref = 0
    assert lock_cost([question], already_locked={system.id}) == 64


def test_the_budget_pays_for_locked_ancestors_once():
    tree, strategy, cache = make(free_tokens=2048)
    system = tree.add(tokens=512, importance=0.5)
    for importance in (0.9, 0.8):
        strategy.state.warm.add(tree.add(system, tokens=64, device=False, importance=importance))
    assert len(plan(cache, strategy, budget=575, waiting_queue=[])) == 0
    assert len(plan(cache, strategy, budget=576, waiting_queue=[])) == 1
    assert len(plan(cache, strategy, budget=640, waiting_queue=[])) == 2


def test_a_wasted_warm_prefetch_is_not_repeated_until_the_node_is_attended(monkeypatch):
    tree, strategy, cache = make(free_tokens=1024)
    doc = tree.add(tokens=64, device=False, importance=0.9)
    strategy.state.warm.add(doc)
    node_state(doc).prefetched = "warm"
    mark_evicted(None, doc, 64)
    assert plan(cache, strategy, budget=1024, waiting_queue=[]) == []
    mark_used(None, [doc])
    assert [c.node for c in plan(cache, strategy, budget=1024, waiting_queue=[])] == [doc]


def test_a_node_that_a_fresh_request_would_outrank_is_not_warmed():
    # Recency forgotten after one tick: an old node's score is its importance alone,
    # below the 1.0 a fresh request's KV gets from recency.
    tree, strategy, cache = make(free_tokens=1024, recency_horizon=1.0, reuse_weight=0.0)
    strategy.state.warm.add(tree.add(tokens=64, device=False, importance=0.6))
    assert plan(cache, strategy, budget=1024, waiting_queue=[]) == []
    hot = tree.add(tokens=64, device=False, importance=0.6)
    hot.last_access_time = 100.0  # touched just now: recency 1 on top
    strategy.state.warm.add(hot)
    assert [c.node for c in plan(cache, strategy, budget=1024, waiting_queue=[])] == [hot]


def test_warming_is_off_by_default():
    tree = FakeTreeCore()
    strategy = ImportanceStrategy()
    strategy.clock = lambda: 100.0
    strategy.state.aggregator.scale = 1.0
    strategy.state.warm.add(tree.add(tokens=64, device=False, importance=0.9))
    cache = FakeCache(tree, free_tokens=1024)
    assert plan(cache, strategy, budget=1024, waiting_queue=[]) == []


def test_two_loads_in_one_batch_do_not_count_the_same_victims():
    tree, strategy, cache = make(free_tokens=0, recency_weight=0.0, reuse_weight=0.0)
    first = tree.add(tokens=64, device=False, importance=0.9)
    second = tree.add(tokens=64, device=False, importance=0.8)
    strategy.state.warm.add(first)
    strategy.state.warm.add(second)
    tree.add(tokens=64, importance=0.1)  # room for one of them
    tree.add(tokens=64, importance=0.95)  # more important than both: never a victim
    assert [c.node for c in plan(cache, strategy, budget=1024, waiting_queue=[])] == [first]
