"""Importance of pages dropped to the storage tier comes back with them (cache/stored.py)."""

from __future__ import annotations

import pytest

from sgl_importance.cache.stored import StoredImportance
from sgl_importance.cache.strategy import ImportanceStrategy
from sgl_importance.node_state import has_importance, node_importance
from support.fake_tree import FakeCache, FakeNode, FakeTreeCore, detached_node, request, scheduler_of


def node(hashes, importance=None):
    return detached_node(hashes=hashes, importance=importance)


def test_a_rebuilt_node_gets_the_mean_over_its_pages_unknown_pages_counting_zero():
    stored = StoredImportance()
    assert stored.remember(node(["a", "b"], 0.6)) == 2
    rebuilt = node(["a", "b", "c", "d"])
    assert stored.recall(rebuilt) == pytest.approx(0.3)
    assert node_importance(rebuilt) == pytest.approx(0.3)


def test_never_attended_pages_are_not_stored_and_restore_nothing():
    stored = StoredImportance()
    assert stored.remember(node(["a"], 0.0)) == 0
    assert stored.remember(node(["b"])) == 0
    fresh = node(["a", "b"])
    assert stored.recall(fresh) is None and not has_importance(fresh)


def test_a_node_that_kept_its_importance_is_left_alone():
    stored = StoredImportance()
    stored.remember(node(["a"], 0.9))
    kept = node(["a"], 0.1)
    assert stored.recall(kept) is None and node_importance(kept) == 0.1


def test_the_memory_is_bounded_and_forgets_the_oldest_pages():
    stored = StoredImportance(capacity=3)
    stored.remember(node(["a", "b"], 0.5))
    stored.remember(node(["c", "d"], 0.7))
    assert len(stored) == 3
    assert stored.recall(node(["a"])) is None
    assert stored.recall(node(["b"])) == pytest.approx(0.5)


_SCRIPT = r"""
import json, torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sgl_importance.node_state import node_state, peek_state

P = 4
alloc = PagedTokenToKVPoolAllocator(256, page_size=P, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
    page_size=P, eviction_policy="importance", eviction_policy_config=None, tree_components=(ComponentType.FULL,))
cache = UnifiedRadixCache(params)
core = cache.tree_core
stored = core.eviction_strategy.state.stored
dropped = type("Dropped", (), {"hash_value": ["h0", "h1"], "hit_count": 0})()
node_state(dropped).importance = 0.8
stored.remember(dropped)
# What the storage prefetch does with fetched pages: a host-only path under the root.
result = core.insert_host(core.root_node.id, RadixKey(list(range(16))), torch.arange(16), ["h0", "h1", "h2", "h3"])
node = core.node_by_id(result.inserted_host_node)
state = peek_state(node)
print("RESULT " + json.dumps({"importance": state and state.importance, "evicted": node.evicted}))
"""


def test_sglangs_insert_host_restores_importance_through_the_plugin_hook(hooked):
    result = hooked.run(_SCRIPT).result
    assert result == {"importance": pytest.approx(0.4), "evicted": True}


def test_storage_retries_are_reissued_most_important_first(monkeypatch):
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from sgl_importance.cache.stored import rank_storage_retries

    page = 16
    hot_doc, cold_doc = list(range(100, 164)), list(range(500, 564))
    stored = StoredImportance()
    # The hot document's pages were dropped while important, hashed as SGLang keys them.
    stored.remember(node(get_storage_hash_str(RadixKey(hot_doc), None, page_size=page), 0.8))
    strategy = ImportanceStrategy()
    strategy.state.stored = stored
    cache = FakeCache(FakeTreeCore(strategy, page_size=page))
    scheduler = scheduler_of(cache)

    def req(rid, tokens):
        return request(rid=rid, full_untruncated_fill_ids=tokens + [1, 2, 3], prefix_len=0, last_host_node=0)

    ready = [(req("cold", cold_doc), None), (req("hot", hot_doc), None)]
    ranked = rank_storage_retries(scheduler, lambda retries, queue, *a: list(ready), None, [])
    assert [r.rid for r, _ in ranked] == ["hot", "cold"]
    # Nothing remembered: SGLang's order stands.
    monkeypatch.setattr(strategy.state, "stored", StoredImportance())
    assert [r.rid for r, _ in rank_storage_retries(scheduler, lambda *a: list(ready), None, [])] == ["cold", "hot"]


def test_a_retry_whose_matched_node_was_deleted_is_ranked_without_reading_the_tree(monkeypatch):
    # Regression: under load a deferred retry's last_host_node had been evicted from
    # the host tier; reading it raised KeyError inside the scheduler and killed it.
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from sgl_importance.cache.stored import rank_storage_retries

    page = 16
    shared = list(range(1000, 1032))  # two pages both requests matched before
    hot_doc, cold_doc = shared + list(range(100, 164)), shared + list(range(500, 564))
    stored = StoredImportance()
    # Only the pages after the match were dropped while important, chained on the match.
    stored.remember(node(get_storage_hash_str(RadixKey(hot_doc), None, page_size=page)[2:], 0.8))

    def deleted(node_id):
        raise KeyError(node_id)

    strategy = ImportanceStrategy()
    strategy.state.stored = stored
    cache = FakeCache(FakeTreeCore(strategy, page_size=page))
    # Every way into the tree raises, as for a deleted node.
    cache.tree_core.node_by_id = cache.get_last_hash_value = cache.is_root = deleted
    scheduler = scheduler_of(cache)

    def req(rid, tokens):
        return request(
            rid=rid, full_untruncated_fill_ids=tokens + [7], prefix_len=16, host_hit_length=16,
            last_host_node=12345,
        )  # fmt: skip

    ready = [(req("cold", cold_doc), None), (req("hot", hot_doc), None)]
    assert [r.rid for r, _ in rank_storage_retries(scheduler, lambda *a: list(ready), None, [])] == ["hot", "cold"]


def test_a_tenants_pages_never_rank_another_tenants_retry(monkeypatch):
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from sgl_importance.cache.stored import request_storage_importance

    page = 16
    doc = list(range(100, 164))
    stored = StoredImportance()
    stored.remember(node(get_storage_hash_str(RadixKey(doc, cache_salt="a"), None, page_size=page), 0.8))
    cache = FakeCache(FakeTreeCore(page_size=page))

    def req(salt):
        return request(full_untruncated_fill_ids=doc + [1], prefix_len=0, cache_salt=salt)

    assert request_storage_importance(stored, cache, req("a")) == pytest.approx(0.8)
    assert request_storage_importance(stored, cache, req("b")) == 0.0
    assert request_storage_importance(stored, cache, req(None)) == 0.0


def sglang_node(tokens, importance=None, **namespace):
    """A node under the root with the page hashes SGLang gives it when storage is on
    (``compute_node_hash_values``, seeded by the key's extra_key / cache_salt)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import compute_node_hash_values

    root = FakeNode(0, None, 0)
    root.key, root.hash_value = RadixKey([]), []
    n = FakeNode(1, root, 0)
    n.key = RadixKey(tokens, **namespace)
    hashes = compute_node_hash_values(n, 16)
    assert len(hashes) == len(tokens) // 16
    return node(hashes, importance)


def test_a_tenants_dropped_pages_are_remembered_apart_from_another_tenants_identical_pages():
    doc = list(range(100, 164))
    stored = StoredImportance()
    stored.remember(sglang_node(doc, 0.8, cache_salt="a"))
    stored.remember(sglang_node(doc, 0.1, cache_salt="b"))
    # Same tokens, two tenants: two disjoint sets of four pages.
    assert len(stored) == 2 * 4
    assert stored.recall(sglang_node(doc, cache_salt="a")) == pytest.approx(0.8)
    assert stored.recall(sglang_node(doc, cache_salt="b")) == pytest.approx(0.1)
    for other in ({"extra_key": "a"}, {"cache_salt": "c"}, {}):
        assert stored.recall(sglang_node(doc, **other)) is None, other
