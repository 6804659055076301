"""One long request's pages: where each lives, the moves allowed between states, and what
anyone wants moved (``PageMoves``).

Three id spaces, never mixed (``NewType``s below): a request's ``LogicalPage`` (its i-th
page), a ``DevicePage`` of SGLang's KV pool (``slot // page_size``; ``PADDING_PAGE`` 0 is
SGLang's padding page, which every decode kernel here masks) and a ``HostPage`` of HiCache's
host pool (``NO_HOST_PAGE`` where there is none). Each logical page of an admitted request is
in exactly one ``PageState`` (docs/hot_set.md has the table); a move not in ``TRANSITIONS``
raises. ``RequestPages`` is read by anyone and changed only by ``residency.Residency``, the
one owner of page moves. Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType, Optional

import torch

from sgl_importance.hot_set.pages.prefix_hold import PrefixHold

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
OWN_HOST = (S.COPIED, S.RELEASED)  # host copies the request frees itself
OFF_DEVICE = (S.LENT_RELEASED, S.RELEASED)  # no device page: read from a host copy


def in_states(states: torch.Tensor, group: tuple[PageState, ...]) -> torch.Tensor:
    """Which of ``states`` (uint8 ``PageState`` values) are in ``group`` (bool, same shape)."""
    found = states == group[0]
    for state in group[1:]:
        found |= states == state
    return found


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


class MoveReason(enum.Enum):
    """Who asks for pages to move: every source's moves are one type, counted by the owner."""

    STEP = "step"  # a decode step's plan for a later step (``HotSetDecoder.end_step``)
    PREFILL = "prefill"  # a streamed prompt's chunk leaves the device (``scheduler/streamed_prefill.py``)
    SHRINK = "shrink"  # a hot set the guard grew goes back to its budget (``scheduler/decode_room.py``)
    FINISH = "finish"  # a leaving request's released pages come back for its tree insert


def _no_pages() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


@dataclass
class RequestMoves:
    """What one request wants moved (logical pages, ascending)."""

    rid: str
    release: torch.Tensor = field(default_factory=_no_pages)  # full pages to take off the device
    promote: torch.Tensor = field(default_factory=_no_pages)  # off-device pages to bring back on it


@dataclass
class PageMoves:
    """Pages to move, for the residency owner to apply between forwards (``Residency.apply``):
    a decode step's, a streamed prefill chunk's, a shrink's, a leaving request's. No one but
    the owner moves a page; the others say what they want as one of these."""

    requests: list[RequestMoves] = field(default_factory=list)
    reason: MoveReason = MoveReason.STEP


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

    def __init__(self, row: torch.Tensor, first_owned_page: LogicalPage, page_size: int, owner: str = "") -> None:
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
        off[inside] = in_states(st, OFF_DEVICE)
        return off

    def own_host(self) -> torch.Tensor:
        """Which logical pages have a host copy of the request's own (bool per page)."""
        return in_states(self.state, OWN_HOST)

    def released_pages(self) -> torch.Tensor:
        """Logical pages with no device page, ascending."""
        return torch.nonzero(in_states(self.state, OFF_DEVICE)).flatten()

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
