"""One decode step over hot sets: plan per request, attend per layer, guard, observe.

The granularity is the *step*: a request attends over the same planned pages in
every layer of a step. SGLang stores all layers of a page in one physical page, so
what a device can hold — and what ``release.py`` gives back and copies in — is a
page across all layers; a per-layer set would need per-layer residency. Each layer
still checks its own query against the page summaries (the guard), so a page one
layer needs is added for that layer, never missed. The ``quest`` baseline is the
exception: it keeps every page on the device, as Quest does, and picks each layer's
pages from that layer's query (``selection.quest_layer_pages``).

``HotSetDecoder`` is driven by an attention backend: ``begin_step`` once per decode
batch with each request's token slots, ``attend`` once per layer, ``end_step``
after the last layer. ``end_step`` also plans the *next* step, so that its
promotions (host → device copies) and releases are issued one step ahead, before
the scheduler allocates that step's slots. A planned or guarded page that is not on
the device when a layer attends (no free device page for its promotion) is read
from its host copy for that step and counted; nothing is skipped.

Summaries are kept per request by logical page (copied from the physical page
summaries while the page is on the device), so a released page — whose physical
page another request may now own — keeps its bound.

Attention is ``sgl_kernel_ext.decode_importance_reference`` over the attended
pages, which returns exact masses of the attended pages. Plain torch over
``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch

from sgl_importance.hot_set.guard import pages_to_add
from sgl_importance.hot_set.release import RELEASED, Released, RequestPages
from sgl_importance.hot_set.request_params import REQUEST_PARAMS, RequestParams
from sgl_importance.hot_set.selection import HotSetCounts, HotSetParams, RequestHotSet, quest_layer_pages
from sgl_importance.hot_set.summaries import PageSummaries, key_bound
from sgl_kernel_ext import decode_importance_reference


class LayerResult(NamedTuple):
    """One layer's attention over the batch, in the layout the page table takes.

    Attributes:
        output: ``[bs, q_heads, Dv]`` float32.
        importance: ``[bs, max_pages]`` mass per attended page, in attended order.
        kv_indptr, kv_indices: the slots attended (int32 / int64); a page read from
            its host copy appears as the padding page, which the page table ignores.
    """

    output: torch.Tensor
    importance: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


@dataclass
class _Tracked:
    """A long request's state kept across steps."""

    state: RequestHotSet
    key_min: Optional[torch.Tensor] = None  # [layers, pages, kv_heads, D], by logical page
    key_max: Optional[torch.Tensor] = None
    next_plan: Optional[tuple[int, torch.Tensor, HotSetCounts]] = None  # (pages, plan, counts)


@dataclass
class _Live:
    """A request of the step in progress."""

    slots: torch.Tensor  # the request's token slots, in sequence order
    tracked: Optional[_Tracked]  # None: short request, attends densely
    pages: Optional[RequestPages] = None  # None: nothing of it can be released
    planned: Optional[torch.Tensor] = None  # logical pages, ascending
    tokens: Optional[torch.Tensor] = None  # tokens in each logical page
    mass_sum: Optional[torch.Tensor] = None  # summed over layers, or the largest (ranks_by_max)
    layers: Optional[torch.Tensor] = None  # layers that attended each page
    bound_mass: Optional[torch.Tensor] = None
    guarded: Optional[torch.Tensor] = None  # pages the guard added in some layer
    counts: HotSetCounts = field(default_factory=HotSetCounts)


def page_slots(slots: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots of logical ``pages`` (ascending) of a request holding ``slots``."""
    offsets = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
    return slots[offsets[offsets < slots.numel()]]


class HotSetDecoder:
    """Hot-set decode for the requests of one model runner.

    Args:
        params: the policy and its budget.
        summaries: the physical page summaries the KV writes keep up to date.
        page_size: tokens per page.
        threshold: requests longer than this many tokens use the hot set.
        released: the process's release record (``release.RELEASED``); requests it
            admitted give back device pages outside their hot set.
        request_params: parameters requests chose for themselves
            (``request_params.REQUEST_PARAMS``); others decode with ``params``.
    """

    def __init__(
        self,
        params: HotSetParams,
        summaries: PageSummaries,
        *,
        page_size: int,
        threshold: int,
        released: Released = RELEASED,
        request_params: RequestParams = REQUEST_PARAMS,
    ) -> None:
        self.params = params
        self.request_params = request_params
        self.summaries = summaries
        self.page_size = page_size
        self.threshold = threshold
        self.released = released
        self.tracked: dict[str, _Tracked] = {}
        self.totals = HotSetCounts()
        self._live: list[_Live] = []

    @property
    def states(self) -> dict[str, RequestHotSet]:
        return {rid: t.state for rid, t in self.tracked.items()}

    def begin_step(
        self,
        rids: Sequence[str],
        slots: Sequence[torch.Tensor],
        rows: Optional[Sequence[torch.Tensor]] = None,
    ) -> None:
        """Plan the step for the batch's requests.

        Args:
            slots: request i's token slots (released pages show the padding slot).
            rows: request i's ``req_to_token`` row (a view), where pages may be
                released; None keeps every page on the device.
        """
        ps = self.page_size
        # A request absent from the batch finished or was retracted; a retracted
        # one is prefilled again into new pages, so its state would be stale.
        present = set(rids)
        self.tracked = {rid: t for rid, t in self.tracked.items() if rid in present}
        self._live = []
        for i, (rid, req_slots) in enumerate(zip(rids, slots)):
            req_slots = req_slots.to(torch.int64)
            if req_slots.numel() <= self.threshold:
                self.tracked.pop(rid, None)
                self._live.append(_Live(req_slots, None))
                continue
            tracked = self.tracked.get(rid)
            if tracked is None:
                params = self.request_params.get(rid) or self.params
                tracked = self.tracked[rid] = _Tracked(RequestHotSet(params))
            pages = None
            if rows is not None and self.released.enabled:
                pages = self.released.pages_of(rid, rows[i], ps)
            num_pages = -(-req_slots.numel() // ps)
            self._refresh_summaries(tracked, req_slots, pages, num_pages)
            planned, counts = self._plan(tracked, num_pages)
            if pages is not None:
                # Promotions the previous step could not place: try again now.
                pages.restore(planned, self.released.tiers, self.released.counts)
                req_slots = rows[i][: req_slots.numel()].to(torch.int64)
            tokens = torch.full((num_pages,), ps, dtype=torch.int64)
            tokens[-1] = req_slots.numel() - (num_pages - 1) * ps
            f64 = dict(dtype=torch.float64)
            self._live.append(
                _Live(
                    req_slots,
                    tracked,
                    pages=pages,
                    planned=planned,
                    tokens=tokens,
                    mass_sum=torch.zeros(num_pages, **f64),
                    layers=torch.zeros(num_pages, dtype=torch.int64),
                    bound_mass=torch.zeros(num_pages, **f64),
                    guarded=torch.zeros(num_pages, dtype=torch.bool),
                    counts=counts,
                )
            )

    def _plan(self, tracked: _Tracked, num_pages: int) -> tuple[torch.Tensor, HotSetCounts]:
        ahead, tracked.next_plan = tracked.next_plan, None
        if ahead is not None and ahead[0] == num_pages:
            return ahead[1], ahead[2]
        return tracked.state.plan(num_pages)

    def _refresh_summaries(
        self, tracked: _Tracked, slots: torch.Tensor, pages: Optional[RequestPages], num_pages: int
    ) -> None:
        # Pages from the last known one on may have new keys (decode writes into the
        # last page); a released page was full and copied while it was resident.
        known = 0 if tracked.key_min is None else tracked.key_min.shape[1]
        if known < num_pages:
            shape = list(self.summaries.key_min.shape)
            shape[1] = num_pages - known
            grow_min = self.summaries.key_min.new_full(shape, float("inf"))
            grow_max = self.summaries.key_max.new_full(shape, float("-inf"))
            if tracked.key_min is None:
                tracked.key_min, tracked.key_max = grow_min, grow_max
            else:
                tracked.key_min = torch.cat((tracked.key_min, grow_min), dim=1)
                tracked.key_max = torch.cat((tracked.key_max, grow_max), dim=1)
        fresh = torch.arange(max(0, known - 1), num_pages)
        fresh = fresh[~_released_among(pages, fresh)]
        physical = torch.div(slots[fresh * self.page_size], self.page_size, rounding_mode="floor")
        tracked.key_min[:, fresh] = self.summaries.key_min[:, physical]
        tracked.key_max[:, fresh] = self.summaries.key_max[:, physical]

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        *,
        sm_scale: float,
        logit_cap: float = 0.0,
        sinks: Optional[torch.Tensor] = None,
    ) -> LayerResult:
        """Attend one layer: dense for short requests, the plan (+ guard) for long ones.

        Args:
            q: ``[bs, q_heads, D]``; k_buffer, v_buffer: the layer's KV pool.
        """
        run = dict(page_size=self.page_size, sm_scale=sm_scale, logit_cap=logit_cap, sinks=sinks)
        outputs, masses, chosen = [], [], []
        for b, live in enumerate(self._live):
            qb = q[b : b + 1]
            if live.tracked is None:
                slots = live.slots
                result = _attend(qb, k_buffer, v_buffer, slots, **run)
            else:
                tracked = live.tracked
                bounds = key_bound(
                    q[b],
                    tracked.key_min[layer_id],
                    tracked.key_max[layer_id],
                    sm_scale=sm_scale,
                    logit_cap=logit_cap,
                )
                params = tracked.state.params
                pages = live.planned
                if params.policy == "quest" and live.counts.warmups == 0:
                    pages = quest_layer_pages(bounds, params)
                result, slots = self._attend_pages(layer_id, qb, k_buffer, v_buffer, live, pages, run)
                outside = torch.ones(live.tokens.numel(), dtype=torch.bool)
                outside[pages] = False
                out_idx = torch.nonzero(outside).flatten()
                lse = result.lse[0]
                add = pages_to_add(bounds[out_idx], live.tokens[out_idx], lse, params.guard_threshold)
                if add.numel():
                    live.guarded[out_idx[add]] = True
                    pages = torch.sort(torch.cat((pages, out_idx[add]))).values
                    result, slots = self._attend_pages(layer_id, qb, k_buffer, v_buffer, live, pages, run)
                    lse = result.lse[0]
                if params.ranks_by_max:
                    per_head = result.importance_per_kv_head[0, : pages.numel()].double().amax(dim=1)
                    live.mass_sum[pages] = torch.maximum(live.mass_sum[pages], per_head)
                else:
                    live.mass_sum[pages] += result.importance[0, : pages.numel()].double()
                live.layers[pages] += 1
                # Mass bound of every page against the denominator of what was attended.
                log_mass = bounds.double() + live.tokens.double().log()[:, None] - lse.double()[None, :]
                page_bound = log_mass.amax(dim=1).clamp(max=0.0).exp()
                torch.maximum(live.bound_mass, page_bound, out=live.bound_mass)
                live.counts.pages_attended += pages.numel()
                live.counts.pages_dense += live.tokens.numel()
            outputs.append(result.output[0])
            masses.append(result.importance[0])
            chosen.append(slots)
        return _batch(outputs, masses, chosen, q)

    def _attend_pages(self, layer_id, qb, k_buffer, v_buffer, live: _Live, pages: torch.Tensor, run):
        """Attend ``pages``: from the device pool, or, for released ones, the host copy."""
        ps = self.page_size
        slots = page_slots(live.slots, pages, ps)
        held = _released_among(live.pages, pages)
        if not bool(held.any()):
            return _attend(qb, k_buffer, v_buffer, slots, **run), slots
        # Stage the step's pages in a small buffer, page j at [j*ps, (j+1)*ps).
        n = pages.numel()
        local = torch.arange(n)[:, None] * ps + torch.arange(ps)[None, :]
        logical = pages[:, None] * ps + torch.arange(ps)[None, :]
        valid = logical < live.slots.numel()
        k_local = k_buffer.new_zeros((n * ps,) + tuple(k_buffer.shape[1:]))
        v_local = v_buffer.new_zeros((n * ps,) + tuple(v_buffer.shape[1:]))
        on_device = (~held)[:, None] & valid
        src = live.slots[logical[on_device]]
        k_local[local[on_device]] = k_buffer[src]
        v_local[local[on_device]] = v_buffer[src]
        host_k, host_v = self.released.tiers.host_layer(layer_id, live.pages.host_slots(pages[held]))
        k_local[local[held].flatten()] = host_k.to(k_local.dtype)
        v_local[local[held].flatten()] = host_v.to(v_local.dtype)
        live.counts.pages_read_from_host += int(held.sum())
        indices = local[valid]
        indptr = torch.tensor([0, indices.numel()], dtype=torch.int32, device=qb.device)
        # Local page 0 is a real page here, not SGLang's padding page.
        result = decode_importance_reference(qb, k_local, v_local, indptr, indices, mask_page0=False, **run)
        return result, slots

    def end_step(self) -> HotSetCounts:
        """Fold the step into each long request's state, then plan the next step:
        release what it leaves out, promote what it adds. Returns the step's counts."""
        step = HotSetCounts()
        ps = self.page_size
        for live in self._live:
            if live.tracked is None:
                continue
            state = live.tracked.state
            attended = live.layers > 0
            mass = torch.zeros_like(live.mass_sum)
            if state.params.ranks_by_max:
                mass[attended] = live.mass_sum[attended]
            else:
                mass[attended] = live.mass_sum[attended] / live.layers[attended].double()
            state.observe(attended, mass, live.bound_mass)
            late = live.guarded.clone()
            late[live.planned] = False
            live.counts.steps = 1
            live.counts.late_arrivals = int(late.sum())
            live.counts.guard_fallbacks = int(bool(live.guarded.any()))
            step.add(live.counts)
            # The next step decodes one more token: plan it now, one step ahead.
            length = live.slots.numel()
            num_pages = -(-(length + 1) // ps)
            plan, counts = state.plan(num_pages)
            live.tracked.next_plan = (num_pages, plan, counts)
            if live.pages is not None:
                tiers, moves = self.released.tiers, self.released.counts
                keep = torch.zeros(num_pages, dtype=torch.bool)
                keep[plan] = True
                # Only full pages leave: the last one is still being written.
                full = torch.arange(num_pages) < length // ps
                live.pages.release(torch.nonzero(full & ~keep).flatten(), tiers, moves)
                live.pages.restore(plan, tiers, moves, note_refusal=False)
        if self.released.counts.pages_released:
            self.released.reopen = True
        step.add_release(self.released.take_counts())
        self._live = []
        self.totals.add(step)
        return step


def _released_among(pages: Optional[RequestPages], wanted: torch.Tensor) -> torch.Tensor:
    held = torch.zeros(wanted.numel(), dtype=torch.bool)
    if pages is not None and pages.released.numel():
        inside = wanted < pages.released.numel()
        held[inside] = pages.released[wanted[inside]]
    return held


def _attend(q, k_buffer, v_buffer, slots, **run):
    indptr = torch.tensor([0, slots.numel()], dtype=torch.int32, device=q.device)
    return decode_importance_reference(q, k_buffer, v_buffer, indptr, slots, **run)


def _batch(outputs, masses, chosen, q) -> LayerResult:
    bs = len(outputs)
    width = max([m.numel() for m in masses] + [1])
    importance = torch.zeros(bs, width, dtype=torch.float32, device=q.device)
    for b, m in enumerate(masses):
        importance[b, : m.numel()] = m
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=q.device)
    if bs:
        lengths = torch.tensor([s.numel() for s in chosen], dtype=torch.int64)
        indptr[1:] = torch.cumsum(lengths, 0).to(device=q.device, dtype=torch.int32)
        indices = torch.cat(chosen)
    else:
        indices = torch.zeros(0, dtype=torch.int64, device=q.device)
    output = torch.stack(outputs) if bs else q.new_zeros((0,) + tuple(q.shape[1:]))
    return LayerResult(output, importance, indptr, indices)
