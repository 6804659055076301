"""What a hot-set request holds on the device, in bytes: one function, F(request).

A tracked request holds the KV pages its row reads from the device, and one key-range row
per full page and, guarded, one key-code row per full page (``key_ranges.py``,
``key_codes.py``), in KV pages borrowed for them (``rows.py``: ``page_size`` ranges or a few
code rows to a page). :func:`held_bytes` counts that for a
request as it is now (the ``sgl_importance:hot_set_device_bytes`` gauge sums it over the
running requests); :func:`footprint` is what a request of a given length holds on the
device at its peak and keeps once released, in KV tokens, which admission charges it
(``scheduler/admission.py``).

Plain arithmetic; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sgl_importance.hot_set.params import HotSetParams


@dataclass(frozen=True)
class PageBytes:
    """Device bytes of one page, all layers and KV heads: its KV, its key range, its key codes."""

    kv: int
    ranges: int
    codes: int


def held_bytes(device_pages: int, ranged_pages: int, coded_pages: int, page: PageBytes) -> int:
    """F(request) now: the KV pages its row reads on the device and its pool rows."""
    return device_pages * page.kv + ranged_pages * page.ranges + coded_pages * page.codes


@dataclass(frozen=True)
class Footprint:
    """What a released hot-set request of ``final`` tokens holds on the device, in KV tokens
    (admission's arithmetic: ``scheduler/admission.py``).

    A request past ``threshold`` tokens releases every page outside its hot set; before, it
    is dense. Its prompt stays whole until its first decode step has planned (a prompt past
    the threshold), or stays as the tree's pages (a short prompt that grows past it); a
    streamed prompt holds its sinks, window and one chunk while it prefills.

    Attributes:
        dense: tokens it holds before its releases begin (its prompt, or up to the threshold;
            streamed, its last chunk with the sinks and window, and the first decode step's page).
        kept: tokens it holds once released (the hot set at ``final``, sinks and window,
            the page being filled, and a short prompt's tree pages), with the KV pages
            borrowed for its rows.
        released: pages it keeps on the host at ``final`` (what the host pool must take).
        ranged: full pages at ``final`` (a key-range row each).
    """

    dense: int
    kept: int
    released: int
    ranged: int

    @property
    def peak(self) -> int:
        return max(self.dense, self.kept)


def streams(params: HotSetParams) -> bool:
    """Whether a request with ``params`` may release its prompt while it prefills: not a
    ``dense`` one (it reads every page) nor a ``quest`` one (it keeps every page)."""
    return params.policy not in ("dense", "quest")


def footprint(
    prompt: int,
    final: int,
    params: HotSetParams,
    *,
    threshold: int,
    page_size: int,
    kept_share: Optional[float] = None,
    chunk: int = 0,
    rows_per_page: tuple[int, int] = (0, 0),
    prefix_on_host: bool = False,
) -> Optional[Footprint]:
    """The device footprint of a request of ``prompt`` tokens that ends at ``final``; None
    when it never releases (``final`` within the threshold, or a dense policy). ``kept_share``:
    the share of its pages its hot set holds where the guard grew it past the budget
    (``request_state.TrackedRequest.kept``); ``chunk``: the prefill chunk where a prompt past
    the threshold is streamed (0: it is not); ``rows_per_page``: the key ranges and key-code
    rows one borrowed KV page holds (0: none counted), its rows charged as those pages;
    ``prefix_on_host``: a grown request's prompt (the tree's pages) is held on the host like its
    own pages (``--hot-set-prefix host``), not kept whole on the device."""
    if params.policy == "dense" or final <= threshold:
        return None
    ps = page_size
    pages = -(-final // ps)
    hot = max(params.budget_pages(pages, kept_share), min(pages, params.sinks + params.window))
    # A grown request's prompt: the tree's pages, on the device unless lent from the host.
    tree = -(-prompt // ps) if prompt <= threshold and not prefix_on_host else 0
    kept = min(pages, hot + 1 + tree)
    dense = -(-(prompt if prompt > threshold else threshold) // ps) + 1
    if chunk and prompt > threshold and streams(params):
        # The last chunk beside the sinks, the window and the previous chunk's partial page.
        dense = min(dense, -(-chunk // ps) + params.sinks + params.window + 2)
    released = max(pages - kept, 0)

    def rows(full: int) -> int:  # borrowed KV pages for the rows of ``full`` summarised pages
        per_range, per_code = rows_per_page
        guarded = params.guard_threshold < 1.0 and per_code > 0
        return (-(-full // per_range) if per_range else 0) + (-(-full // per_code) if guarded else 0)

    # Rows exist from the first summary on: beside the prompt (or its last chunk) while it is
    # still whole, and beside the hot set at the end.
    dense += rows(-(-(prompt if prompt > threshold else threshold) // ps))
    kept += rows(max(pages - 1, 0))
    return Footprint(dense * ps, kept * ps, released, max(pages - 1, 0))
