"""The importance policy inside SGLang's real unified radix cache (no server).

In the hooked interpreter (``support.hooked``: the plugin's hooks patch SGLang classes): the FULL override
selects the Python tree core under ``importance`` only; folded page importance
decides which leaf SGLang's eviction walk frees; a split hands the importance to
both halves; demotion to the host tier keeps the node and its importance.
"""

from __future__ import annotations

import pytest

_SCRIPT = r"""
import json, types, torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sgl_importance.node_state import node_importance, peek_state
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.cache.state_of import state_of
from sgl_importance.scheduler.fold import observe

def importance_or_none(node):
    state = peek_state(node)
    return None if state is None else state.importance

P = 4
out = {}

def build(policy, config=None):
    alloc = PagedTokenToKVPoolAllocator(
        256, page_size=P, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False
    )
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
        page_size=P, eviction_policy=policy, eviction_policy_config=config, tree_components=(ComponentType.FULL,))
    return UnifiedRadixCache(params), alloc

for policy in ("lru", "importance"):
    cache, _ = build(policy)
    out[policy] = [type(cache.tree_core).__name__, type(cache.components[ComponentType.FULL]).__name__]

def importance_cache(config):
    # A cache under importance, and an insert of token ids that returns the leaf id.
    cache, alloc = build("importance", config)
    def insert(tokens):
        slots = alloc.alloc(len(tokens)).to(torch.int64)
        return cache.insert(InsertParams(key=RadixKey(list(tokens)), value=slots)).last_device_node
    return cache, alloc, insert

def scenario(config):
    cache, alloc, insert = importance_cache(config)
    core = cache.tree_core
    doc = insert(range(1000, 1016))                            # oldest
    one_offs = [insert(range(2000 + 100 * i, 2016 + 100 * i)) for i in range(3)]
    # Decode steps in which a request over the document attends it heavily.
    table = PageImportanceTable.for_pool(256, page_size=P)
    doc_slots = core.node_by_id(doc).component_data[ComponentType.FULL].value
    for _ in range(10):
        table.add_layer(torch.tensor([[0.1, 0.3, 0.3, 0.3]]), torch.tensor([0, 16], dtype=torch.int32), doc_slots)
        table.finish_step()
        state_of(cache).aggregator.fold(table, list(observe(core, [types.SimpleNamespace(last_node=doc)], P)))
    before = alloc.available_size()
    cache.evict(EvictParams(num_tokens=16))
    gone = [n for n in [doc, *one_offs] if n not in core._node_arena]
    return {"evicted": ["doc" if n == doc else f"one_off{one_offs.index(n)}" for n in gone],
            "freed": alloc.available_size() - before,
            "doc_importance": importance_or_none(core.node_by_id(doc)) if doc in core._node_arena else None,
            "cache": cache, "alloc": alloc, "doc": doc, "insert": insert}

r = scenario({"recency_weight": 1.0, "reuse_weight": 0.0})
out["importance_evicted"], out["importance_freed"] = r["evicted"], r["freed"]
out["doc_importance"] = r["doc_importance"]
r_lru = scenario({"importance_weight": 0, "reuse_weight": 0, "pin_sinks": False})
out["lru_evicted"] = r_lru["evicted"]

# Split: a request sharing the document's first 8 tokens cuts its node in two.
cache, insert, doc = r["cache"], r["insert"], r["doc"]
core = cache.tree_core
whole = core.node_by_id(doc)
insert(list(range(1000, 1008)) + list(range(3000, 3008)))
prefix = whole.parent
out["split"] = {
    "prefix_len": len(prefix.key), "suffix_len": len(whole.key),
    "prefix_importance": importance_or_none(prefix), "suffix_importance": importance_or_none(whole),
    "starts": [peek_state(prefix).start, peek_state(whole).start],
    "pinned": [peek_state(prefix).pinned, peek_state(whole).pinned],
}
# Demotion to the host tier keeps the node object and its importance.
cd = whole.component_data[ComponentType.FULL]
cd.host_value = torch.arange(len(whole.key), dtype=torch.int64)  # as a finished host backup would
node_id, value = whole.id, node_importance(whole)
cache._demote(node_id, {ComponentType.FULL: 0})
out["demoted"] = {"same_object": core.node_by_id(node_id) is whole, "evicted": whole.evicted,
                  "importance_kept": node_importance(whole) == value}

# The credit form: a document re-read once outlives one-offs inserted after it; the
# turnover clock counts the tokens of every new leaf over the allocator's pool.
def credit(config):
    cache, _, insert = importance_cache(config)
    core = cache.tree_core
    doc = insert(range(1000, 1016))
    insert(range(1000, 1016))                                 # re-read: SGLang's hit_count 2
    fillers = [insert(range(2000 + 100 * i, 2016 + 100 * i)) for i in range(4)]
    cache.evict(EvictParams(num_tokens=16))
    gone = [n for n in [doc, *fillers] if n not in core._node_arena]
    turnover = state_of(cache).turnover
    return {"evicted": ["doc" if n == doc else f"filler{fillers.index(n)}" for n in gone],
            "total": turnover.total, "pool": turnover.pool_tokens}
out["credit"] = credit({"form": "credit", "reuse_credit": 1.0})
out["credit_lru"] = credit({"form": "credit", "reuse_credit": 0.0, "pin_sinks": False})
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(hooked) -> dict:
    outcome = hooked.run(_SCRIPT)
    assert "undrained" not in outcome.stderr, outcome.stderr[-3000:]
    return outcome.result


def test_only_the_importance_policy_gets_the_python_core_and_the_full_override(result):
    assert result["importance"] == ["UnifiedTreeCore", "ImportanceFullComponent"]
    assert result["lru"][1] == "FullComponent"


def test_sglangs_eviction_walk_frees_the_unimportant_leaf_and_keeps_the_attended_old_one(result):
    assert result["importance_evicted"] == ["one_off0"] and result["importance_freed"] == 16
    assert result["doc_importance"] == pytest.approx(0.3 * (1 - 0.98**10))


def test_with_lru_weights_the_same_walk_evicts_the_oldest_leaf(result):
    assert result["lru_evicted"] == ["doc"]


def test_a_split_gives_both_halves_the_importance_and_their_positions(result):
    split = result["split"]
    assert (split["prefix_len"], split["suffix_len"]) == (8, 8)
    assert split["prefix_importance"] == split["suffix_importance"] == pytest.approx(result["doc_importance"])
    assert split["starts"] == [0, 8]
    # sink_pages=1 is one 4-token page: the 8-token prefix straddles it, so it is not pinned.
    assert split["pinned"] == [False, False]


def test_the_credit_form_keeps_a_re_read_document_that_its_lru_evicts(result):
    # Inserted once and re-read, then four one-off leaves: 64 tokens of a 256-token
    # pool's turnover since the re-read, under a credit of half a pool for one re-read.
    assert result["credit"] == {"evicted": ["filler0"], "total": 80.0, "pool": 256.0}
    assert result["credit_lru"]["evicted"] == ["doc"]


def test_demotion_to_the_host_tier_keeps_the_node_object_and_its_importance(result):
    assert result["demoted"] == {"same_object": True, "evicted": True, "importance_kept": True}
