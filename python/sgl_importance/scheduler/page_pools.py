"""The device and host page pools as the residency owner moves pages between them.

``HiCachePagePools`` is ``hot_set/residency.PagePools`` over SGLang's token allocator and
HiCache's host pool (the tree's ``host_pool_group``): allocation and freeing on either tier,
host slots lent to and borrowed from the radix tree (checked by the host-slot ledger in
the test suite), the copies between tiers, and a layer's host pages read where they lie.
Built by ``hot_set_release.enable`` once a server has a host pool.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sgl_importance.hot_set.pages.host_ledger import ledger_from_env
from sgl_importance.sglang_types.tree import TreeCache

logger = logging.getLogger(__name__)


class HiCachePagePools:
    """``residency.PagePools`` over SGLang's allocator and HiCache's host pool."""

    def __init__(self, tree_cache: TreeCache) -> None:
        self.tree_cache = tree_cache
        self.allocator = tree_cache.token_to_kv_pool_allocator
        self.page_size = self.allocator.page_size
        self.device_pool = self.allocator.get_kvcache()
        self.host_group = tree_cache.host_pool_group
        self.host_pool = self.host_group.anchor_entry.host_pool
        self.io_backend = tree_cache.cache_controller.io_backend
        # Who holds each host slot, checked at every move (on in the test suite).
        self.ledger = ledger_from_env(self.host_pool.size)
        if self.ledger is not None:
            self.host_pool.ledger = self.ledger

    def alloc_device(self, num_pages: int) -> Optional[torch.Tensor]:
        # A page the plan attends is worth more than an unlocked cached one: read from the
        # host instead, it would cross PCIe in every layer of every step.
        tokens = num_pages * self.page_size
        slots = self.allocator.alloc(tokens)
        if slots is None and tokens:
            from sglang.srt.mem_cache.common import evict_from_tree_cache

            evict_from_tree_cache(self.tree_cache, tokens)
            slots = self.allocator.alloc(tokens)
        return slots

    def free_device(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def alloc_host(self, num_pages: int, owner: str) -> Optional[torch.Tensor]:
        # Host nodes of the tree make room if the pool is full (they are copies).
        slots = self.host_group.alloc(num_pages * self.page_size, reclaim=self.tree_cache.evict_host)
        if slots is not None and self.ledger is not None:
            self.ledger.take(slots, owner)
        return slots

    def free_host(self, slots: torch.Tensor, owner: str) -> None:
        allocated = self.host_allocated(slots)
        if not bool(allocated.all()):
            # Someone else freed them (a bug; the ledger names who in the test suite):
            # freeing them again would kill the scheduler, so leave them.
            logger.error(
                "hot set: request %s's host slots %s were already freed; not freeing them again",
                owner,
                slots[~allocated][:8].tolist(),
            )
            slots = slots[allocated]
        if self.ledger is not None:
            self.ledger.release(slots, owner)
        self.host_group.free(slots)

    def host_allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """Whether each host slot is allocated in the pool (a bool per slot)."""
        return self.host_pool.slot_used[slots.to("cpu", torch.int64)]

    def give_host(self, slots: torch.Tensor, owner: str) -> None:
        if self.ledger is not None:
            self.ledger.give(slots, owner)

    def borrow_host(self, slots: torch.Tensor, owner: str) -> None:
        if self.ledger is not None:
            self.ledger.borrow(slots, owner)

    def unborrow_host(self, owner: str) -> None:
        if self.ledger is not None:
            self.ledger.unborrow(owner)

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        self.host_pool.backup_from_device_all_layer(self.device_pool, host_slots, device_slots, self.io_backend)

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        for layer in range(self.host_pool.layer_num):
            self.host_pool.load_to_device_per_layer(self.device_pool, host_slots, device_slots, layer, self.io_backend)

    def host_layer(self, layer_id: int, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.host_pool.gather_layer(layer_id, host_slots)

    def host_pages(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        # The native platforms' host pool (platform/host_pool.py) has page views; SGLang's own
        # (a CUDA platform's, read by its kernels) is not read in place.
        layer_pages = getattr(self.host_pool, "layer_pages", None)
        return None if layer_pages is None else layer_pages(layer_id)
