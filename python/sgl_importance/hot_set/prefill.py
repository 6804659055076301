"""A long prompt summarised chunk by chunk while it prefills (streamed prefill, the decoder's side).

With ``--hot-set-prefill stream`` the scheduler releases a long prompt's full pages at the
end of each prefill chunk (``scheduler/streamed_prefill.py``); a page leaves the device only
once it is summarised (its key range, and guarded its key codes: ``coding.py``), the one
pass over its keys, which would otherwise happen at the end of the first decode step. So
the decoder tracks the request from its first chunk on: its record's ``TrackedRequest`` is
made here and kept while it prefills (``LongRequest.prefilling``), although no decode batch
holds it yet (``HotSetDecoder.drop_absent`` spares it while its pages are admitted).

With ``--hot-set-first-step seeded`` the extend also hands over what its last token attended
(``seed_layer``): the first decode step's plan starts from it (``apply_seed``), reading the
hot set rather than every page, which after a streamed prefill or a history left on the host
(``scheduler/returning.py``) would be a second read of all of it from the host pool.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from sgl_importance.hot_set.coding import summarise_pages
from sgl_importance.hot_set.pages.footprint import streams
from sgl_importance.hot_set.plan.request_state import LiveRequest, Seed
from sgl_importance.hot_set.plan.step_tally import top_p_counts

if TYPE_CHECKING:
    from sgl_importance.hot_set.guard.key_codes import GuardPool
    from sgl_importance.hot_set.guard.key_ranges import KeyRanges
    from sgl_importance.hot_set.params import HotSetParams
    from sgl_importance.hot_set.plan.selection import HotSetCounts
    from sgl_importance.hot_set.record import LongRequest
    from sgl_importance.hot_set.request_params import RequestParams
    from sgl_importance.hot_set.residency import Residency


class PrefillDecoder(Protocol):
    """What a streamed prefill and a seeded first step use of the process's
    ``decode.HotSetDecoder`` (which imports this module)."""

    params: HotSetParams  # the server's
    request_params: RequestParams  # those requests chose for themselves
    residency: Residency
    ranges: KeyRanges
    pool_views: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (K, V) viewed as pages
    page_size: int
    prefill_counts: HotSetCounts  # added to the next step's

    @property
    def guard(self) -> GuardPool: ...

    def track(self, rid: str) -> LongRequest: ...

    def forget_request(self, rid: str) -> None: ...


def summarise_prefill(decoder: PrefillDecoder, rid: str, slots: torch.Tensor, full: int) -> bool:
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
    record = decoder.residency.record(rid)
    if record is None or not record.prefilling or record.tracked is None:
        # A selection left from before (a retracted request prefilled again) is stale.
        decoder.forget_request(rid)
        record = decoder.track(rid)
        tracked, record.prefilling = record.tracked, True
    else:
        tracked = record.tracked
    _summarise(decoder, LiveRequest(slots, tracked, pages=decoder.residency.peek(rid)), full)
    return not tracked.ranges_refused and tracked.ranges.numel() >= full


def _summarise(decoder: PrefillDecoder, live: LiveRequest, full: int) -> None:
    """``coding.summarise_pages`` with the decoder's pools (host copies for pages off the
    device), its refusals counted with the next step's."""
    ps, host = decoder.page_size, decoder.residency.read_host
    refused = summarise_pages(decoder.ranges, decoder.guard, live, full, decoder.pool_views, ps, host)
    decoder.prefill_counts.ranges_refused += refused[0]
    decoder.prefill_counts.guard_refused += refused[1]
    decoder.prefill_counts.ranges_regained += refused[2]


def seed_layer(decoder: PrefillDecoder, rid: str, layer: int, masses: torch.Tensor) -> None:
    """One layer of request ``rid``'s extend: its last token's mass per page and KV head
    ``[kv_heads, pages]`` folded into its seed (``--hot-set-first-step seeded``). Each extend
    starts a new seed at its first layer: the last chunk's is the one its first step uses."""
    params = decoder.request_params.get(rid, decoder.params)
    if not streams(params):
        return
    by_max = params.ranks_by_max
    page = (masses.amax(0) if by_max else masses.mean(0)).double().cpu()
    record = decoder.residency.open(rid)
    seed = record.seed
    if seed is None or layer <= seed.last_layer or seed.mass.numel() != page.numel():
        wanted = torch.zeros(decoder.ranges.num_layers, dtype=torch.int64)
        seed = record.seed = Seed(page, layer, 1, wanted)
    else:
        seed.mass = torch.maximum(seed.mass, page) if by_max else seed.mass + page
        seed.last_layer, seed.layers = layer, seed.layers + 1
    if params.guard_threshold < 1.0:
        # What the dense warm-up would have told the first guarded step's read caps.
        top_p = torch.tensor([params.top_p], dtype=torch.float64)
        count = top_p_counts(masses.double().cpu().T[None, None], top_p)
        seed.wanted[layer % seed.wanted.numel()] = count.view(())


def apply_seed(decoder: PrefillDecoder, rid: str, live: LiveRequest, num_pages: int) -> None:
    """Before a tracked request's first decode step is planned: its pages summarised (a
    history never on the device from its host copies) and its hot set seeded from its
    prefill's last token, as if that had been the dense first step; its plan then reads the
    hot set exactly (``TrackedRequest.seeded``)."""
    record = decoder.residency.open(rid)
    tracked, seed, record.seed = live.tracked, record.seed, None
    if seed is None or tracked.state.step or seed.mass.numel() > num_pages:
        return
    _summarise(decoder, live, live.slots.numel() // decoder.page_size)
    if tracked.ranges_refused:
        return  # decodes dense from now on: its first step reads every page
    mass = torch.zeros(num_pages, dtype=torch.float64)
    params = tracked.state.params
    mass[: seed.mass.numel()] = seed.mass if params.ranks_by_max else seed.mass / seed.layers
    tracked.state.observe(torch.ones(num_pages, dtype=torch.bool), mass, torch.zeros(num_pages, dtype=torch.float64))
    tracked.seeded = True
    if params.guard_threshold < 1.0 and seed.layers == seed.wanted.numel():
        # Each layer's first read cap where its top-p needed it, as after a warm-up (else the
        # caps start at read_cap and a selection that wants more is flagged until they rise).
        tracked.seed_caps(seed.wanted, num_pages)
