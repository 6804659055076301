"""Device pages a hot-set request gives back, and the host copies that replace them.

A long request admitted to release (its pages past the ones the radix tree holds
for it are its own: a long prefill kept out of the tree, or a request that grew
past the threshold while decoding) releases the device pages its hot set no longer
plans: the page is copied to SGLang's host pool the first time it leaves (a full
page never changes again, so one copy serves every later promotion), its device
page goes back to the allocator and its ``req_to_token`` entries point at the
padding page 0, which every decode kernel here masks. A promotion allocates a
device page, copies the host page in and rewrites the row. Pages shared with the
tree (the matched prefix, or a grown request's prompt) and the page being written
stay on the device.

This module holds the record and the page moves: ``RequestPages`` (one request's
residency and host copies), ``ReleaseRegistry`` (the process-wide record of the requests
eligible for release, so the scheduler's hooks and the decoder see one state) and
``PagePools``, what the moves need from SGLang. The hooks that act on the record
when a request is admitted (at prefill, or mid-decode) or leaves (finish, abort,
retract), and the adapter of ``PagePools`` over SGLang's pools, are
``scheduler/hot_set_release.py``.
Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

logger = logging.getLogger(__name__)

# Slot every released position of a row points at: SGLang keeps page 0 as padding
# and the decode kernels mask it (``mask_page0``), so a stray read adds nothing.
RELEASED_SLOT = 0


class PagePools(Protocol):
    """The device and host page pools (SGLang's allocator and HiCache's host pool):
    what releasing and promoting a page needs of them."""

    page_size: int

    def alloc_device(self, num_pages: int) -> Optional[torch.Tensor]:
        """Token slots of ``num_pages`` fresh device pages, or None when full."""

    def free_device(self, slots: torch.Tensor) -> None: ...

    def alloc_host(self, num_pages: int) -> Optional[torch.Tensor]:
        """Token slots of ``num_pages`` host pages, or None when full."""

    def free_host(self, slots: torch.Tensor) -> None: ...

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy every layer's K and V of the slots device → host."""

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy every layer's K and V of the slots host → device."""

    def host_layer(self, layer_id: int, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V rows ``[n, kv_heads, D]`` of host slots (a copy)."""


@dataclass
class ReleaseCounts:
    """Page moves, summed; folded into ``HotSetCounts`` by the decoder."""

    pages_released: int = 0  # device pages given back to the allocator
    pages_copied_out: int = 0  # device → host copies (a page's first release)
    pages_copied_in: int = 0  # host → device promotions
    promotions_refused: int = 0  # planned pages with no free device page (read from host)
    releases_refused: int = 0  # releases with no free host page (page kept)
    finished_reinserted: int = 0  # finished requests whose pages all came back (tree insert)
    finished_uncached: int = 0  # finished requests left out of the tree (no device room)


class RequestPages:
    """Device residency of one request's logical pages, and their host copies.

    Args:
        row: the request's ``req_to_token`` row (a view: writes reach SGLang's table).
        first_owned_page: pages before it belong to the radix tree; never released.
        page_size: tokens per page.
    """

    def __init__(self, row: torch.Tensor, first_owned_page: int, page_size: int) -> None:
        self.row = row
        self.first_owned_page = first_owned_page
        self.page_size = page_size
        self.host = torch.full((0, page_size), -1, dtype=torch.int64)
        self.released = torch.zeros(0, dtype=torch.bool)

    def _grow(self, num_pages: int) -> None:
        extra = num_pages - self.released.numel()
        if extra > 0:
            self.host = torch.cat((self.host, torch.full((extra, self.page_size), -1, dtype=torch.int64)))
            self.released = torch.cat((self.released, torch.zeros(extra, dtype=torch.bool)))

    def _positions(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)[None, :]).flatten()

    def release(self, pages: torch.Tensor, pools: PagePools, counts: ReleaseCounts) -> None:
        """Give back the device pages of ``pages`` (full, owned, resident logical pages)."""
        self._grow(int(pages.max()) + 1 if pages.numel() else 0)
        pages = pages[(pages >= self.first_owned_page) & ~self.released[pages]]
        if pages.numel() == 0:
            return
        uncopied = pages[self.host[pages, 0] < 0]
        if uncopied.numel():
            host = pools.alloc_host(uncopied.numel())
            if host is None:
                counts.releases_refused += pages.numel()
                return
            host = host.view(-1, self.page_size).to(torch.int64)
            pools.to_host(self.row[self._positions(uncopied)].to(torch.int64), host.flatten())
            self.host[uncopied] = host
            counts.pages_copied_out += uncopied.numel()
        positions = self._positions(pages)
        pools.free_device(self.row[positions].to(torch.int64))
        self.row[positions] = RELEASED_SLOT
        self.released[pages] = True
        counts.pages_released += pages.numel()

    def restore(
        self, pages: torch.Tensor, pools: PagePools, counts: ReleaseCounts, *, note_refusal: bool = True
    ) -> torch.Tensor:
        """Bring released ``pages`` back to the device; returns those still released.

        ``note_refusal``: count a refusal (off for the early attempt a step ahead,
        which the step itself retries).
        """
        self._grow(int(pages.max()) + 1 if pages.numel() else 0)
        pages = pages[self.released[pages]]
        if pages.numel() == 0:
            return pages
        slots = pools.alloc_device(pages.numel())
        if slots is None:
            if note_refusal:
                counts.promotions_refused += pages.numel()
            return pages
        slots = slots.to(torch.int64)
        pools.to_device(self.host[pages].flatten(), slots)
        self.row[self._positions(pages)] = slots.to(self.row.dtype)
        self.released[pages] = False
        counts.pages_copied_in += pages.numel()
        return pages[:0]

    def released_pages(self) -> torch.Tensor:
        return torch.nonzero(self.released).flatten()

    def host_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Host slots of released ``pages``, page by page."""
        return self.host[pages].flatten()

    def drop(self, pools: PagePools) -> None:
        """Free the host copies (the request is leaving)."""
        copied = self.host[:, 0] >= 0
        if bool(copied.any()):
            pools.free_host(self.host[copied].flatten())
        self.host = self.host[:0]
        self.released = self.released[:0]


def subtract_pages(ranges: list[tuple[int, int]], pages: list[int], page_size: int) -> list[tuple[int, int]]:
    """Half-open row ranges minus the positions of ``pages`` (ascending, disjoint out)."""
    out = []
    for start, end in ranges:
        cut = start
        for page in pages:
            lo, hi = page * page_size, (page + 1) * page_size
            if hi <= cut or lo >= end:
                continue
            if lo > cut:
                out.append((cut, lo))
            cut = max(cut, hi)
        if cut < end:
            out.append((cut, end))
    return out


class ReleaseRegistry:
    """The requests eligible for release in this process, by rid."""

    def __init__(self) -> None:
        self.pools: Optional[PagePools] = None
        self.threshold: Optional[int] = None  # tokens past which a request may release; None: off
        self._first_owned: dict[str, int] = {}
        self._pages: dict[str, RequestPages] = {}
        self.counts = ReleaseCounts()
        # Set when a step gave device pages back: the scheduler may admit again.
        self.reopen = False
        # req_pool_idx -> the pages of a request being released right now (free_kv_row
        # runs inside release_kv_cache and sees only the kv record).
        self.leaving: dict[int, RequestPages] = {}

    @property
    def enabled(self) -> bool:
        return self.pools is not None and self.threshold is not None

    def enable(self, pools: PagePools, threshold: int) -> None:
        self.pools, self.threshold = pools, threshold

    def admit(self, rid: str, first_owned_page: int) -> None:
        """``rid``'s pages from ``first_owned_page`` on are its own (out of the tree) and
        may be released; a second admission before it leaves keeps the first page."""
        self._first_owned.setdefault(rid, first_owned_page)

    def admitted(self, rid: str) -> bool:
        return rid in self._first_owned

    def pages_of(self, rid: str, row: torch.Tensor, page_size: int) -> Optional[RequestPages]:
        """The request's page record (created on first use), None if not admitted."""
        first = self._first_owned.get(rid)
        if first is None:
            return None
        pages = self._pages.get(rid)
        if pages is None:
            pages = self._pages[rid] = RequestPages(row, first, page_size)
        return pages

    def peek(self, rid: str) -> Optional[RequestPages]:
        return self._pages.get(rid)

    def forget(self, rid: str) -> None:
        """The request left: free its host copies and its record."""
        self._first_owned.pop(rid, None)
        pages = self._pages.pop(rid, None)
        if pages is not None and self.pools is not None:
            pages.drop(self.pools)

    def take_counts(self) -> ReleaseCounts:
        counts, self.counts = self.counts, ReleaseCounts()
        return counts
