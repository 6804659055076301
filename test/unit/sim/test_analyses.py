from __future__ import annotations

import numpy as np
import pytest

from sgl_importance.sim.analyses import (
    aggregate_jaccard,
    head_stability,
    recency_recall,
    reuse_distances,
    stack_distances,
    top_share,
)
from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.replay import prepare_hot, replay_stream
from sgl_importance.trace.tables import Accesses
from support.traces import merge_columns, sequence_trace, trace_from_steps


def _brute_stack_distance(keys):
    out = []
    for i, k in enumerate(keys):
        prev = [j for j in range(i) if keys[j] == k]
        out.append(-1 if not prev else len(set(keys[prev[-1] + 1 : i])))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_stack_distance_counts_distinct_pages_since_the_previous_access(seed):
    r = np.random.default_rng(seed)
    keys = r.integers(0, int(r.integers(1, 15)), int(r.integers(1, 80)))
    assert stack_distances(keys).tolist() == _brute_stack_distance(keys.tolist())


def test_reuse_cdf_at_c_equals_the_hit_rate_of_lru_with_c_pages():
    r = np.random.default_rng(3)
    pages = r.zipf(1.3, 2000) % 50
    hs = prepare_hot(sequence_trace(pages.tolist()), "all")
    cdf = reuse_distances(hs)
    for c in (2, 5, 10, 20):
        lru, _ = replay_stream(hs, 0, make_policy("lru"), c)
        assert cdf.cdf(np.array([c]))[0] == pytest.approx(lru.hit_rate)


def test_top_share_reports_the_skew_of_accesses_and_mass():
    # 10 pages; page 0 is in every step with most of the mass, the rest once each
    steps = [{0: 0.9, i: 0.1} for i in range(1, 10)]
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), "all")
    s = top_share(hs, 0.2)
    assert s["pages"] == 10 and s["top_pages"] == 2
    assert s["access_share"] == pytest.approx((9 + 1) / 18)
    assert s["mass_share"] == pytest.approx((8.1 + 0.1) / 9)


def test_head_stability_is_one_for_repeated_top_sets_and_zero_for_disjoint_ones():
    same = trace_from_steps([{1: 0.5, 2: 0.3, 3: 0.2}] * 5, layer=0, kv_head=0)
    moving = trace_from_steps([{10 * t + 1: 0.5, 10 * t + 2: 0.5} for t in range(5)], layer=0, kv_head=1)
    hs = prepare_hot(Accesses.from_columns(merge_columns(same, moving)), "all")
    st = head_stability(hs, k=2)
    assert st["per_layer_head"] == {"0/0": 1.0, "0/1": 0.0}
    assert st["overall"] == pytest.approx(0.5)


def test_recency_recall_is_one_when_the_heaviest_pages_were_just_accessed_and_zero_when_they_are_old():
    # recent: the same two pages lead every step
    recent = [{1: 0.6, 2: 0.4}] * 6
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(recent)), "all")
    assert recency_recall(hs, k=2, n_segments=2)["overall"] == pytest.approx(1.0)
    # old: the step's heaviest pages were last accessed long ago, many pages in between
    steps = [{100: 0.6, 101: 0.4}] + [{t: 1.0} for t in range(1, 6)] + [{100: 0.6, 101: 0.4}]
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), "all")
    res = recency_recall(hs, k=2, n_segments=1)
    assert res["per_segment"][0] < 0.5
    # the revisit step itself scores zero: neither anchor is among the 2 most recent
    _, tr = replay_stream(hs, 0, make_policy("lru_mass"), 2, probe_k=2, record=True)
    assert tr.probe_hits[-1] == 0


def test_aggregate_jaccard_is_one_for_a_stationary_distribution_and_low_when_it_shifts():
    stationary = [{i: w for i, w in enumerate([0.5, 0.2, 0.1, 0.05, 0.05, 0.04, 0.03, 0.02, 0.005, 0.005])}] * 8
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(stationary)), "all")
    assert aggregate_jaccard(hs, frac=0.2, decay=0.9)["overall"] == pytest.approx(1.0)
    # the heavy page moves every step: history points at pages that are now light
    shifting = [{i: (0.9 if i == t % 10 else 0.1 / 9) for i in range(10)} for t in range(10)]
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(shifting)), "all")
    assert aggregate_jaccard(hs, frac=0.1, decay=None)["overall"] == pytest.approx(0.0)
