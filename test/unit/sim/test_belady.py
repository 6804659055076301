from __future__ import annotations

import numpy as np
import pytest

from sgl_importance.sim.belady import next_use
from sgl_importance.sim.policies import POLICIES, make_policy
from sgl_importance.sim.replay import prepare_hot, replay_stream
from sgl_importance.trace.tables import Accesses
from support.traces import sequence_trace, trace_from_steps

# The classic reference string of operating-systems textbooks.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def _misses(pages, policy: str, frames: int) -> int:
    hs = prepare_hot(sequence_trace(pages), "all")
    c, _ = replay_stream(hs, 0, make_policy(policy), frames)
    return int(c.accesses - c.hits)


def _opt_misses_exhaustive(pages, frames: int) -> int:
    """Minimum misses over every eviction choice (demand fetch), by dynamic programming over cache contents."""
    states = {frozenset(): 0}
    for p in pages:
        nxt: dict[frozenset, int] = {}
        for s, m in states.items():
            if p in s:
                cands = [(s, m)]
            elif len(s) < frames:
                cands = [(s | {p}, m + 1)]
            else:
                cands = [((s - {v}) | {p}, m + 1) for v in s]
            for s2, m2 in cands:
                if m2 < nxt.get(s2, 1 << 30):
                    nxt[s2] = m2
        states = nxt
    return min(states.values())


def test_textbook_reference_string_with_three_frames_gives_9_faults_for_opt_and_12_for_lru():
    assert _misses(TEXTBOOK, "belady", 3) == 9
    assert _misses(TEXTBOOK, "lru", 3) == 12


def test_first_13_references_give_7_faults_for_opt_and_9_for_lru():
    assert _misses(TEXTBOOK[:13], "belady", 3) == 7
    assert _misses(TEXTBOOK[:13], "lru", 3) == 9


def test_exhaustive_search_confirms_the_textbook_optimum():
    assert _opt_misses_exhaustive(TEXTBOOK, 3) == 9


@pytest.mark.parametrize("seed", range(25))
def test_belady_matches_exhaustive_optimum_on_random_reference_strings(seed):
    r = np.random.default_rng(seed)
    pages = r.integers(0, int(r.integers(3, 7)), int(r.integers(5, 16))).tolist()
    frames = int(r.integers(1, 4))
    assert _misses(pages, "belady", frames) == _opt_misses_exhaustive(pages, frames)


@pytest.mark.parametrize("seed", range(8))
def test_belady_hits_at_least_as_often_as_every_online_policy_when_steps_demand_page_sets(seed):
    r = np.random.default_rng(seed)
    steps = []
    for _ in range(120):
        pages = r.choice(30, size=int(r.integers(1, 5)), replace=False)
        steps.append({int(p): float(m) for p, m in zip(pages, r.dirichlet(np.ones(len(pages))))})
    hs = prepare_hot(Accesses.from_columns(trace_from_steps(steps)), "all")
    best, _ = replay_stream(hs, 0, make_policy("belady"), 8)
    for name in POLICIES:
        if name in ("belady", "prefetch"):  # prefetching is not demand fetch: it may beat MIN
            continue
        c, _ = replay_stream(hs, 0, make_policy(name), 8, seed=seed)
        assert c.hits <= best.hits, name


def test_next_use_points_to_the_next_event_demanding_the_same_key():
    # events: {0,1} {1} {0} ; rows sorted as given; all demanded
    keys = np.array([0, 1, 1, 0])
    ptr = np.array([0, 2, 3, 4])
    nu = next_use(keys, ptr, np.array([2, 1, 1]))
    assert nu.tolist() == [2, 1, 3, 3]  # 3 = no further use (number of events)


def test_next_use_ignores_rows_that_are_not_demanded():
    keys = np.array([0, 1, 1, 0])
    ptr = np.array([0, 2, 4])
    # event 1 demands only its first row (key 1): key 0 at row 3 is no use
    nu = next_use(keys, ptr, np.array([2, 1]))
    assert nu[0] == 2 and nu[1] == 1
