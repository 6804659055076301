"""L3 admission: only nodes that hits or importance say will be reused reach the storage tier."""

from __future__ import annotations

from sgl_importance.cache.admission import (
    ADMITTED,
    DEFERRED,
    admit_deferred,
    split_state,
)
from sgl_importance.node_state import node_state, peek_state
from support.fake_tree import FULL, AdmissionCache, detached_node


def decision(node):
    state = peek_state(node)
    return None if state is None else state.storage


def set_importance(node, value):
    node_state(node).importance = value


def test_without_thresholds_every_node_is_written_as_in_sglang():
    cache = AdmissionCache()
    node = cache.add(hits=0, importance=0.0)
    cache.write_backup_storage(node.id)
    assert cache.written == [node.id] and decision(node) is None


def test_a_node_without_hits_or_importance_is_deferred_not_written():
    cache = AdmissionCache(storage_min_hits=2, storage_min_importance=0.3)
    cache.aggregator.scale = 1.0
    node = cache.add(hits=1, importance=0.1)
    cache.write_backup_storage(node.id)
    assert cache.written == [] and decision(node) == DEFERRED


def test_hits_importance_or_a_sink_each_qualify_a_node():
    cache = AdmissionCache(storage_min_hits=2, storage_min_importance=0.3)
    cache.aggregator.scale = 1.0
    by_hits = cache.add(hits=2, importance=0.0)
    by_importance = cache.add(hits=0, importance=0.5)
    sink = cache.add(hits=0, importance=0.0, pinned=True)
    for node in (by_hits, by_importance, sink):
        cache.write_backup_storage(node.id)
    assert cache.written == [by_hits.id, by_importance.id, sink.id]
    assert all(decision(n) == ADMITTED for n in (by_hits, by_importance, sink))


def test_a_deferred_node_that_earns_importance_is_written_after_its_deferred_ancestors():
    cache = AdmissionCache(storage_min_importance=0.3)
    cache.aggregator.scale = 1.0
    grandparent = cache.add(importance=0.0)
    parent = cache.add(grandparent, importance=0.0)
    child = cache.add(parent, importance=0.0)
    for node in (grandparent, parent, child):
        cache.write_backup_storage(node.id)
    assert cache.written == []
    set_importance(child, 0.6)  # a later fold
    assert admit_deferred(cache, [child]) == 3
    assert cache.written == [grandparent.id, parent.id, child.id]
    # Written once: an admitted node is not re-decided or rewritten by later folds.
    assert admit_deferred(cache, [child, parent]) == 0 and len(cache.written) == 3


def test_a_deferred_node_no_longer_on_the_host_is_not_written():
    cache = AdmissionCache(storage_min_importance=0.3)
    cache.aggregator.scale = 1.0
    node = cache.add(importance=0.0)
    cache.write_backup_storage(node.id)
    set_importance(node, 0.9)
    node.component_data[FULL].host_value = None  # dropped from the host tier
    assert admit_deferred(cache, [node]) == 0 and cache.written == []


def test_a_parent_acknowledged_after_an_admitted_child_is_admitted_too():
    cache = AdmissionCache(storage_min_hits=5)
    parent = cache.add(hits=0)
    child = cache.add(parent, hits=9)
    cache.write_backup_storage(child.id)
    cache.write_backup_storage(parent.id)
    assert cache.written == [child.id, parent.id]


def test_both_halves_of_a_split_share_the_storage_decision():
    deferred, prefix = detached_node(), detached_node()
    node_state(deferred).storage = DEFERRED
    split_state(prefix, deferred)
    assert decision(prefix) == DEFERRED
    undecided, prefix = detached_node(), detached_node()
    split_state(prefix, undecided)
    assert decision(prefix) is None
