"""Rows of the hot set's per-page state, paid from the KV pool's own pages as they are used.

A tracked request keeps, per full page, a key range (``key_ranges.py``) and, guarded, its
key codes (``key_codes.py``). Those rows live in KV pages *borrowed* from SGLang's allocator:
a borrowed page's per-layer K and V slots hold the rows of several of the request's pages
(a page's range is one token slot; its codes a sixteenth of a page of K and V bytes).
Nothing is set aside at start-up: with no long request running dense has the whole pool,
and SGLang's free count, its admission, retraction and ``/metrics`` see a borrowed page as
a page in use.

Pages come from a ``PageSource``. In the server it is ``BorrowedPages``: a stock that the
residency owner fills from the allocator between steps, before a batch whose requests will
need rows (``scheduler/hot_set_rows.py``), and gives back after it; inside a forward a
store only takes from the stock and returns to it, so the decoder never calls the
allocator. A store whose source has no page left refuses (the request stays resident,
counted; ``coding.py``). ``LocalPages`` is a fixed set of pages (offline benchmarks and
tests, with private buffers).

Three id spaces meet here: ``DevicePage`` (a page of SGLang's KV pool, what is borrowed),
a row id of one store (what a request keeps per logical page), and the row's place in the
KV buffers (the store's own layout: ``KeyRanges``, ``GuardPool``).

Plain Python and torch; nothing here imports SGLang.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional, Protocol

import torch

from sgl_importance.hot_set.pages.state import page_offsets


class PageSource(Protocol):
    """Where a row store's pages come from, and go back to."""

    def take(self, num_pages: int) -> Optional[list[int]]:
        """``num_pages`` device page ids (never the padding page 0), or None: none taken."""

    def give_back(self, pages: list[int]) -> None: ...

    def available(self) -> int:
        """Pages ``take`` would hand out now."""


class LocalPages:
    """A fixed set of pages ``[first, first + count)`` (a store over private buffers)."""

    def __init__(self, first: int, count: int) -> None:
        self._free = list(range(first + count - 1, first - 1, -1))

    def take(self, num_pages: int) -> Optional[list[int]]:
        if num_pages > len(self._free):
            return None
        return [self._free.pop() for _ in range(num_pages)]

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def available(self) -> int:
        return len(self._free)


class BorrowedPages:
    """Pages borrowed from SGLang's allocator: a stock handed to the row stores.

    ``settle`` (between steps only) borrows or returns pages so that the stock holds what
    the next batch may ask for; ``take`` and ``give_back`` (anywhere, a forward included)
    only move pages between the stock and the stores.

    Args:
        page_size: tokens per page (the allocator hands out token slots, whole pages).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.stock: list[int] = []
        self.in_stores = 0  # pages the stores hold (rows of running requests)
        self.refused = 0  # takes the stock could not meet

    @property
    def borrowed(self) -> int:
        """Pages held from the allocator: the stock and the stores'."""
        return len(self.stock) + self.in_stores

    def take(self, num_pages: int) -> Optional[list[int]]:
        if num_pages > len(self.stock):
            self.refused += 1
            return None
        pages = self.stock[len(self.stock) - num_pages :]
        del self.stock[len(self.stock) - num_pages :]
        self.in_stores += num_pages
        return pages

    def give_back(self, pages: list[int]) -> None:
        self.in_stores -= len(pages)
        self.stock.extend(pages)

    def available(self) -> int:
        return len(self.stock)

    def settle(
        self,
        want: int,
        alloc: Callable[[int], Optional[torch.Tensor]],
        free: Callable[[torch.Tensor], None],
    ) -> int:
        """Make the stock ``want`` pages: borrow what is missing (``alloc(tokens)`` -> token
        slots or None), give back what is over (``free(slots)``). Between steps only.
        Returns the stock's pages (fewer than ``want`` where the allocator had no room: then as
        many as it gave, asking for half each time)."""
        ps = self.page_size
        if want < len(self.stock):
            extra = self.stock[want:]
            del self.stock[want:]
            free(page_offsets(torch.tensor(extra, dtype=torch.int64), ps))
        else:
            missing = want - len(self.stock)
            while missing > 0:  # what the allocator has, halving the ask until it gives
                slots = alloc(missing * ps)
                if slots is not None:
                    self.stock.extend(torch.unique(slots.to("cpu", torch.int64) // ps).tolist())
                    break
                missing //= 2
        return len(self.stock)


class RowStore:
    """Rows of one kind in pages from a ``PageSource``: each page holds the rows
    ``rows_of_page(page)``; a page goes back to the source once none of its rows is held.

    Args:
        rows_of_page: device page -> the row ids it holds (the same count for every page).
        source: where pages come from.
        max_rows: the most rows held at once (None: what the source gives).
    """

    def __init__(
        self, rows_of_page: Callable[[int], list[int]], source: PageSource, max_rows: Optional[int] = None
    ) -> None:
        self.rows_of_page, self.source, self.max_rows = rows_of_page, source, max_rows
        self.rows_per_page = len(rows_of_page(1))
        self._free: dict[int, list[int]] = defaultdict(list)  # page -> its rows not held
        self._held: dict[int, int] = defaultdict(int)  # page -> its rows held
        self._page_of: dict[int, int] = {}  # row -> its page, for the rows held
        self.rows_in_use = 0
        self.refused = 0  # allocations refused for want of a page

    @property
    def pages(self) -> int:
        """Pages the store holds."""
        return len(self._held) + sum(1 for p, rows in self._free.items() if rows and p not in self._held)

    @property
    def free_rows(self) -> int:
        """Rows of pages the store holds that no request holds."""
        return sum(len(rows) for rows in self._free.values())

    def pages_for(self, num_rows: int) -> int:
        """Pages to take from the source before ``num_rows`` more rows can be held."""
        return max(0, -(-(num_rows - self.free_rows) // self.rows_per_page))

    def can_alloc(self, num_rows: int) -> bool:
        """Whether ``alloc(num_rows)`` would succeed now."""
        within = self.max_rows is None or self.rows_in_use + num_rows <= self.max_rows
        return within and self.pages_for(num_rows) <= self.source.available()

    def alloc(self, num_rows: int) -> Optional[torch.Tensor]:
        """``num_rows`` row ids (int64), or None (nothing taken, counted)."""
        if self.max_rows is not None and self.rows_in_use + num_rows > self.max_rows:
            self.refused += 1
            return None
        more = self.pages_for(num_rows)
        if more:
            pages = self.source.take(more)
            if pages is None:
                self.refused += 1
                return None
            for page in pages:
                self._free[page] = list(reversed(self.rows_of_page(page)))
        ids: list[int] = []
        # Rows of the pages most held first, so the others empty out and go back.
        for page in sorted((p for p, rows in self._free.items() if rows), key=lambda p: -self._held[p]):
            rows = self._free[page]
            while rows and len(ids) < num_rows:
                row = rows.pop()
                ids.append(row)
                self._page_of[row] = page
                self._held[page] += 1
            if not rows:
                del self._free[page]
            if len(ids) == num_rows:
                break
        self.rows_in_use += num_rows
        return torch.tensor(ids, dtype=torch.int64)

    def free(self, ids: torch.Tensor) -> None:
        """Rows no longer held; a page none of whose rows is held goes back to the source."""
        emptied = []
        for row in ids.tolist():
            page = self._page_of.pop(int(row), None)
            if page is None:
                continue  # padding, or not this store's
            self._free[page].append(int(row))
            self._held[page] -= 1
            self.rows_in_use -= 1
            if not self._held[page]:
                del self._held[page]
                del self._free[page]
                emptied.append(page)
        if emptied:
            self.source.give_back(emptied)
