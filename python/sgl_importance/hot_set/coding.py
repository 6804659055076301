"""A tracked request's full pages, summarised once: their key ranges and, guarded, their key codes.

A page is summarised at the end of the step that filled it (or, for a request new to the
hot set, of its first step, every full page), every layer, from the device pool, before
the residency owner releases anything: a full page never changes again, so this is its
only pass. Its key range (``key_ranges.KeyRanges``, every tracked request but a ``dense``
one) and, when the request is guarded, its 4-bit key codes against that same range
(``key_codes.GuardPool``), so reader and writer use the same numbers.

Rows are borrowed from the KV pool (``rows.py``), lent before the step that writes them:
a request that gets no range rows decodes dense with every page kept on the device
(``ranges_refused``, counted as ``ranges_refused``) until rows can be had for each of its
full pages again (``regain_ranges``, counted as ``ranges_regained``); one that gets no code
rows decodes unguarded (``guard_refused``).

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Optional

import torch

from sgl_importance.hot_set.guard.key_codes import GuardPool
from sgl_importance.hot_set.guard.key_ranges import KeyRanges
from sgl_importance.hot_set.plan.request_state import LiveRequest, TrackedRequest, released_among

logger = logging.getLogger(__name__)


def summarise_pages(
    ranges: KeyRanges,
    guard: GuardPool,
    live: LiveRequest,
    full: int,
    pool_pages: dict[int, tuple[torch.Tensor, torch.Tensor]],
    page_size: int,
    read_host: Optional[Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None,
) -> tuple[int, int, int]:
    """Key ranges (and, guarded, codes) of a tracked request's pages full now and not yet done.

    Args:
        full: the request's full pages now.
        pool_pages: layer -> (K, V) of the device pool viewed as pages.
        read_host: (layer, host slots) -> their K and V, for pages that were never on the
            device in this request (a returning turn's history, lent by the tree from its
            host copies); None: such a page makes the request keep every page.

    Returns:
        (1 when the range pool refused the request, 1 when the guard pool refused it,
        1 when a request it had refused got its rows back).
    """
    tracked = live.tracked
    regained = regain_ranges(ranges, tracked, full, live, read_host is not None) if tracked.ranges_refused else 0
    params = tracked.state.params
    if params.policy == "dense" or tracked.ranges_refused or not pool_pages:
        return 0, 0, regained
    done = tracked.ranges.numel()
    if full <= done:
        return 0, 0, regained
    new = torch.arange(done, full)
    off = released_among(live.pages, new)
    if bool(off.any()) and read_host is None:
        # Released before it was summarised (never with the owner's order of moves): the
        # request keeps every page rather than read its pages back.
        return refuse_ranges(ranges, guard, tracked), 0, regained
    host_slots = live.pages.host_slots(new[off]) if bool(off.any()) else None
    ids = ranges.alloc(new.numel())
    if ids is None:
        return refuse_ranges(ranges, guard, tracked), 0, regained
    guarded = not tracked.guard_refused and params.guard_threshold < 1.0
    codes = guard.alloc(new.numel()) if guarded else None
    refused = 0
    if guarded and codes is None:
        refused = refuse_guard(guard, tracked)
    physical = torch.div(live.slots[(new * page_size).to(live.slots.device)], page_size, rounding_mode="floor")
    for layer, (k_pages, v_pages) in pool_pages.items():
        index = physical.to(k_pages.device, torch.int64)
        keys, values = k_pages[index], v_pages[index] if codes is not None else None
        if host_slots is not None:
            host_k, host_v = read_host(layer, host_slots)
            at = off.to(keys.device)
            keys[at] = host_k.to(keys.device, keys.dtype).view(-1, *keys.shape[1:])
            if values is not None:
                values[at] = host_v.to(values.device, values.dtype).view(-1, *values.shape[1:])
        # The codes are written against the range as stored (rounded outward), as read.
        low, high = ranges.write(layer, ids, keys.amin(dim=1), keys.amax(dim=1))
        if codes is not None:
            guard.write(layer, codes, keys, low, high, values)
    tracked.ranges = torch.cat((tracked.ranges, ids))
    if codes is not None:
        tracked.codes = torch.cat((tracked.codes, codes))
    return 0, refused, regained


def refuse_guard(guard: GuardPool, tracked: TrackedRequest) -> int:
    """Turn a request's guard off for good (its code rows given back); returns 1."""
    tracked.guard_refused = True
    tracked.state.params = replace(tracked.state.params, guard_threshold=1.0)
    if tracked.codes.numel():
        guard.free(tracked.codes)
        tracked.codes = tracked.codes[:0]
    logger.warning("hot set: no KV page could be lent for a request's key codes; it decodes without a guard")
    return 1


def refuse_ranges(ranges: KeyRanges, guard: GuardPool, tracked: TrackedRequest) -> int:
    """A request that gets no range rows: dense from now on, every page planned (so the
    owner releases none and brings any released one back), its ids back to the pools; returns 1."""
    tracked.ranges_refused = True
    tracked.refused_params = tracked.state.params
    tracked.state.params = replace(tracked.state.params, policy="dense", guard_threshold=1.0)
    if tracked.ranges.numel():
        ranges.free(tracked.ranges)
        tracked.ranges = tracked.ranges[:0]
    if tracked.codes.numel():
        guard.free(tracked.codes)
        tracked.codes = tracked.codes[:0]
    logger.warning("hot set: no KV page could be lent for a request's key ranges; it decodes dense, kept on the device")
    return 1


def regain_ranges(ranges: KeyRanges, tracked: TrackedRequest, full: int, live: LiveRequest, host: bool) -> int:
    """A request the range pool refused, back on its own settings once the pool has a row for
    each of its ``full`` pages (to be summarised now, its released ones from their host copies
    where ``host``: else only while none is released); returns 1 when it is. Refused, it
    decodes dense and its released pages are read from the host every step; this ends that."""
    if tracked.refused_params is None or not ranges.rows.can_alloc(full):
        return 0
    if not host and bool(released_among(live.pages, torch.arange(full)).any()):
        return 0
    tracked.ranges_refused = False
    tracked.state.params, tracked.refused_params = tracked.refused_params, None
    return 1
