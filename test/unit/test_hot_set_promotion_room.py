"""A hot-set promotion on a full device takes the room of unlocked cached pages.

SGLang's real unified radix cache (the importance policy's Python core, which the prefix
hold needs) and paged allocator, no server, no host tier: the device is filled with
cached prefixes, then ``HiCachePagePools.alloc_device`` asks for pages. Unlocked nodes
are evicted for them; locked ones are not, and it says no.
"""

from __future__ import annotations

import pytest

_SCRIPT = r"""
import json, torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sgl_importance.scheduler.page_pools import HiCachePagePools

P = 4
out = {}

def build():
    alloc = PagedTokenToKVPoolAllocator(
        64, page_size=P, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False
    )
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
        page_size=P, eviction_policy="importance", tree_components=(ComponentType.FULL,))
    cache = UnifiedRadixCache(params)
    nodes = []
    while alloc.available_size() >= 16:  # four 16-token prefixes fill the device
        slots = alloc.alloc(16).to(torch.int64)
        start = 1000 * (len(nodes) + 1)
        nodes.append(cache.insert(InsertParams(key=RadixKey(list(range(start, start + 16))), value=slots)))
    # The pools' alloc reads only the cache, its allocator and the page size (no host tier here).
    pools = HiCachePagePools.__new__(HiCachePagePools)
    pools.tree_cache, pools.allocator, pools.page_size = cache, alloc, P
    return cache, alloc, pools, nodes

cache, alloc, pools, nodes = build()
free_before, cached_before = alloc.available_size(), cache.evictable_size()
slots = pools.alloc_device(2)
out["unlocked"] = {"free_before": free_before, "got": None if slots is None else int(slots.numel()),
                   "cached_before": cached_before, "cached_after": cache.evictable_size()}

cache, alloc, pools, nodes = build()
for n in nodes:
    cache.inc_lock_ref(n.last_device_node)
slots = pools.alloc_device(2)
out["locked"] = {"got": None if slots is None else int(slots.numel()), "protected": cache.protected_size()}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(hooked) -> dict:
    return hooked.run(_SCRIPT).result


def test_a_promotion_on_a_full_device_evicts_unlocked_cached_pages(result):
    unlocked = result["unlocked"]
    assert unlocked["free_before"] < 2 * 4
    assert unlocked["got"] == 2 * 4
    assert unlocked["cached_after"] < unlocked["cached_before"]


def test_locked_prefixes_are_never_evicted_for_it(result):
    assert result["locked"]["got"] is None
    assert result["locked"]["protected"] == 64
