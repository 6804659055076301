from __future__ import annotations

import numpy as np
import pytest

from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.replay import budget_pages, parse_demand, prepare_hot, replay_hot, replay_stream
from sgl_importance.trace.tables import Accesses
from support.traces import merge_columns, rng, trace_from_steps  # noqa: F401  (rng: fixture)


def test_mass_recall_counts_the_resident_share_of_every_page_of_a_step_before_fetching():
    steps = [
        {1: 0.6, 2: 0.4},  # nothing resident: 0; demand [1] -> fetched
        {1: 0.5, 2: 0.3, 3: 0.2},  # {1} resident: 0.5; demand [1] hits
        {2: 0.7, 1: 0.3},  # {1}: 0.3; demand [2] -> fetched, cache now {1, 2}
        {3: 0.9, 1: 0.05, 2: 0.05},  # {1, 2}: 0.1; demand [3] evicts page 1 (least recent)
    ]
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), "topk:1")
    c, tr = replay_stream(hs, 0, make_policy("lru"), 2, record=True)
    assert c.mass_total == pytest.approx(4.0)
    assert c.mass_resident == pytest.approx(0.0 + 0.5 + 0.3 + 0.1)
    assert c.mass_recall == pytest.approx(0.9 / 4.0)
    assert tr.hits.tolist() == [0, 1, 0, 0]
    assert c.hit_rate == pytest.approx(0.25)


@pytest.mark.parametrize(
    "demand,expected",
    [("all", 4), ("topk:2", 2), ("topk:9", 4), ("mass:0.9", 3), ("mass:0.8", 2), ("mass:0.5", 1), ("mass:1.0", 4)],
)
def test_demand_is_the_heaviest_prefix_of_a_step(demand, expected):
    hs = prepare_hot(Accesses.from_columns(trace_from_steps([{10: 0.05, 11: 0.3, 12: 0.15, 13: 0.5}])), demand)
    assert hs.ev_demand.tolist() == [expected]
    assert hs.row_mass[:expected].tolist() == pytest.approx(sorted([0.05, 0.3, 0.15, 0.5], reverse=True)[:expected])


@pytest.mark.parametrize("bad", ["topk:0", "mass:0", "mass:1.5", "most", "all:3"])
def test_invalid_demand_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_demand(bad)


def test_a_step_demanding_more_pages_than_the_budget_keeps_the_heaviest():
    steps = [{1: 0.5, 2: 0.3, 3: 0.2}, {1: 0.6, 2: 0.4}]
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), "all")
    c, tr = replay_stream(hs, 0, make_policy("lru"), 2, record=True)
    assert tr.hits.tolist() == [0, 2]
    assert c.fetched == 2  # page 3 bypassed the cache


def test_duplicate_rows_of_one_step_and_page_merge_into_one_access_with_summed_mass():
    cols = trace_from_steps([{1: 0.2, 2: 0.5}])
    cols = merge_columns(cols, trace_from_steps([{1: 0.3}]))
    hs = prepare_hot(Accesses.from_columns(cols), "all")
    assert hs.n_rows == 2 and hs.n_demanded == 2
    assert sorted(hs.row_mass.tolist()) == pytest.approx([0.5, 0.5])


def test_request_scope_gives_each_request_its_own_cache_and_global_scope_shares_pages():
    a = trace_from_steps([{7: 1.0}], request_id=1, step0=0)
    b = trace_from_steps([{7: 1.0}], request_id=2, step0=1)
    tr = Accesses.from_columns(merge_columns(a, b))
    per_req = replay_hot(prepare_hot(tr, "all", "request"), ["lru"], [1.0])[0]
    shared = replay_hot(prepare_hot(tr, "all", "global"), ["lru"], [1.0])[0]
    assert per_req.counts.hits == 0
    assert shared.counts.hits == 1


def test_per_layer_breakdown_sums_to_the_total():
    r = np.random.default_rng(0)
    parts = []
    for layer in (0, 1, 2):
        steps = [{int(p): 0.25 for p in r.choice(12, 4, replace=False)} for _ in range(50)]
        parts.append(trace_from_steps(steps, layer=layer, kv_head=0))
    hs = prepare_hot(Accesses.from_columns(merge_columns(*parts)), "topk:2")
    assert hs.n_streams == 3
    res = replay_hot(hs, ["lru", "decayed_mass"], [0.25, 0.5])
    for rr in res:
        assert sorted(rr.per_layer) == [0, 1, 2]
        assert sum(c.hits for c in rr.per_layer.values()) == rr.counts.hits
        assert sum(c.accesses for c in rr.per_layer.values()) == rr.counts.accesses == 3 * 50 * 2


def test_budget_fraction_is_taken_of_each_streams_unique_pages():
    assert budget_pages(100, 0.05) == 5
    assert budget_pages(10, 0.01) == 1  # never an empty cache
    r = np.random.default_rng(1)
    steps = [{int(p): 1.0} for p in r.integers(0, 40, 300)]
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), "all")
    res = replay_hot(hs, ["lru"], [0.25])[0]
    assert res.budget == budget_pages(int(hs.stream_nkeys[0]), 0.25)


def test_hit_rate_grows_with_budget_and_is_perfect_with_the_whole_working_set(rng):
    steps = [
        {int(p): float(m) for p, m in zip(rng.choice(30, 5, replace=False), rng.dirichlet(np.ones(5)))}
        for _ in range(300)
    ]
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), "all")
    res = replay_hot(hs, ["lru", "belady"], [0.2, 0.5, 1.0])
    for name in ("lru", "belady"):
        rates = [r.hit_rate for r in res if r.policy == name]
        assert rates == sorted(rates)
    full = [r for r in res if r.budget_frac == 1.0]
    for r in full:
        assert r.counts.hits == r.counts.accesses - r.counts.fetched  # only cold misses
        assert r.counts.fetched == hs.stream_nkeys[0]


def test_invalid_budget_fraction_is_rejected():
    hs = prepare_hot(Accesses.from_columns(trace_from_steps([{1: 1.0}])), "all")
    with pytest.raises(ValueError, match="budget fraction"):
        replay_hot(hs, ["lru"], [0.0])
