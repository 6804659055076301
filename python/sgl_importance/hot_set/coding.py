"""Writing a guarded request's key codes, and refusing it a guard when the pool is full.

A page is coded at the end of the step that filled it (or, for a request new to the
guard, of its first step), every layer, from the device pool, before any release: so
a page released in the step that filled it is coded from its own keys. The codes'
range is the page's own key min/max, which becomes the request's summary of that page
(``TrackedRequest.key_min/key_max``), so reader and writer use the same numbers.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from sgl_importance.hot_set.key_codes import GuardPool
from sgl_importance.hot_set.request_state import LiveRequest, TrackedRequest, released_among

logger = logging.getLogger(__name__)


def code_pages(
    guard: GuardPool,
    live: LiveRequest,
    full: int,
    pool_pages: dict[int, tuple[torch.Tensor, torch.Tensor]],
    page_size: int,
) -> int:
    """Code a guarded request's pages that are full and uncoded, in every layer.

    Args:
        full: the request's full pages now.
        pool_pages: layer -> (K, V) of the device pool viewed as pages.

    Returns:
        1 when the guard pool refused the request (it then decodes unguarded), else 0.
    """
    tracked = live.tracked
    params = tracked.state.params
    if tracked.guard_refused or params.guard_threshold >= 1.0 or params.policy == "dense":
        return 0
    coded = tracked.codes.numel()
    if full <= coded or not pool_pages:
        return 0
    new = torch.arange(coded, full)
    if bool(released_among(live.pages, new).any()):
        # Released before it was coded: such a request stays unguarded rather than
        # read its pages back.
        return refuse(guard, tracked)
    ids = guard.alloc(new.numel())
    if ids is None:
        return refuse(guard, tracked)
    physical = torch.div(live.slots[(new * page_size).to(live.slots.device)], page_size, rounding_mode="floor")
    for layer, (k_pages, v_pages) in pool_pages.items():
        index = physical.to(k_pages.device, torch.int64)
        keys = k_pages[index]
        low, high = keys.amin(dim=1), keys.amax(dim=1)
        tracked.key_min[layer][new] = low.to(tracked.key_min.dtype)
        tracked.key_max[layer][new] = high.to(tracked.key_max.dtype)
        guard.write(layer, ids, keys, low, high, v_pages[index])
    tracked.codes = torch.cat((tracked.codes, ids))
    return 0


def refuse(guard: GuardPool, tracked: TrackedRequest) -> int:
    """Turn a request's guard off for good (its codes back to the pool); returns 1."""
    tracked.guard_refused = True
    tracked.state.params = replace(tracked.state.params, guard_threshold=1.0)
    if tracked.codes.numel():
        guard.free(tracked.codes)
        tracked.codes = tracked.codes[:0]
    logger.warning("hot set: no room in the guard pool for a request's key codes; it decodes without a guard")
    return 1
