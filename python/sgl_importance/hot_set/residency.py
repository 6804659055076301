"""The records of the long requests in this process, and the one owner that moves pages.

A long request admitted to release (its pages past the ones the radix tree holds for it
are its own: a long prefill kept out of the tree, or a request that grew past the threshold
while decoding) keeps its whole KV in SGLang's host pool and on the device only what its
hot set reads. Everything the hot set knows about such a request is one ``LongRequest``
(``record.py``) in ``Residency.records``: its pages (``pages/state.py``: a ``PageState`` per
logical page), what the selection tracks, its prefill seed, its history loan.

``Residency`` is the only code that moves a page (frees or allocates a device or host page,
copies, rewrites a ``req_to_token`` row): the scheduler's hooks call it between steps
(``scheduler/hot_set_release.py``). Whoever wants pages released or promoted (a decode
step's plan, a streamed prefill's chunk, a shrink, a leaving request) hands the owner a
``PageMoves`` naming its reason (``apply``): the decoder only reads the records.

A step's releases are one device→host copy for the whole batch and its promotions one
host→device copy, both on a side stream on CUDA (``PageCopies``; in line on the CPU); a
device page a release copied from is given back to the allocator only once that copy is done. Pages
shared with the tree (a matched prefix, a grown request's prompt) are the tree's; ``--hot-set-prefix host``
lends them to the request (``LENT*``, ``PrefixHold``). Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

import logging
from typing import Container, Optional, Protocol

import torch

from sgl_importance.hot_set.pages.copies import PageCopies
from sgl_importance.hot_set.pages.state import (
    NO_HOST_PAGE,
    OWN_HOST,
    RELEASED_SLOT,
    LogicalPage,
    MoveReason,
    PageMoves,
    ReleaseCounts,
    RequestPages,
    S,
    in_states,
)
from sgl_importance.hot_set.plan.request_state import TrackedRequest
from sgl_importance.hot_set.record import LongRequest

logger = logging.getLogger(__name__)


class PagePools(Protocol):
    """The device and host page pools (SGLang's allocator and HiCache's host pool): what
    moving a page needs of them. Slots are token slots, whole pages."""

    page_size: int

    def alloc_device(self, num_pages: int) -> Optional[torch.Tensor]: ...  # None when full

    def free_device(self, slots: torch.Tensor) -> None: ...

    def alloc_host(self, num_pages: int, owner: str) -> Optional[torch.Tensor]: ...  # for request owner; None: full

    def free_host(self, slots: torch.Tensor, owner: str) -> None: ...  # slots request ``owner`` allocated

    def give_host(self, slots: torch.Tensor, owner: str) -> None: ...  # now the radix tree's (a host insert)

    def borrow_host(self, slots: torch.Tensor, owner: str) -> None: ...  # the tree's, read until unborrow_host

    def unborrow_host(self, owner: str) -> None: ...

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy every layer's K and V of the slots device → host."""

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy every layer's K and V of the slots host → device."""

    def host_layer(self, layer_id: int, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V rows ``[n, kv_heads, D]`` of host slots (a copy)."""

    def host_pages(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """One layer's whole host K and V as ``[host_pages, page_size, kv_heads, D]`` views
        (no copy; tokens and pages at any stride, a token's heads side by side), or None
        where the host pool has none."""


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


class Residency:
    """The records of the long requests in this process, and every page move.

    The runtime owns one; the scheduler's hooks (``scheduler/hot_set_release.py``) call its
    moves between steps, the decoder reads and fills the records' selection parts; every
    release and promotion arrives as ``PageMoves`` (``apply``).
    """

    def __init__(self) -> None:
        self.pools: Optional[PagePools] = None
        self.copies = PageCopies()
        self.threshold: Optional[int] = None  # tokens past which a request may release; None: off
        self.prefix_on_host = False  # a matched prefix may be lent to the request (--hot-set-prefix host)
        self.host_insert = False  # a finished request may enter the tree host-only (SGLang's Python tree core)
        self.records: dict[str, LongRequest] = {}
        self.counts = ReleaseCounts()
        # Set when a step gave device pages back: the scheduler may admit again.
        self.reopen = False

    @property
    def enabled(self) -> bool:
        return self.pools is not None and self.threshold is not None

    def enable(self, pools: PagePools, threshold: int, copies: Optional[PageCopies] = None) -> None:
        self.pools, self.threshold = pools, threshold
        if copies is not None:
            self.copies = copies

    # -- records ----------------------------------------------------------------------

    def record(self, rid: str) -> Optional[LongRequest]:
        """Everything the hot set holds of ``rid``, or None."""
        return self.records.get(rid)

    def open(self, rid: str) -> LongRequest:
        """``rid``'s record, made empty if it has none."""
        record = self.records.get(rid)
        if record is None:
            record = self.records[rid] = LongRequest(rid)
        return record

    def close_if_empty(self, rid: str) -> None:
        """Drop ``rid``'s record once its last part has gone."""
        record = self.records.get(rid)
        if record is not None and record.empty:
            del self.records[rid]

    def tracked(self) -> dict[str, TrackedRequest]:
        """The selection part of each tracked request's record, by request id (a new dict)."""
        return {rid: r.tracked for rid, r in self.records.items() if r.tracked is not None}

    def absent(self, rids: Container[str]) -> list[str]:
        """Records whose selection (and seed) ends, their request in no decode batch: left,
        or never admitted. An admitted prompt still streaming (``prefilling``) keeps its
        selection, and an admitted request its seed, until its first decode step."""
        ended = []
        for rid, r in self.records.items():
            if rid in rids or (r.tracked is None and r.seed is None):
                continue
            if r.pages is None or (r.tracked is not None and not r.prefilling):
                ended.append(rid)
        return ended

    def admit(self, rid: str, row: torch.Tensor, first_owned_page: LogicalPage, page_size: int) -> RequestPages:
        """``rid``'s pages from ``first_owned_page`` on are its own (out of the tree) and may
        be released; a second admission before it leaves keeps the first pages."""
        record = self.open(rid)
        if record.pages is None:
            record.pages = RequestPages(row, first_owned_page, page_size, owner=rid)
        return record.pages

    def host_pages_held(self) -> int:
        """Host pages the admitted requests hold as their own copies."""
        return sum(int(r.pages.own_host().sum()) for r in self.records.values() if r.pages is not None)

    def leaving(self, row: int) -> Optional[RequestPages]:
        """The pages of the request whose ``req_to_token`` row ``row`` is being freed now
        (SGLang's ``free_kv_row`` runs inside ``release_kv_cache`` and sees only the row)."""
        for record in self.records.values():
            if record.leaving_row == row:
                return record.pages
        return None

    def admitted(self, rid: str) -> bool:
        return self.peek(rid) is not None

    def peek(self, rid: str) -> Optional[RequestPages]:
        record = self.records.get(rid)
        return None if record is None else record.pages

    def forget(self, rid: str) -> None:
        """The request left: free its own host copies and end its pages (its selection
        part ends with the decoder's ``forget_request``, which frees its rows)."""
        record = self.records.get(rid)
        pages = None if record is None else record.pages
        if pages is None:
            return
        record.pages = None
        self.close_if_empty(rid)
        if self.pools is None:
            return
        own = pages.own_host()
        if bool(own.any()):
            self.copies.host_ready()  # a release copy into them may still be running
            self.pools.free_host(pages.host_slots(torch.nonzero(own).flatten()), pages.owner)
        if pages.lent_pages:
            self.pools.unborrow_host(pages.owner)

    def read_host(self, layer_id: int, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V ``[n, kv_heads, D]`` of host copies (a read, no move: the
        decoder's for a planned page the owner found no device page for)."""
        self.copies.host_ready()
        return self.pools.host_layer(layer_id, host_slots)

    def host_pages(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """One layer's host pool as pages (``PagePools.host_pages``; None: no view, or no
        pools), its copies in flight landed first: a kernel reads released pages there."""
        if self.pools is None:
            return None
        self.copies.host_ready()
        return self.pools.host_pages(layer_id)

    def take_counts(self) -> ReleaseCounts:
        counts, self.counts = self.counts, ReleaseCounts()
        return counts

    # -- a step's moves -------------------------------------------------------------------

    def apply(self, moves: Optional[PageMoves]) -> None:
        """Make ``moves`` (between forwards; a step's before the next allocation): every
        release as one device→host copy, then every promotion as one host→device copy. A
        request that left since they were asked for is skipped; counted by their reason."""
        self.copies.collect()
        if moves is None or not self.enabled:
            return
        records = [(self.peek(m.rid), m) for m in moves.requests]
        records = [(pages, m) for pages, m in records if pages is not None]
        self._release([(pages, m.release) for pages, m in records])
        self._promote([(pages, m.promote) for pages, m in records])
        if moves.reason == MoveReason.PREFILL:
            self.counts.prefill_chunks_released += len(records)
        elif moves.reason == MoveReason.SHRINK:
            self.counts.hot_sets_shrunk += len(records)

    def _release(self, wanted: list[tuple[RequestPages, torch.Tensor]]) -> None:
        """Give back the device pages of each request's ``pages`` (full pages on the device):
        pages without a host copy are copied out first, all in one copy; a request whose
        host pages cannot be had keeps those on the device (``releases_refused``)."""
        pools = self.pools
        copy_dev, copy_host, frees, done = [], [], [], []
        for pages, logical in wanted:
            if logical.numel() == 0:
                continue
            st = pages.states(logical)
            logical = logical[(st == S.RESIDENT) | (st == S.COPIED) | (st == S.LENT) | (st == S.LENT_OWNED)]
            if logical.numel() == 0:
                continue
            st = pages.state[logical]
            uncopied = logical[st == S.RESIDENT]
            if uncopied.numel():
                host = pools.alloc_host(uncopied.numel(), pages.owner)
                if host is None:
                    self.counts.releases_refused += logical.numel()
                    continue
                copy_dev.append(pages._device_slots(uncopied))
                copy_host.append(host.to(torch.int64))
                pages._set_host(uncopied, host)
                pages._move("copy_out", uncopied)
                self.counts.pages_copied_out += uncopied.numel()
            st = pages.state[logical]
            own = logical[(st == S.COPIED) | (st == S.LENT_OWNED)]
            if own.numel():
                frees.append(pages._device_slots(own))
                self.counts.pages_released += own.numel()
            self.counts.prefix_pages_released += int((st == S.LENT).sum())
            done.append((pages, logical))
        if copy_dev:
            device, host = torch.cat(copy_dev), torch.cat(copy_host)
            self.copies.run(lambda: pools.to_host(device, host), device, host)
            self.counts.copies_out += 1
        for pages, logical in done:
            pages._point(logical, torch.full((logical.numel() * pages.page_size,), RELEASED_SLOT))
            pages._move("release", logical)
        if frees:
            slots = torch.cat(frees)
            self.copies.defer_free(lambda: pools.free_device(slots))
            self.reopen = True

    def _promote(self, wanted: list[tuple[RequestPages, torch.Tensor]]) -> None:
        """Bring each request's off-device ``pages`` back into fresh device pages, all in one
        copy; a request that finds no device room leaves them on the host (counted)."""
        pools = self.pools
        host_all, device_all = [], []
        for pages, logical in wanted:
            if logical.numel() == 0:
                continue
            logical = logical[pages.off_device(logical)]
            if logical.numel() == 0:
                continue
            slots = pools.alloc_device(logical.numel())
            if slots is None:
                self.counts.promotions_refused += logical.numel()
                continue
            slots = slots.to(torch.int64)
            host_all.append(pages.host_slots(logical))
            device_all.append(slots)
            pages._point(logical, slots)
            pages._move("promote", logical)
            self.counts.pages_copied_in += logical.numel()
        if device_all:
            host, device = torch.cat(host_all), torch.cat(device_all)
            self.copies.run(lambda: pools.to_device(host, device), host, device)
            self.counts.copies_in += 1

    # -- a matched prefix held on the host (--hot-set-prefix host) ---------------------------

    def lend_prefix(self, pages: RequestPages, host_slots: torch.Tensor, on_device: Optional[int] = None) -> None:
        """Take the tree's pages ``[0, n)`` as the request's own, ``host_slots`` (their host
        copies, ``n`` pages of slots, the tree's) standing for them once released. The row
        keeps the tree's device slots until a page is released or owned; pages from
        ``on_device`` on (a history matched in the host pool, never loaded back) are released
        from the start, their row positions the released slot. The caller keeps the tree
        from freeing the slots (a host lock) until ``forget``."""
        num = host_slots.numel() // pages.page_size
        pages._grow(num)
        lent = torch.arange(num)
        self.pools.borrow_host(host_slots, pages.owner)
        pages._move("lend", lent)
        pages._set_host(lent, host_slots)
        if on_device is not None and on_device < num:
            pages._move("release", lent[on_device:])
            self.counts.history_pages_on_host += num - on_device
        pages.lent_pages, pages.first_owned_page = num, 0
        self.counts.prefix_pages_lent += num

    def own_tree_pages(self, pages: RequestPages) -> bool:
        """Copy the lent pages the row still reads from the tree's device pages into device
        pages of the request's own (from the tree's host copies, which hold the same KV).
        Returns whether the row now reads no tree page (False: no room)."""
        logical = torch.nonzero(pages.state == S.LENT).flatten()
        if logical.numel() == 0:
            return True
        slots = self.pools.alloc_device(logical.numel())
        if slots is None:
            return False
        slots = slots.to(torch.int64)
        host = pages.host_slots(logical)
        self.copies.run(lambda: self.pools.to_device(host, slots), host, slots)
        self.counts.copies_in += 1
        pages._point(logical, slots)
        pages._move("own", logical)
        self.counts.prefix_pages_owned += logical.numel()
        return True

    def return_prefix(self, pages: RequestPages, tree_slots: torch.Tensor) -> None:
        """Point the lent pages back at the tree's device slots ``tree_slots`` (fewer where it holds
        the rest host-only) and free the request's own copies of them: the prefix is the tree's again."""
        lent = torch.arange(pages.lent_pages)
        owned = lent[pages.state[lent] == S.LENT_OWNED]
        if owned.numel():
            self.pools.free_device(pages._device_slots(owned))
        pages.row[: tree_slots.numel()] = tree_slots.to(pages.row.dtype)
        pages._move("unlend", lent)
        pages.host_page[lent] = NO_HOST_PAGE  # the tree's copies: no longer the request's to read

    # -- a finished request entering the tree host-only ---------------------------------------

    def host_page_slots(self, pages: RequestPages, logical: torch.Tensor) -> Optional[torch.Tensor]:
        """Host slots ``[n, page_size]`` holding ``logical`` (full pages), copying the
        resident ones without a host copy out first; None when the host pool is full."""
        st = pages.states(logical)
        uncopied = logical[st == S.RESIDENT]
        if uncopied.numel():
            host = self.pools.alloc_host(uncopied.numel(), pages.owner)
            if host is None:
                return None
            host = host.to(torch.int64)
            device = pages._device_slots(uncopied)
            self.copies.run(lambda: self.pools.to_host(device, host), device, host)
            self.counts.copies_out += 1
            pages._set_host(uncopied, host)
            pages._move("copy_out", uncopied)
        self.copies.host_ready()  # the tree may write them to storage at once
        return pages.host_slots(logical).view(-1, pages.page_size)

    def give_host_copies(self, pages: RequestPages, logical: torch.Tensor) -> None:
        """The host copies of ``logical`` now belong to the tree (never freed here)."""
        st = pages.states(logical)
        own = logical[in_states(st, OWN_HOST)]
        if own.numel():
            self.pools.give_host(pages.host_slots(own), pages.owner)
            pages._move("give", own)
