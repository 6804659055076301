"""ImportanceStrategy: the eviction order it gives SGLang's tree, and its configuration."""

from __future__ import annotations

import heapq
import random
import types

import pytest
import torch
from sglang.srt.mem_cache.evict_policy import LRUStrategy

from sgl_importance.cache.strategy import ImportanceStrategy, check_cli_args
from sgl_importance.importance.aggregator import Observation
from sgl_importance.importance.page_importance import PageImportanceTable
from support.fake_tree import detached_node

PAGE = 4


def leaf(t: float, hits: int = 0, importance: float | None = None, pinned: bool = False):
    return detached_node(last=t, hits=hits, importance=importance, pinned=pinned)


def eviction_order(strategy, nodes) -> list:
    """Pop order of SGLang's eviction heap: (priority, node) pairs, smallest first."""
    heap = [(strategy.get_priority(n), i, n) for i, n in enumerate(nodes)]
    heapq.heapify(heap)
    return [heapq.heappop(heap)[2] for _ in range(len(heap))]


def strategy(now: float = 100.0, scale: float = 1.0, **config) -> ImportanceStrategy:
    s = ImportanceStrategy(**config)
    s.clock = lambda: now
    s.state.aggregator.scale = scale
    return s


def test_lru_special_case_evicts_in_exactly_sglangs_lru_order():
    rng = random.Random(7)
    nodes = [
        leaf(
            rng.choice([rng.uniform(0, 1e6), 5.0, 1e6 - 1]),  # ties and far-apart ages
            hits=rng.randrange(10),
            importance=rng.random(),
            pinned=rng.random() < 0.2,
        )
        for _ in range(300)
    ]
    lru = strategy(now=1e6, importance_weight=0, reuse_weight=0, pin_sinks=False)
    expected = sorted(nodes, key=LRUStrategy().get_priority)
    got = eviction_order(lru, nodes)
    assert [n.last_access_time for n in got] == [n.last_access_time for n in expected]


def test_an_important_old_leaf_outlives_unimportant_recent_ones():
    document = leaf(t=10, importance=0.9)
    one_offs = [leaf(t=90 + i, importance=0.01) for i in range(5)]
    order = eviction_order(strategy(now=100, scale=0.9), [document, *one_offs])
    assert order[-1] is document
    # Among the unimportant ones recency still decides.
    assert order[:-1] == one_offs
    # Plain LRU would evict the document first.
    assert eviction_order(strategy(now=100, importance_weight=0), [document, *one_offs])[0] is document


def test_a_node_never_attended_counts_as_unimportant():
    attended = leaf(t=10, importance=0.5)
    never = leaf(t=10)
    assert eviction_order(strategy(scale=0.5), [attended, never]) == [never, attended]


def test_before_any_importance_was_folded_the_order_is_recency_and_reuse():
    old, recent = leaf(t=10, importance=0.0), leaf(t=90, importance=0.0)
    assert eviction_order(strategy(scale=0.0), [recent, old]) == [old, recent]


def test_pinned_sink_nodes_are_evicted_after_every_other_node():
    sink = leaf(t=0, importance=0.0, pinned=True)
    others = [leaf(t=50, importance=0.5), leaf(t=99, hits=9, importance=1.0)]
    assert eviction_order(strategy(), [sink, *others])[-1] is sink
    assert eviction_order(strategy(pin_sinks=False), [sink, *others])[0] is sink


def test_reuse_separates_leaves_of_equal_importance_and_recency():
    once, often = leaf(t=50, hits=0, importance=0.3), leaf(t=50, hits=6, importance=0.3)
    assert eviction_order(strategy(), [often, once]) == [once, often]


def test_importance_is_normalised_by_the_aggregators_scale():
    # Raw importance 0.02 is the hottest there is: it must count fully.
    hot, cold = leaf(t=10, importance=0.02), leaf(t=60, importance=0.0)
    s = strategy(now=100, scale=0.02, recency_weight=1, reuse_weight=0, recency_horizon=100)
    assert eviction_order(s, [hot, cold]) == [cold, hot]


def test_priorities_come_from_folded_page_importance():
    s = strategy(now=100, recency_weight=0, reuse_weight=0)
    table = PageImportanceTable(16, page_size=PAGE)
    slots = torch.arange(2 * PAGE, 4 * PAGE, dtype=torch.int64)  # pages 2 and 3
    table.add_layer(torch.tensor([[0.9, 0.1]]), torch.tensor([0, len(slots)], dtype=torch.int32), slots)
    table.finish_step()
    hot, cold = leaf(t=1), leaf(t=99)
    s.state.aggregator.fold(
        table,
        [Observation(hot, PAGE, torch.tensor([2])), Observation(cold, 2 * PAGE, torch.tensor([3]))],
    )
    assert eviction_order(s, [hot, cold]) == [cold, hot]


BAD_CONFIGS = [
    ({"importance_weight": -1}, "importance_weight=-1 is invalid; allowed: a number in [0, 1000]"),
    ({"recency_weight": "high"}, "recency_weight='high' is invalid; allowed: a number in [0, 1000]"),
    ({"reuse_weight": float("nan")}, "reuse_weight=nan is invalid"),
    ({"recency_horizon": 0}, "recency_horizon=0 is invalid; allowed: a number in (0, 1e+12]"),
    ({"pin_sinks": "yes"}, "pin_sinks='yes' is invalid; allowed: true, false"),
    ({"decay": 1.0}, "decay=1.0 is invalid; allowed: a number in (0, 1)"),
    ({"sink_pages": 100}, "sink_pages=100 is invalid; allowed: an integer in [0, 64]"),
    ({"threshold": 4}, "unknown key(s) 'threshold' for --radix-eviction-policy importance"),
    ({"storage_min_hits": -1}, "storage_min_hits=-1 is invalid; allowed: an integer in [0, 1000000]"),
    ({"storage_min_importance": 1.5}, "storage_min_importance=1.5 is invalid; allowed: a number in [0, 1]"),
]


@pytest.mark.parametrize("config,message", BAD_CONFIGS)
def test_a_bad_config_names_the_flag_the_key_the_value_and_the_range(config, message):
    with pytest.raises(ValueError) as err:
        ImportanceStrategy(**config)
    assert str(err.value).startswith("--radix-eviction-policy-config")
    assert message in str(err.value)


def test_the_launcher_check_applies_only_to_the_importance_policy():
    bad = {"decay": 2}
    check_cli_args(types.SimpleNamespace(radix_eviction_policy="lru", radix_eviction_policy_config=bad))
    check_cli_args(types.SimpleNamespace(radix_eviction_policy="importance", radix_eviction_policy_config=None))
    with pytest.raises(ValueError, match="decay=2 is invalid"):
        check_cli_args(types.SimpleNamespace(radix_eviction_policy="importance", radix_eviction_policy_config=bad))
    with pytest.raises(ValueError, match="allowed: a JSON object"):
        check_cli_args(types.SimpleNamespace(radix_eviction_policy="importance", radix_eviction_policy_config=[1]))


def test_each_strategy_owns_its_aggregator_with_the_configured_decay_and_sinks():
    a, b = ImportanceStrategy(decay=0.5, sink_pages=2), ImportanceStrategy()
    assert a.state.aggregator is not b.state.aggregator
    assert (a.state.aggregator.decay, a.state.aggregator.sink_pages) == (0.5, 2)
    assert (b.state.aggregator.decay, b.state.aggregator.sink_pages) == (0.98, 1)
