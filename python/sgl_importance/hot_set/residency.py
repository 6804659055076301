"""Device pages a hot-set request gives back, and the host copies that replace them.

A long request admitted to release (its pages past the ones the radix tree holds
for it are its own: a long prefill kept out of the tree, or a request that grew
past the threshold while decoding) releases the device pages its hot set no longer
plans: the page is copied to SGLang's host pool the first time it leaves (a full
page never changes again, so one copy serves every later promotion), its device
page goes back to the allocator and its ``req_to_token`` entries point at the
padding page 0, which every decode kernel here masks. A promotion allocates a
device page, copies the host page in and rewrites the row. The page being written
stays on the device.

Pages shared with the tree (a returning request's matched prefix, a grown request's
prompt) are the tree's, on the device and (HiCache's
write-through) on the host: ``lend_prefix`` lets the request treat those pages as its
own, with the tree's host copies as theirs. A lent page the plan leaves out stops
being read from the device (its row points at the padding page, nothing is freed: the
device page is the tree's); a lent page the plan keeps is copied into a device page of
the request's own (``own_tree_pages``), after which the request holds no tree page on
the device and the scheduler lets the tree evict them (``scheduler/hot_set_release.py``).
The tree's host copies are never freed here.

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

    def alloc_host(self, num_pages: int, owner: str) -> Optional[torch.Tensor]:
        """Token slots of ``num_pages`` host pages for request ``owner``, or None when full."""

    def free_host(self, slots: torch.Tensor, owner: str) -> None:
        """Free host slots request ``owner`` allocated."""

    def give_host(self, slots: torch.Tensor, owner: str) -> None:
        """Request ``owner``'s host slots now belong to the radix tree (a host insert)."""

    def borrow_host(self, slots: torch.Tensor, owner: str) -> None:
        """Request ``owner`` reads the tree's host slots (its matched prefix) until ``unborrow_host``."""

    def unborrow_host(self, owner: str) -> None: ...

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
    promotions_refused: int = 0  # pages no device page could take (none free or evictable): left on the host
    releases_refused: int = 0  # releases with no free host page (page kept)
    finished_reinserted: int = 0  # finished requests whose pages all came back (tree insert)
    finished_uncached: int = 0  # finished requests left out of the tree (no device room, no host insert)
    finished_on_host: int = 0  # finished requests whose pages entered the tree host-only (no device room)
    prefix_pages_lent: int = 0  # matched-prefix pages a running request took over from the tree's host copies
    prefix_pages_released: int = 0  # ... that it then stopped reading from the device
    prefix_pages_owned: int = 0  # ... planned ones copied into its own device pages, so the tree's could go
    prefix_holds: int = 0  # requests whose matched prefix no longer pins the tree's device pages
    prefix_relocked: int = 0  # ... finished with the tree's pages still on the device: taken back, nothing copied


class RequestPages:
    """Device residency of one request's logical pages, and their host copies.

    Args:
        row: the request's ``req_to_token`` row (a view: writes reach SGLang's table).
        first_owned_page: pages before it belong to the radix tree; never released.
        page_size: tokens per page.
        owner: the request's id, which its host slots are recorded under.
    """

    def __init__(self, row: torch.Tensor, first_owned_page: int, page_size: int, owner: str = "") -> None:
        self.row = row
        self.owner = owner
        self.first_owned_page = first_owned_page
        self.page_size = page_size
        self.host = torch.full((0, page_size), -1, dtype=torch.int64)
        self.released = torch.zeros(0, dtype=torch.bool)
        self.borrowed = torch.zeros(0, dtype=torch.bool)  # host copy is the tree's: never freed here
        self.tree_slot = torch.zeros(0, dtype=torch.bool)  # the row's device page is the tree's
        self.lent_pages = 0  # pages [0, lent_pages) were lent by the tree (lend_prefix)
        self.hold: object = None  # the scheduler's record of the lend (its tree locks)

    def _grow(self, num_pages: int) -> None:
        extra = num_pages - self.released.numel()
        if extra > 0:
            self.host = torch.cat((self.host, torch.full((extra, self.page_size), -1, dtype=torch.int64)))
            no = torch.zeros(extra, dtype=torch.bool)
            self.released = torch.cat((self.released, no))
            self.borrowed = torch.cat((self.borrowed, no))
            self.tree_slot = torch.cat((self.tree_slot, no))

    def _positions(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)[None, :]).flatten()

    def _copy_out(self, pages: torch.Tensor, pools: PagePools) -> Optional[int]:
        """Give the resident ``pages`` without a host copy one (a full page never changes
        again, so one copy serves for good). Returns how many were copied, None when the
        host pool is full (nothing copied)."""
        uncopied = pages[self.host[pages, 0] < 0]
        if uncopied.numel():
            host = pools.alloc_host(uncopied.numel(), self.owner)
            if host is None:
                return None
            host = host.view(-1, self.page_size).to(torch.int64)
            pools.to_host(self.row[self._positions(uncopied)].to(torch.int64), host.flatten())
            self.host[uncopied] = host
        return uncopied.numel()

    def release(self, pages: torch.Tensor, pools: PagePools, counts: ReleaseCounts) -> None:
        """Give back the device pages of ``pages`` (full, owned, resident logical pages)."""
        self._grow(int(pages.max()) + 1 if pages.numel() else 0)
        pages = pages[(pages >= self.first_owned_page) & ~self.released[pages]]
        if pages.numel() == 0:
            return
        copied = self._copy_out(pages, pools)
        if copied is None:
            counts.releases_refused += pages.numel()
            return
        counts.pages_copied_out += copied
        tree = self.tree_slot[pages]
        own = pages[~tree]
        if own.numel():
            pools.free_device(self.row[self._positions(own)].to(torch.int64))
            counts.pages_released += own.numel()
        counts.prefix_pages_released += int(tree.sum())
        self.row[self._positions(pages)] = RELEASED_SLOT
        self.released[pages] = True
        self.tree_slot[pages] = False

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

    def lend_prefix(self, host_slots: torch.Tensor, pools: PagePools, counts: ReleaseCounts) -> None:
        """Take the tree's pages ``[0, n)`` as the request's own, ``host_slots`` (their
        host copies, ``n`` pages of slots, the tree's) standing for them once released.
        The row keeps the tree's device slots until a page is released or owned. The
        caller keeps the tree from freeing the slots (a host lock) until ``drop``."""
        num = host_slots.numel() // self.page_size
        pools.borrow_host(host_slots, self.owner)
        self._grow(num)
        self.host[:num] = host_slots.view(num, self.page_size).to(torch.int64)
        self.borrowed[:num] = True
        self.tree_slot[:num] = ~self.released[:num]
        self.lent_pages = num
        self.first_owned_page = 0
        counts.prefix_pages_lent += num

    def own_tree_pages(self, pools: PagePools, counts: ReleaseCounts) -> bool:
        """Copy the lent pages the row still reads from the tree's device pages into
        device pages of the request's own (from the tree's host copies, which hold the
        same KV). Returns whether the row now reads no tree page (False: no room)."""
        pages = torch.nonzero(self.tree_slot).flatten()
        if pages.numel() == 0:
            return True
        slots = pools.alloc_device(pages.numel())
        if slots is None:
            return False
        slots = slots.to(torch.int64)
        pools.to_device(self.host[pages].flatten(), slots)
        self.row[self._positions(pages)] = slots.to(self.row.dtype)
        self.tree_slot[pages] = False
        counts.prefix_pages_owned += pages.numel()
        return True

    def return_prefix(self, tree_slots: torch.Tensor, pools: PagePools) -> None:
        """Point the lent pages back at the tree's device slots ``tree_slots`` (the
        prefix's, in order) and free the request's own copies of them: the prefix is
        the tree's again, as if it had never been lent."""
        num = self.lent_pages
        self._grow(num)
        lent = torch.arange(num)
        private = lent[~self.released[:num] & ~self.tree_slot[:num]]
        if private.numel():
            pools.free_device(self.row[self._positions(private)].to(torch.int64))
        self.row[: num * self.page_size] = tree_slots.to(self.row.dtype)
        self.released[:num] = False
        self.tree_slot[:num] = True

    def host_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Host slots of released ``pages``, page by page."""
        return self.host[pages].flatten()

    def host_page_slots(self, pages: torch.Tensor, pools: PagePools) -> Optional[torch.Tensor]:
        """Host slots ``[n, page_size]`` holding ``pages`` (full pages), copying the
        resident ones without a host copy out first; None when the host pool is full."""
        self._grow(int(pages.max()) + 1 if pages.numel() else 0)
        if self._copy_out(pages, pools) is None:
            return None
        return self.host[pages]

    def give_host_copies(self, pages: torch.Tensor, pools: PagePools) -> None:
        """The host copies of ``pages`` now belong to the tree (never freed here)."""
        own = pages[~self.borrowed[pages]]
        if own.numel():
            pools.give_host(self.host[own].flatten(), self.owner)
        self.borrowed[pages] = True

    def drop(self, pools: PagePools) -> None:
        """Free the host copies (the request is leaving)."""
        copied = (self.host[:, 0] >= 0) & ~self.borrowed
        if bool(copied.any()):
            pools.free_host(self.host[copied].flatten(), self.owner)
        if self.lent_pages:
            pools.unborrow_host(self.owner)
        self.host = self.host[:0]
        self.released = self.released[:0]
        self.borrowed = self.borrowed[:0]
        self.tree_slot = self.tree_slot[:0]


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
        self.prefix_on_host = False  # a matched prefix may be lent to the request (--hot-set-prefix host)
        self.host_insert = False  # a finished request may enter the tree host-only (SGLang's Python tree core)
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
            pages = self._pages[rid] = RequestPages(row, first, page_size, owner=rid)
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
