"""Where each page of a hot-set request lives, and the one owner that moves pages.

A long request admitted to release (its pages past the ones the radix tree holds for it
are its own: a long prefill kept out of the tree, or a request that grew past the threshold
while decoding) keeps its whole KV in SGLang's host pool and on the device only what its
hot set reads. Three id spaces, never mixed (``NewType``s below): a request's
``LogicalPage`` (its i-th page), a ``DevicePage`` of SGLang's KV pool (``slot //
page_size``; ``PADDING_PAGE`` 0 is SGLang's padding page, which every decode kernel here
masks) and a ``HostPage`` of HiCache's host pool (``NO_HOST_PAGE`` where there is none).

Each logical page of an admitted request is in exactly one ``PageState`` (docs/hot_set.md
has the table). ``Residency`` is the only code that moves a page (frees or allocates a
device or host page, copies, rewrites a ``req_to_token`` row): the scheduler's hooks call it
between steps (``scheduler/hot_set_release.py``), and the decoder only reads the records and
returns what it wants moved as data (``StepMoves``). A move not in ``TRANSITIONS`` raises.

A step's releases are one device→host copy for the whole batch and its promotions one
host→device copy, both on a side stream on CUDA (``PageCopies``; in line on the CPU); a
device page a release copied from is given back to the allocator only once that copy is done. Pages
shared with the tree (a matched prefix, a grown request's prompt) are the tree's; ``--hot-set-prefix host``
lends them to the request (``LENT*``, ``PrefixHold``). Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import NewType, Optional, Protocol

import torch

from sgl_importance.hot_set.page_copies import PageCopies
from sgl_importance.hot_set.prefix_hold import PrefixHold

logger = logging.getLogger(__name__)

LogicalPage = NewType("LogicalPage", int)  # a request's page: token positions [p * page_size, (p + 1) * page_size)
DevicePage = NewType("DevicePage", int)  # a page of SGLang's KV pool: slot // page_size
HostPage = NewType("HostPage", int)  # a page of HiCache's host pool: host slot // page_size
PADDING_PAGE = DevicePage(0)  # what a released page's row points at (masked by every decode kernel)
NO_HOST_PAGE = HostPage(-1)
RELEASED_SLOT = PADDING_PAGE  # the slot every position of a released page shows (page 0's first)


class PageState(enum.IntEnum):
    """Where one logical page of an admitted request lives (device page / host copy)."""

    TREE = 0  # the tree's device page, not lent: the row reads it; never moved by the request
    LENT = 1  # the tree's page lent to the request: the row still reads the tree's device page
    LENT_RELEASED = 2  # lent and left out: the row reads padding; the tree's host copy stands for it
    LENT_OWNED = 3  # lent, copied into a device page of the request's own; host copy the tree's
    RESIDENT = 4  # the request's own device page, no host copy
    COPIED = 5  # the request's own device page and a host copy of its own
    RELEASED = 6  # only the request's own host copy; its device page is freed


S = PageState
# move -> {from: to}. Any other (move, state) pair is a bug and raises.
TRANSITIONS: dict[str, dict[PageState, PageState]] = {
    "lend": {S.TREE: S.LENT},  # the prefix's host copies borrowed (--hot-set-prefix host)
    "copy_out": {S.RESIDENT: S.COPIED},  # a host copy of its own (a release's first step, a host insert)
    "release": {S.COPIED: S.RELEASED, S.LENT: S.LENT_RELEASED, S.LENT_OWNED: S.LENT_RELEASED},
    "promote": {S.RELEASED: S.COPIED, S.LENT_RELEASED: S.LENT_OWNED},
    "own": {S.LENT: S.LENT_OWNED},  # a lent page copied into the request's own device page
    "unlend": {S.LENT: S.TREE, S.LENT_RELEASED: S.TREE, S.LENT_OWNED: S.TREE},  # back to the tree's pages
    "give": {S.COPIED: S.LENT_OWNED, S.RELEASED: S.LENT_RELEASED},  # own host copies handed to the tree
}
ON_DEVICE = (S.TREE, S.LENT, S.LENT_OWNED, S.RESIDENT, S.COPIED)
OWN_DEVICE = (S.LENT_OWNED, S.RESIDENT, S.COPIED)  # device pages the request frees itself
OWN_HOST = (S.COPIED, S.RELEASED)  # host copies the request frees itself
OFF_DEVICE = (S.LENT_RELEASED, S.RELEASED)


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
    copies_out: int = 0  # device → host copy calls (one per step that releases, whatever the batch)
    copies_in: int = 0  # host → device copy calls (one per step that promotes)
    admitted_by_footprint: int = 0  # requests admitted charging their footprint (scheduler/admission.py)
    footprint_refused: int = 0  # hot-set requests admitted at full charge: host or range pool short
    release_waits: int = 0  # decode checks short of room that waited for in-flight release copies
    retracted_to_host: int = 0  # retracted requests whose full pages entered the tree host-only (loaded back)
    hot_sets_shrunk: int = 0  # hot sets the guard had grown, put back to their budget by a decode check short of room
    prefill_chunks_released: int = 0  # prefill chunks after which a streamed prompt's full pages left the device
    history_pages_on_host: int = 0  # pages of a returning turn's history read from the host pool, never loaded back


@dataclass
class RequestMoves:
    """What one request's next step wants moved (logical pages, ascending)."""

    rid: str
    release: torch.Tensor  # full pages the next plan leaves out: off the device
    promote: torch.Tensor  # pages the next plan reads that are off the device: back on it


@dataclass
class StepMoves:
    """What the decoder's step wants moved, for the residency owner to apply before the
    next step's allocation (the decoder itself moves nothing)."""

    requests: list[RequestMoves] = field(default_factory=list)


def page_offsets(pages: torch.Tensor, page_size: int) -> torch.Tensor:  # token positions, page after page
    return (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()


class RequestPages:
    """One admitted request's pages: a ``PageState`` and a host page each.

    Read by the decoder (``state``, ``off_device``, ``host_slots``); changed only through
    ``Residency`` (every method that moves a page takes the pools).

    Args:
        row: the request's ``req_to_token`` row (a view: writes reach SGLang's table).
        first_owned_page: pages before it are the tree's (``TREE``); from it on, its own.
        page_size: tokens per page.
        owner: the request's id, which its host slots are recorded under.
    """

    def __init__(self, row: torch.Tensor, first_owned_page: int, page_size: int, owner: str = "") -> None:
        self.row = row
        self.owner = owner
        self.first_owned_page = first_owned_page
        self.page_size = page_size
        self.state = torch.zeros(0, dtype=torch.uint8)
        self.host_page = torch.zeros(0, dtype=torch.int64)
        self.lent_pages = 0  # pages [0, lent_pages) were lent by the tree (lend_prefix)
        self.hold: Optional[PrefixHold] = None  # the lend and its tree locks (set by the scheduler)

    # -- reading --------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.state.numel()

    def _grow(self, num_pages: int) -> None:
        extra = num_pages - self.num_pages
        if extra <= 0:
            return
        new = torch.arange(self.num_pages, num_pages)
        fresh = torch.where(new < self.first_owned_page, int(S.TREE), int(S.RESIDENT)).to(torch.uint8)
        self.state = torch.cat((self.state, fresh))
        self.host_page = torch.cat((self.host_page, torch.full((extra,), NO_HOST_PAGE, dtype=torch.int64)))

    def states(self, pages: torch.Tensor) -> torch.Tensor:
        """The ``PageState`` of each of ``pages`` (uint8; pages past the record are fresh ones)."""
        self._grow(int(pages.max()) + 1 if pages.numel() else 0)
        return self.state[pages]

    def off_device(self, pages: torch.Tensor) -> torch.Tensor:
        """Which of ``pages`` have no device page (bool, same order): read from their host copy."""
        if pages.numel() == 0 or self.num_pages == 0:
            return torch.zeros(pages.numel(), dtype=torch.bool)
        inside = pages < self.num_pages
        off = torch.zeros(pages.numel(), dtype=torch.bool)
        st = self.state[pages[inside]]
        off[inside] = (st == S.RELEASED) | (st == S.LENT_RELEASED)
        return off

    def own_host(self) -> torch.Tensor:
        """Which logical pages have a host copy of the request's own (bool per page)."""
        return (self.state == S.COPIED) | (self.state == S.RELEASED)

    def released_pages(self) -> torch.Tensor:
        """Logical pages with no device page, ascending."""
        return torch.nonzero((self.state == S.RELEASED) | (self.state == S.LENT_RELEASED)).flatten()

    def host_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Host slots of ``pages`` (each with a host copy), page after page."""
        hosts = self.host_page[pages]
        if bool((hosts == NO_HOST_PAGE).any()):
            raise RuntimeError(f"request {self.owner}: pages {pages[hosts == NO_HOST_PAGE].tolist()} have no host copy")
        return page_offsets(hosts, self.page_size)

    def _device_slots(self, pages: torch.Tensor) -> torch.Tensor:
        return self.row[page_offsets(pages, self.page_size).to(self.row.device)].to(torch.int64)

    def _move(self, move: str, pages: torch.Tensor) -> None:
        table = TRANSITIONS[move]
        self._grow(int(pages.max()) + 1 if pages.numel() else 0)
        now = self.state[pages]
        to = torch.full_like(now, 255)
        for src, dst in table.items():
            to[now == src] = int(dst)
        bad = to == 255
        if bool(bad.any()):
            names = sorted({PageState(int(s)).name for s in now[bad]})
            raise RuntimeError(
                f"request {self.owner}: no move {move!r} from {', '.join(names)} "
                f"(pages {pages[bad][:8].tolist()}; allowed from {', '.join(s.name for s in table)})"
            )
        self.state[pages] = to

    def _set_host(self, pages: torch.Tensor, slots: torch.Tensor) -> None:
        self.host_page[pages] = slots.view(-1, self.page_size)[:, 0].to(torch.int64) // self.page_size

    def _point(self, pages: torch.Tensor, slots: torch.Tensor) -> None:
        self.row[page_offsets(pages, self.page_size).to(self.row.device)] = slots.to(self.row.device, self.row.dtype)


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
    """The records of the requests admitted to release in this process, and every page move.

    The runtime owns one; the scheduler's hooks (``scheduler/hot_set_release.py``) call its
    moves between steps, the decoder reads records and files ``StepMoves``.
    """

    def __init__(self) -> None:
        self.pools: Optional[PagePools] = None
        self.copies = PageCopies()
        self.threshold: Optional[int] = None  # tokens past which a request may release; None: off
        self.prefix_on_host = False  # a matched prefix may be lent to the request (--hot-set-prefix host)
        self.host_insert = False  # a finished request may enter the tree host-only (SGLang's Python tree core)
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

    def enable(self, pools: PagePools, threshold: int, copies: Optional[PageCopies] = None) -> None:
        self.pools, self.threshold = pools, threshold
        if copies is not None:
            self.copies = copies

    # -- records ----------------------------------------------------------------------

    def admit(self, rid: str, row: torch.Tensor, first_owned_page: int, page_size: int) -> RequestPages:
        """``rid``'s pages from ``first_owned_page`` on are its own (out of the tree) and may
        be released; a second admission before it leaves keeps the first record."""
        pages = self._pages.get(rid)
        if pages is None:
            pages = self._pages[rid] = RequestPages(row, first_owned_page, page_size, owner=rid)
        return pages

    def host_pages_held(self) -> int:
        """Host pages the admitted requests hold as their own copies."""
        return sum(int(p.own_host().sum()) for p in self._pages.values())

    def admitted(self, rid: str) -> bool:
        return rid in self._pages

    def peek(self, rid: str) -> Optional[RequestPages]:
        return self._pages.get(rid)

    def forget(self, rid: str) -> None:
        """The request left: free its own host copies and its record."""
        pages = self._pages.pop(rid, None)
        if pages is None or self.pools is None:
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

    def take_counts(self) -> ReleaseCounts:
        counts, self.counts = self.counts, ReleaseCounts()
        return counts

    # -- a step's moves -------------------------------------------------------------------

    def apply(self, moves: Optional[StepMoves]) -> None:
        """Make the ``StepMoves`` a step ended with (between steps, before the next allocation):
        every release as one device→host copy, then every promotion as one host→device copy."""
        self.copies.collect()
        if moves is None or not self.enabled:
            return
        records = [(self._pages.get(m.rid), m) for m in moves.requests]
        records = [(pages, m) for pages, m in records if pages is not None]
        self.release([(pages, m.release) for pages, m in records])
        self.promote([(pages, m.promote) for pages, m in records])

    def release(self, wanted: list[tuple[RequestPages, torch.Tensor]]) -> None:
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

    def promote(self, wanted: list[tuple[RequestPages, torch.Tensor]], *, note_refusal: bool = True) -> None:
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
                if note_refusal:
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
        own = logical[(st == S.COPIED) | (st == S.RELEASED)]
        if own.numel():
            self.pools.give_host(pages.host_slots(own), pages.owner)
            pages._move("give", own)
