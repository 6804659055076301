"""L3 admission: only nodes that hits or importance say will be reused reach the storage tier."""

from __future__ import annotations

import types

from sgl_importance.cache.admission import (
    ADMITTED,
    DEFERRED,
    STATE,
    admit_deferred,
    gate_storage_write,
    split_state,
)
from sgl_importance.cache.strategy import ImportanceStrategy


class FakeCache:
    """The parts of UnifiedRadixCache the gate touches; writes are recorded."""

    def __init__(self, **config):
        self.root = types.SimpleNamespace(id=0, parent=None, children={})
        self.nodes = {0: self.root}
        self.tree_core = types.SimpleNamespace(
            eviction_strategy=ImportanceStrategy(**config), node_by_id=self.nodes.__getitem__
        )
        self.written: list[int] = []

    @property
    def aggregator(self):
        return self.tree_core.eviction_strategy.aggregator

    def add(self, parent=None, hits=0, importance=None, pinned=False, backuped=True, tokens=16):
        parent = parent or self.root
        node = types.SimpleNamespace(
            id=len(self.nodes), parent=parent, children={}, hit_count=hits,
            backuped=backuped, key=[0] * tokens,
        )  # fmt: skip
        if importance is not None:
            node.importance, node.importance_pinned = importance, pinned
        parent.children[node.id] = node
        self.nodes[node.id] = node
        return node

    def _original_write(self, cache, node_id):
        self.written.append(node_id)

    def write_backup_storage(self, node_id):
        # As the plugin's AROUND hook makes SGLang's method behave.
        gate_storage_write(self._original_write, self, node_id)


def test_without_thresholds_every_node_is_written_as_in_sglang():
    cache = FakeCache()
    node = cache.add(hits=0, importance=0.0)
    cache.write_backup_storage(node.id)
    assert cache.written == [node.id] and not hasattr(node, STATE)


def test_a_node_without_hits_or_importance_is_deferred_not_written():
    cache = FakeCache(storage_min_hits=2, storage_min_importance=0.3)
    cache.aggregator.scale = 1.0
    node = cache.add(hits=1, importance=0.1)
    cache.write_backup_storage(node.id)
    assert cache.written == [] and getattr(node, STATE) == DEFERRED


def test_hits_importance_or_a_sink_each_qualify_a_node():
    cache = FakeCache(storage_min_hits=2, storage_min_importance=0.3)
    cache.aggregator.scale = 1.0
    by_hits = cache.add(hits=2, importance=0.0)
    by_importance = cache.add(hits=0, importance=0.5)
    sink = cache.add(hits=0, importance=0.0, pinned=True)
    for node in (by_hits, by_importance, sink):
        cache.write_backup_storage(node.id)
    assert cache.written == [by_hits.id, by_importance.id, sink.id]
    assert all(getattr(n, STATE) == ADMITTED for n in (by_hits, by_importance, sink))


def test_a_deferred_node_that_earns_importance_is_written_after_its_deferred_ancestors():
    cache = FakeCache(storage_min_importance=0.3)
    cache.aggregator.scale = 1.0
    grandparent = cache.add(importance=0.0)
    parent = cache.add(grandparent, importance=0.0)
    child = cache.add(parent, importance=0.0)
    for node in (grandparent, parent, child):
        cache.write_backup_storage(node.id)
    assert cache.written == []
    child.importance = 0.6  # a later fold
    assert admit_deferred(cache, [child]) == 3
    assert cache.written == [grandparent.id, parent.id, child.id]
    # Written once: an admitted node is not re-decided or rewritten by later folds.
    assert admit_deferred(cache, [child, parent]) == 0 and len(cache.written) == 3


def test_a_deferred_node_no_longer_on_the_host_is_not_written():
    cache = FakeCache(storage_min_importance=0.3)
    cache.aggregator.scale = 1.0
    node = cache.add(importance=0.0)
    cache.write_backup_storage(node.id)
    node.importance, node.backuped = 0.9, False
    assert admit_deferred(cache, [node]) == 0 and cache.written == []


def test_a_parent_acknowledged_after_an_admitted_child_is_admitted_too():
    cache = FakeCache(storage_min_hits=5)
    parent = cache.add(hits=0)
    child = cache.add(parent, hits=9)
    cache.write_backup_storage(child.id)
    cache.write_backup_storage(parent.id)
    assert cache.written == [child.id, parent.id]


def test_both_halves_of_a_split_share_the_storage_decision():
    deferred, prefix = types.SimpleNamespace(), types.SimpleNamespace()
    setattr(deferred, STATE, DEFERRED)
    split_state(prefix, deferred)
    assert getattr(prefix, STATE) == DEFERRED
    undecided, prefix = types.SimpleNamespace(), types.SimpleNamespace()
    split_state(prefix, undecided)
    assert not hasattr(prefix, STATE)
