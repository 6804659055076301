from __future__ import annotations

import numpy as np
import pytest

from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.prefix import longest_resident_prefix, prepare_prefix, replay_prefix, replay_prefix_all
from sgl_importance.trace.tables import Accesses, Requests


def _requests(paths, tokens=None, arrivals=None):
    tokens = tokens or {}
    return Requests.from_lists(
        list(range(len(paths))),
        arrivals if arrivals is not None else list(range(len(paths))),
        paths,
        [[tokens.get(n, 10) for n in p] for p in paths],
        [5] * len(paths),
    )


def test_a_resident_node_whose_ancestor_is_not_resident_is_not_a_hit():
    resident = [False, True, True]
    assert longest_resident_prefix([0, 1, 2], resident) == 0
    assert longest_resident_prefix([1, 2, 0], resident) == 2


def test_second_request_hits_the_shared_system_prompt_tokens():
    pd = prepare_prefix(_requests([[1, 2], [1, 3]], tokens={1: 100, 2: 20, 3: 30}))
    c, hits = replay_prefix(pd, make_policy("lru"), 1000)
    assert hits.tolist() == [0, 100]
    assert c.hits == 100 and c.accesses == 120 + 130


def test_eviction_takes_leaves_first_even_when_the_parent_is_less_important():
    # node 1 (system prompt) carries little mass, its child 2 a lot; the budget
    # forces one eviction when request 2 arrives: only the leaf may go.
    req = _requests([[1, 2], [1, 3], [1]], tokens={1: 10, 2: 10, 3: 10})
    tr = Accesses.from_columns(
        {
            "step": [0, 0, 1, 1],
            "request_id": [0, 0, 1, 1],
            "page": [1, 2, 1, 3],
            "node_id": [1, 2, 1, 3],
            "importance": [0.01, 0.99, 0.01, 0.99],
        }
    )
    pd = prepare_prefix(req, tr)
    assert pd.has_importance
    c, hits = replay_prefix(pd, make_policy("decayed_mass"), 20)
    assert hits.tolist() == [0, 10, 10]  # node 1 stayed resident throughout


def test_a_parent_becomes_evictable_once_its_last_child_is_gone():
    # budget 20 tokens: [1,2] fills it; [4] needs both 2 and then 1 evicted.
    pd = prepare_prefix(_requests([[1, 2], [4, 5], [1]], tokens={1: 10, 2: 10, 4: 10, 5: 10}))
    _, hits = replay_prefix(pd, make_policy("lru"), 20)
    assert hits.tolist() == [0, 0, 0]


def test_requests_replay_in_arrival_order_not_table_order():
    pd = prepare_prefix(_requests([[1, 3], [1, 2]], tokens={1: 50, 2: 5, 3: 5}, arrivals=[10, 0]))
    _, hits = replay_prefix(pd, make_policy("lru"), 1000)
    assert hits.tolist() == [0, 50]
    assert pd.request_id.tolist() == [1, 0]


def test_a_node_under_two_different_parents_is_rejected():
    with pytest.raises(ValueError, match="different parents"):
        prepare_prefix(_requests([[1, 2], [3, 2]]))


def test_without_an_accesses_table_node_mass_is_the_token_share():
    pd = prepare_prefix(_requests([[1, 2]], tokens={1: 30, 2: 10}))
    assert not pd.has_importance
    assert pd.path_mass.tolist() == pytest.approx([0.75, 0.25])


def test_belady_keeps_a_reused_prefix_that_one_off_requests_flush_out_of_lru():
    # [1, 2] returns every fourth request; three one-off paths in between fill the cache.
    paths, nxt = [], 100
    for i in range(40):
        if i % 4 == 0:
            paths.append([1, 2])
        else:
            paths.append([nxt])
            nxt += 1
    pd = prepare_prefix(_requests(paths, tokens={1: 10, 2: 10}))
    res = {r.policy: r.counts.hits for r in replay_prefix_all(pd, ["lru", "belady"], [30 / pd.unique_tokens])}
    assert res["lru"] == 0
    assert res["belady"] == 9 * 20


def test_policies_that_only_make_sense_for_the_hot_set_are_refused():
    pd = prepare_prefix(_requests([[1]]))
    with pytest.raises(ValueError, match="prefix"):
        replay_prefix(pd, make_policy("slru"), 10)


def test_string_request_ids_join_node_importance_across_the_two_tables():
    req = Requests.from_lists(["x", "y"], [0, 1], [[1, 2], [1, 3]], [[10, 10], [10, 10]], [1, 1])
    tr = Accesses.from_columns(
        {
            "step": [0, 0, 1],
            "request_id": ["y", "y", "x"],
            "page": [5, 6, 7],
            "node_id": [1, 3, 2],
            "importance": [0.25, 0.75, 1.0],
        }
    )
    pd = prepare_prefix(req, tr)
    by_req = np.split(pd.path_mass, pd.path_ptr[1:-1])
    assert by_req[0].tolist() == pytest.approx([0.0, 1.0])  # x attended only node 2
    assert by_req[1].tolist() == pytest.approx([0.25, 0.75])
