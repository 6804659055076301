from __future__ import annotations

import numpy as np
import pytest

from sgl_importance.sim.policies import POLICIES, make_policy
from sgl_importance.sim.queue import LazyMinQueue
from sgl_importance.sim.replay import prepare_hot, replay_stream
from sgl_importance.trace.tables import Accesses
from support.traces import rng, sequence_trace, trace_from_steps  # noqa: F401  (rng: fixture)


def _run(steps, policy: str, budget: int, demand: str = "all", seed: int = 0):
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), demand)
    c, tr = replay_stream(hs, 0, make_policy(policy), budget, seed=seed, record=True)
    return c, tr


def test_lru_gets_zero_hits_on_a_cyclic_loop_over_budget_plus_one_pages():
    budget = 5
    pages = list(range(budget + 1)) * 20
    hs = prepare_hot(sequence_trace(pages), "all")
    for name in ("lru", "lru_mass"):
        c, _ = replay_stream(hs, 0, make_policy(name), budget)
        assert c.hits == 0, name
    best, _ = replay_stream(hs, 0, make_policy("belady"), budget)
    assert best.hits > 0.5 * len(pages)


def _old_anchor_steps(n_rounds: int = 12):
    """Two heavy anchor pages revisited every 6 steps; 4 one-off pages per step flood the cache."""
    steps, fresh = [], 1000
    for t in range(6 * n_rounds):
        row = {}
        if t % 6 == 0:
            row.update({100: 0.3, 101: 0.3})
        for _ in range(4):
            row[fresh] = 0.1
            fresh += 1
        steps.append(row)
    return steps


def test_decayed_mass_keeps_old_heavy_pages_that_lru_evicts():
    steps = _old_anchor_steps()
    lru, _ = _run(steps, "lru", budget=6)
    imp, _ = _run(steps, "decayed_mass", budget=6)
    assert lru.hits == 0
    assert imp.hits == 2 * (12 - 1)  # every anchor revisit after the first
    assert imp.mass_recall > lru.mass_recall


def test_shipped_keeps_old_heavy_pages_in_the_hot_set_and_its_lru_config_does_not():
    steps = _old_anchor_steps()
    shipped, _ = _run(steps, "shipped", budget=6)
    assert shipped.hits == 2 * (12 - 1)
    # The server's LRU special case of the same priority.
    lru_like, _ = _run(steps, "shipped:importance_weight=0:reuse_weight=0:pin_sinks=false", budget=6)
    assert lru_like.hits == 0


def test_shipped_pins_the_sink_page_in_the_hot_set_unless_pin_sinks_is_off():
    # Page 0 sits at position 0; a scan of heavier one-off pages follows, then page 0 again.
    cols = trace_from_steps([{0: 0.3, 1000: 0.7}] + [{1000 + t: 1.0} for t in range(1, 10)] + [{0: 1.0}])
    cols["position"] = np.where(cols["page"] == 0, 0, 5)
    hs = prepare_hot(Accesses.from_columns(cols), "all")
    _, tr = replay_stream(hs, 0, make_policy("shipped"), 3, record=True)
    _, tr_off = replay_stream(hs, 0, make_policy("shipped:pin_sinks=false:recency_horizon=2"), 3, record=True)
    assert tr.hits[-1] == 1 and tr_off.hits[-1] == 0


def test_lru_tie_breaking_by_mass_evicts_the_lightest_page_of_a_step_but_random_does_not():
    steps = [{1: 0.7, 2: 0.2, 3: 0.1}, {4: 1.0}, {1: 1.0}]
    c, tr = _run(steps, "lru_mass", budget=3)
    assert tr.hits.tolist() == [0, 0, 1]
    evicted_heaviest = 0
    for seed in range(30):
        _, tr = _run(steps, "lru", budget=3, seed=seed)
        evicted_heaviest += int(tr.hits[2] == 0)
    assert 0 < evicted_heaviest < 30


def test_blend_with_alpha_zero_ranks_like_lru_and_with_alpha_one_like_decayed_mass(rng):
    pages = rng.integers(0, 12, 400)
    masses = rng.random(400)
    steps = [{int(p): float(m)} for p, m in zip(pages, masses)]
    lru, _ = _run(steps, "lru", 5)
    b0, _ = _run(steps, "blend:alpha=0", 5)
    assert b0.hits == lru.hits
    steps = [{int(p): float(m) for p, m in zip(rng.choice(12, 3, replace=False), rng.random(3))} for _ in range(300)]
    imp, tr_i = _run(steps, "decayed_mass:decay=0.9", 6)
    b1, tr_b = _run(steps, "blend:alpha=1:decay=0.9", 6)
    assert np.array_equal(tr_i.hits, tr_b.hits)


def test_slru_protects_reused_pages_from_a_one_off_scan_that_flushes_lru():
    pages = [1, 2, 1, 2] + list(range(10, 20)) + [1, 2]
    steps = [{p: 1.0} for p in pages]
    lru, tr_l = _run(steps, "lru", 4)
    slru, tr_s = _run(steps, "slru:protected=0.5", 4)
    assert tr_l.hits[-2:].tolist() == [0, 0]
    assert tr_s.hits[-2:].tolist() == [1, 1]


def test_tlru_lets_a_frequently_hit_page_outlive_newer_one_off_pages():
    steps = [{p: 1.0} for p in ["A", "A", "A", "A", "B", "C", "A"]]
    steps = [{{"A": 1, "B": 2, "C": 3}[k]: v for k, v in s.items()} for s in steps]
    _, tr_l = _run(steps, "lru", 2)
    _, tr_t = _run(steps, "tlru:ttl=16", 2)
    assert tr_l.hits[-1] == 0 and tr_t.hits[-1] == 1


def test_lfu_keeps_the_most_frequent_page_when_a_newer_page_competes():
    steps = [{p: 1.0} for p in [1, 1, 1, 2, 3, 1]]
    _, tr_f = _run(steps, "lfu", 2)
    _, tr_l = _run(steps, "lru", 2)
    assert tr_f.hits[-1] == 1 and tr_l.hits[-1] == 0


def test_h2o_evicts_the_page_with_least_accumulated_mass():
    steps = [{1: 0.9, 2: 0.1}, {1: 0.9, 2: 0.1}, {3: 1.0}, {1: 0.5, 2: 0.5}]
    _, tr = _run(steps, "h2o", 2)
    assert tr.hits[-1] == 1  # page 1 survived, page 2 was the victim


def test_prefetch_brings_back_a_heavy_page_before_it_is_needed_and_counts_it_apart():
    steps = [{9: 0.9, 1: 0.1}, {2: 0.5, 3: 0.5}, {9: 1.0}]
    plain, tr_p = _run(steps, "decayed_mass", 2)
    pre, tr_f = _run(steps, "prefetch:k=1", 2)
    assert tr_p.hits[-1] == 0 and tr_f.hits[-1] == 1
    assert pre.prefetched >= 1 and pre.prefetch_used == 1
    assert pre.fetched == plain.fetched - 1  # one demand fetch became a prefetch


def test_every_registered_policy_respects_the_budget_and_counts_consistently(rng):
    steps = [
        {int(p): float(m) for p, m in zip(rng.choice(40, 6, replace=False), rng.dirichlet(np.ones(6)))}
        for _ in range(200)
    ]
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), "topk:3")
    for name in POLICIES:
        c, _ = replay_stream(hs, 0, make_policy(name), 7)
        assert 0 <= c.hits <= c.accesses == 600
        assert c.fetched + c.hits == c.accesses  # no bypass: every miss is fetched
        assert 0.0 <= c.mass_recall <= 1.0


def test_make_policy_parses_parameters_and_rejects_bad_specs():
    p = make_policy("blend:alpha=0.25:decay=0.9")
    assert (p.alpha, p.decay) == (0.25, 0.9)
    assert p.label == "blend:alpha=0.25:decay=0.9"
    assert make_policy("decayed_mass").label == "decayed_mass"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo2")
    with pytest.raises(ValueError, match="unknown parameter"):
        make_policy("lru:alpha=1")
    with pytest.raises(ValueError, match="decay"):
        make_policy("decayed_mass:decay=1.5")
    with pytest.raises(ValueError, match="param=value"):
        make_policy("blend:0.3")


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_lazy_queue_returns_the_smallest_live_keys_like_a_brute_force_reference(seed, dense):
    r = np.random.default_rng(seed)
    n = 50
    q = LazyMinQueue(n, dense=dense)
    member = {}
    for _ in range(400):
        op = r.random()
        if op < 0.6:
            keys = r.choice(n, size=int(r.integers(1, 8)), replace=False)
            prios = r.random(keys.shape[0]) * 100
            # recency-like pushes half the time, to exercise the append fast path
            if r.random() < 0.5:
                prios = prios + 1000 + _
            q.push(keys, prios)
            member.update(zip(keys.tolist(), prios.tolist()))
        elif op < 0.8 and member:
            keys = r.choice(list(member), size=min(len(member), int(r.integers(1, 4))), replace=False)
            q.remove(np.asarray(keys))
            for k in keys:
                member.pop(int(k))
        else:
            want = int(r.integers(1, 6))
            k, p = q.smallest(want)
            ref = sorted(member.items(), key=lambda kv: kv[1])[:want]
            assert k.tolist() == [kv[0] for kv in ref]
            assert np.allclose(p, [kv[1] for kv in ref])
