"""``residency.PagePools`` over plain tensors, for the hot-set tests that release pages.

A device pool whose page 0 is padding and a host pool, both ``[layers, slots, kv_heads,
dim]``. It checks what SGLang's pools would trip on later: a page freed twice, or the
padding page freed, fails at once; and it keeps the host-slot ledger the test suite keeps
on every real server (``hot_set/pages/host_ledger.py``): a host slot moved by a request that
does not hold it fails at once, naming both.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from sgl_importance.hot_set.pages.host_ledger import HostSlotLedger


class ArrayPools:
    """Device and host KV pools as tensors, with page allocators.

    Args:
        device_pages, host_pages: pages in each pool (the device gets one more: padding).
        promotions: False: the device has no page for a promotion (new tokens still get
            theirs), so every released page a plan lists is read from its host copy.
        device: where the device pool lives (a stand-in device in the fake-CUDA tests).
        host_views: whether the host pool offers page views (``host_pages``), as the native
            platforms' host pool does; False: as SGLang's own on a CUDA platform (none).
    """

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        dim: int,
        page_size: int,
        device_pages: int,
        host_pages: int,
        promotions: bool = True,
        device: str = "cpu",
        host_views: bool = True,
    ) -> None:
        self.page_size = page_size
        self.host_views = host_views
        self.promotions = promotions
        self.device = device
        self.device_pages = device_pages
        shape = (layers, (device_pages + 1) * page_size, kv_heads, dim)
        self.k, self.v = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
        host_shape = (layers, max(host_pages, 1) * page_size, kv_heads, dim)
        self.hk, self.hv = torch.zeros(host_shape), torch.zeros(host_shape)
        self.free_device_pages = list(range(1, device_pages + 1))
        self.free_host_pages = list(range(host_pages))
        self.ledger = HostSlotLedger(max(host_pages, 1) * page_size)
        self._in_forward = False  # inside a decode forward: no page may move (``forward``)
        self.peak_used = 0  # most device pages held at once

    def _slots(self, pages: list[int]) -> torch.Tensor:
        return (torch.tensor(pages)[:, None] * self.page_size + torch.arange(self.page_size)).flatten()

    @contextmanager
    def forward(self) -> Iterator[None]:
        """While inside (a decode forward), any page move fails the test at once."""
        self._in_forward = True
        try:
            yield
        finally:
            self._in_forward = False

    def _no_move(self, what: str) -> None:
        if self._in_forward:
            raise AssertionError(f"a page moved inside the decode forward: {what}")

    def alloc_device(self, num_pages: int, for_tokens: bool = False):
        self._no_move("alloc_device")
        if num_pages > len(self.free_device_pages) or not (for_tokens or self.promotions):
            return None
        pages, self.free_device_pages = self.free_device_pages[:num_pages], self.free_device_pages[num_pages:]
        self.peak_used = max(self.peak_used, self.device_pages - len(self.free_device_pages))
        return self._slots(pages).to(self.device)

    def free_device(self, slots: torch.Tensor) -> None:
        self._no_move("free_device")
        pages = sorted(set((slots // self.page_size).tolist()))
        assert 0 not in pages and not set(pages) & set(self.free_device_pages), "double or padding free"
        self.free_device_pages += pages

    def alloc_host(self, num_pages: int, owner: str | None = None):
        """Host slots for request ``owner`` (None: the tree's, as a write-through's)."""
        self._no_move("alloc_host")
        if num_pages > len(self.free_host_pages):
            return None
        pages, self.free_host_pages = self.free_host_pages[:num_pages], self.free_host_pages[num_pages:]
        slots = self._slots(pages)
        self.ledger.allocated(slots)
        if owner is not None:
            self.ledger.take(slots, owner)
        return slots

    def free_host(self, slots: torch.Tensor, owner: str | None = None) -> None:
        self._no_move("free_host")
        if owner is not None:
            self.ledger.release(slots, owner)
        self.ledger.freed(slots)
        self.free_host_pages += sorted(set((slots // self.page_size).tolist()))

    def give_host(self, slots: torch.Tensor, owner: str) -> None:
        self.ledger.give(slots, owner)

    def borrow_host(self, slots: torch.Tensor, owner: str) -> None:
        self.ledger.borrow(slots, owner)

    def unborrow_host(self, owner: str) -> None:
        self.ledger.unborrow(owner)

    # The copies between the pools are SGLang's transfer kernels' (across devices by
    # design): outside what the fake-CUDA tests check, hence no torch-function dispatch.

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        self._no_move("to_host")
        with torch._C.DisableTorchFunction():
            src, dst = device_slots.to(self.k.device), host_slots.to(self.hk.device)
            self.hk[:, dst] = self.k[:, src].to(self.hk.device)
            self.hv[:, dst] = self.v[:, src].to(self.hv.device)

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        self._no_move("to_device")
        with torch._C.DisableTorchFunction():
            src, dst = host_slots.to(self.hk.device), device_slots.to(self.k.device)
            self.k[:, dst] = self.hk[:, src].to(self.k.device)
            self.v[:, dst] = self.hv[:, src].to(self.v.device)

    def host_layer(self, layer_id: int, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch._C.DisableTorchFunction():
            return self.hk[layer_id, host_slots].clone(), self.hv[layer_id, host_slots].clone()

    def host_pages(self, layer_id: int):
        if not self.host_views:
            return None
        ps = self.page_size
        return tuple(h[layer_id].view(-1, ps, *h.shape[2:]) for h in (self.hk, self.hv))
