"""A long prompt summarised chunk by chunk while it prefills (streamed prefill, the decoder's side).

With ``--hot-set-prefill stream`` the scheduler releases a long prompt's full pages at the
end of each prefill chunk (``scheduler/streamed_prefill.py``); a page leaves the device only
once it is summarised (its key range, and guarded its key codes: ``coding.py``), the one
pass over its keys, which would otherwise happen at the end of the first decode step. So
the decoder tracks the request from its first chunk on: its ``TrackedRequest`` is made here
and kept while it prefills, although no decode batch holds it yet
(``HotSetDecoder.drop_absent`` spares it while the residency still has it admitted).

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Any

import torch

from sgl_importance.hot_set.coding import summarise_pages
from sgl_importance.hot_set.footprint import streams
from sgl_importance.hot_set.request_state import LiveRequest, TrackedRequest
from sgl_importance.hot_set.sample import PageDraw, request_seed
from sgl_importance.hot_set.selection import RequestHotSet


def summarise_prefill(decoder: Any, rid: str, slots: torch.Tensor, full: int) -> bool:
    """Summarise request ``rid``'s pages ``[0, full)`` (those not done yet) from the device pool.

    Args:
        decoder: the process's ``HotSetDecoder`` (its ``pool_views`` cover every layer: the
            backend made them at start-up).
        slots: the request's token slots so far (its ``req_to_token`` row, a view).
        full: its full pages now.

    Returns:
        Whether every one of them is summarised (False: the range pool refused it, or its
        policy keeps its pages; then nothing of it may be released before it decodes).
    """
    params = decoder.request_params.get(rid, decoder.params)
    if not streams(params):
        return False
    tracked = decoder.tracked.get(rid)
    if rid not in decoder.prefilling or tracked is None:
        # A record left from before (a retracted request prefilled again) is stale.
        decoder.forget_request(rid)
        tracked = decoder.tracked[rid] = TrackedRequest(RequestHotSet(params), draw=PageDraw(request_seed(rid)))
        decoder.prefilling.add(rid)
    live = LiveRequest(slots, tracked, pages=decoder.residency.peek(rid))
    refused = summarise_pages(
        decoder.ranges, decoder.guard, live, full, decoder.pool_views, decoder.page_size, decoder.residency.read_host
    )
    decoder.prefill_counts.ranges_refused += refused[0]
    decoder.prefill_counts.guard_refused += refused[1]
    return not tracked.ranges_refused and tracked.ranges.numel() >= full
