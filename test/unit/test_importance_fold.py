"""The scheduler-side fold: which tree nodes a decode batch attended, and their pages."""

from __future__ import annotations

import pytest
import torch

from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.node_state import has_importance, node_importance
from sgl_importance.scheduler.fold import fold_after_batch, observe
from support.fake_tree import FULL, FakeCache, FakeTreeCore, decode_batch, request, runtime_of, scheduler_of

PAGE = 4


def build(strategy=None):
    core = FakeTreeCore(strategy, page_size=PAGE)
    shared = core.add(tokens=8, first_slot=16)  # node 1: pages 4, 5
    core.add(shared, 4, first_slot=40)  # node 2: page 10
    core.add(shared, 8, first_slot=60)  # node 3: pages 15, 16
    return core


def req(last_node):
    return request(last_node=last_node)


def test_a_shared_ancestor_is_observed_once_with_each_nodes_position_and_pages():
    core = build()
    seen = list(observe(core, [req(2), req(3), req(None)], PAGE))
    assert [(o.start, o.pages.tolist()) for o in seen] == [(0, [4, 5]), (8, [10]), (8, [15, 16])]
    assert seen[0].node is core.nodes[1]


def test_nodes_without_device_kv_and_vanished_handles_are_skipped():
    core = build()
    core.nodes[1].component_data[FULL].value = None
    seen = list(observe(core, [req(2), req(99)], PAGE))
    # The evicted ancestor is skipped but still shifts its child's position.
    assert [(o.start, o.pages.tolist()) for o in seen] == [(8, [10])]


def test_page_ids_are_cached_until_the_nodes_value_is_replaced():
    core = build()
    first = list(observe(core, [req(2)], PAGE))[0].pages
    again = list(observe(core, [req(2)], PAGE))[0].pages
    assert again is first
    core.nodes[1].component_data[FULL].value = torch.arange(100, 108)  # e.g. a load-back
    assert list(observe(core, [req(2)], PAGE))[0].pages.tolist() == [25, 26]


def test_fold_after_batch_updates_nodes_only_for_decode_batches_under_the_policy(monkeypatch):
    from sgl_importance.cache.strategy import ImportanceStrategy

    strategy = ImportanceStrategy(sink_pages=0)
    core = build(strategy)
    table = PageImportanceTable(32, page_size=PAGE)
    slots = torch.cat([torch.arange(16, 24), torch.arange(40, 44)])
    table.add_layer(torch.tensor([[0.25, 0.25, 0.5]]), torch.tensor([0, 12], dtype=torch.int32), slots)
    table.finish_step()
    scheduler = scheduler_of(FakeCache(core))
    runtime = runtime_of(scheduler, table)

    assert fold_after_batch(runtime, scheduler, decode_batch([req(2)], decode=False)) == 0
    assert not has_importance(core.nodes[2])
    assert fold_after_batch(runtime, scheduler, decode_batch([req(2)])) == 1
    assert node_importance(core.nodes[1]) == pytest.approx((1 - 0.98) * 0.25)
    assert node_importance(core.nodes[2]) == pytest.approx((1 - 0.98) * 0.5)
    # Another policy: nothing is folded.
    core.eviction_strategy = object()
    assert fold_after_batch(runtime_of(scheduler, table), scheduler, decode_batch([req(2)])) == 0
    # A cache without a tree core (radix cache disabled): nothing is folded.
    bare = scheduler_of(object())
    assert fold_after_batch(runtime_of(bare, table), bare, decode_batch([req(2)])) == 0
