"""One decode step over hot sets: plan per request, attend per layer, guard, observe.

The granularity is the *step*: a request reads the same planned pages exactly in
every layer of a step. SGLang stores all layers of a page in one physical page, so
what a device can hold — and what ``residency.py`` gives back and copies in — is a page
across all layers. The ``quest`` baseline is the exception: it keeps every page on
the device, as Quest does, and picks each layer's pages from that layer's query
(``selection.quest_layer_pages``).

A layer attends in up to three parts, one batched call each for the whole batch:

1. the planned pages exactly (``sgl_kernel_ext.decode_importance_paged``; short
   requests read every page here), released ones from their host copy, staged;
2. with the guard on (``guard_threshold < 1``), every other full page of a long
   request from its 8-bit shadow (``estimate.estimate_outside``), folded into the
   same softmax, with a deterministic bound on the error of the layer's output
   (``estimate.combine``);
3. where that bound exceeds the threshold, the most suspect outside pages exactly
   (``estimate.pages_to_read``), after which the bound is computed again; if it
   still exceeds the threshold, every outside page is read (counted either way).

``HotSetDecoder`` is driven by an attention backend: ``begin_step`` once per decode
batch, ``attend`` once per layer, ``end_step`` after the last layer. ``end_step``
also plans the *next* step, so that its promotions (host → device copies) and
releases are issued one step ahead, before the scheduler allocates that step's
slots. A planned page with no free device page for its promotion is read from its
host copy for that step and counted; nothing is skipped. Promotions go through a
``promotion.PromotionStream`` where one is given (a side stream on CUDA), and every
``attend`` first fences them, so a layer never reads a page still being copied.

Exact pages get exact masses (normalised by the step's combined denominator); pages
estimated from the shadow get estimated masses, which rank them for promotion. With
the guard off, a non-attended page is ranked by its key min/max bound (Quest's), kept
per request by logical page so a released page keeps it.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple, Optional, Protocol, Sequence

import torch

from sgl_importance.hot_set.estimate import OutsidePlan, combine, estimate_outside, pages_to_read
from sgl_importance.hot_set.promotion import PromotionStream, StreamedPagePools
from sgl_importance.hot_set.request_params import REQUEST_PARAMS, RequestParams
from sgl_importance.hot_set.residency import RELEASED, PagePools, Released, RequestPages
from sgl_importance.hot_set.selection import HotSetCounts, HotSetParams, RequestHotSet, quest_layer_pages
from sgl_importance.hot_set.shadow import ShadowPool
from sgl_importance.hot_set.summaries import PageSummaries, key_bound
from sgl_kernel_ext import (
    DecodeImportanceOutput,
    PagedDecodePlan,
    PagedDecodeWorkspace,
    decode_importance_paged,
    plan_paged_decode,
)

# Re-reads of the guard before it reads every outside page of a layer.
GUARD_ROUNDS = 2


class ExactAttention(Protocol):
    """What reads pages exactly: ``sgl_kernel_ext.decode_importance_paged``'s contract.

    ``k_pages``/``v_pages`` are the layer's pool viewed as pages; listed ids at or past
    the pool's page count name pages of the staging buffers (``extra_*``), where pages
    that live only in the host pool are put for the step. A GPU backend passes its own
    kernel here (the default is the CPU's batched torch path).
    """

    def __call__(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        plan: PagedDecodePlan,
        *,
        sm_scale: float,
        logit_cap: float,
        sinks: Optional[torch.Tensor] = None,
        extra_k_pages: Optional[torch.Tensor] = None,
        extra_v_pages: Optional[torch.Tensor] = None,
    ) -> DecodeImportanceOutput: ...


class LayerResult(NamedTuple):
    """One layer's attention over the batch, in the layout the page table takes.

    Attributes:
        output: ``[bs, q_heads, Dv]`` float32.
        importance: ``[bs, max_pages]`` exact mass of each page read in part 1, in listed
            order, normalised by the step's combined denominator.
        kv_indptr, kv_indices: the slots of those pages (int32 / int64); a page read from
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
    shadow: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # id per full page
    next_plan: Optional[tuple[int, torch.Tensor, HotSetCounts]] = None  # (pages, plan, counts)


@dataclass
class _Live:
    """A request of the step in progress."""

    slots: torch.Tensor  # the request's token slots, in sequence order
    tracked: Optional[_Tracked]  # None: short request, attends densely
    pages: Optional[RequestPages] = None  # None: nothing of it can be released
    planned: Optional[torch.Tensor] = None  # logical pages read exactly, ascending
    tokens: Optional[torch.Tensor] = None  # tokens in each logical page
    mass: Optional[torch.Tensor] = None  # over layers: summed, or the largest (ranks_by_max)
    layers: Optional[torch.Tensor] = None  # layers that read each page exactly
    outside_mass: Optional[torch.Tensor] = None  # largest estimated (or bound) mass of unread pages
    guarded: Optional[torch.Tensor] = None  # pages the guard read in some layer
    counts: HotSetCounts = field(default_factory=HotSetCounts)

    @property
    def guard_on(self) -> bool:
        """Whether unread pages are estimated and the error bounded (dense reads everything)."""
        if self.tracked is None:
            return False
        params = self.tracked.state.params
        return params.guard_threshold < 1.0 and params.policy != "dense"

    @property
    def bounds_unread(self) -> bool:
        """Guard off: unread pages are ranked by their key min/max bound each layer. A
        dense request reads every page, so there is nothing to rank (and the bound over
        all its pages cost a dense hot-set step ~15 % at 4 x 7.5K)."""
        return self.tracked is not None and not self.guard_on and self.tracked.state.params.policy != "dense"


@dataclass
class _ExactPlan:
    """Part 1 of a layer: the pages each request reads exactly, as the kernel takes them."""

    plan: object  # sgl_kernel_ext.PagedDecodePlan
    logical: list[torch.Tensor]  # per request: the logical pages listed
    staged_host: torch.Tensor  # host slots of the staged pages, page after page
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


@dataclass
class _StepTally:
    """What the layers of a step found, as tensors (folded into each request once, at
    ``end_step``): no Python loop per request per layer.

    ``exact_*`` follow part 1's padded table ``[bs, W]``; ``outside_*`` the outside plan's
    ``[n, P]``.
    """

    exact_mass: torch.Tensor  # float64, summed over layers or the largest (rows that rank by max)
    by_max: torch.Tensor  # bool [bs]
    layers: int = 0  # layers read with part 1's fixed lists
    outside_mass: Optional[torch.Tensor] = None  # float64 [n, P] largest estimated mass
    outside_read: Optional[torch.Tensor] = None  # bool [n, P] read by the guard in some layer
    guard_reads: Optional[torch.Tensor] = None  # int64 [n] layers in which the guard read
    pages_guard_read: Optional[torch.Tensor] = None  # int64 [n], over layers
    pages_estimated: Optional[torch.Tensor] = None  # int64 [n], over layers
    bound_mass: Optional[torch.Tensor] = None  # float64 [m, Pmax] guard-off rows: largest key-bound mass


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
        released: the process's release record (``residency.RELEASED``); requests it
            admitted give back device pages outside their hot set.
        request_params: parameters requests chose for themselves
            (``request_params.REQUEST_PARAMS``); others decode with ``params``.
        shadow: the 8-bit copies the guard estimates unread pages from (default: a pool
            shaped like ``summaries``, created on first use).
        exact: what reads pages exactly (default: ``decode_importance_paged``).
        promotions: where promotions' copies run (default: in line, where issued).
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
        shadow: Optional[ShadowPool] = None,
        exact: Optional[ExactAttention] = None,
        promotions: Optional[PromotionStream] = None,
    ) -> None:
        self.params = params
        self.request_params = request_params
        self.summaries = summaries
        self.page_size = page_size
        self.threshold = threshold
        self.released = released
        self._shadow = shadow
        self.tracked: dict[str, _Tracked] = {}
        self.totals = HotSetCounts()
        self._live: list[_Live] = []
        self._exact: Optional[_ExactPlan] = None
        self._outside: Optional[OutsidePlan] = None
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self._tally: Optional[_StepTally] = None
        self._step_layers = 0
        self._workspace = PagedDecodeWorkspace()
        self._read = exact or self._read_paged
        self.promotions = promotions

    @property
    def states(self) -> dict[str, RequestHotSet]:
        return {rid: t.state for rid, t in self.tracked.items()}

    @property
    def shadow(self) -> ShadowPool:
        if self._shadow is None:
            layers, _, kv_heads, dim = self.summaries.key_min.shape
            self._shadow = ShadowPool(
                layers,
                kv_heads,
                dim,
                page_size=self.page_size,
                dtype=self.summaries.key_min.dtype,
                device=self.summaries.key_min.device,
            )
        return self._shadow

    # -- planning, once per step ---------------------------------------------------

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
        for rid in [r for r in self.tracked if r not in present]:
            self._drop(rid)
        self._live = []
        for i, (rid, req_slots) in enumerate(zip(rids, slots)):
            req_slots = req_slots.to("cpu", torch.int64)  # planned on the host
            if req_slots.numel() <= self.threshold:
                self._drop(rid)
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
                pages.restore(planned, self._promoting(), self.released.counts)
                req_slots = rows[i][: req_slots.numel()].to("cpu", torch.int64)
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
                    mass=torch.zeros(num_pages, **f64),
                    layers=torch.zeros(num_pages, dtype=torch.int64),
                    outside_mass=torch.zeros(num_pages, **f64),
                    guarded=torch.zeros(num_pages, dtype=torch.bool),
                    counts=counts,
                )
            )
        self._pending = self._shadow_pending()
        # Part 1 and 2 lists are built by the first layer, which knows the pool's size.
        self._exact = self._outside = self._tally = None
        self._step_layers = 0

    def _promoting(self) -> PagePools:
        """The pools promotions copy through: on the promotion stream where there is one."""
        if self.promotions is None:
            return self.released.pools
        return StreamedPagePools(self.released.pools, self.promotions)

    def _drop(self, rid: str) -> None:
        tracked = self.tracked.pop(rid, None)
        if tracked is not None and self._shadow is not None and tracked.shadow.numel():
            self._shadow.free(tracked.shadow)

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

    def _shadow_pending(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Full pages of guarded requests without a shadow yet: (ids, device slots, host slots).

        Written layer by layer in ``attend``. A page is full once its last token is
        written; it was the request's last page then, so it is read from the device, or,
        if the step that filled it already released it, from its host copy.
        """
        ps = self.page_size
        ids, dev, host = [], [], []
        for live in self._live:
            if not live.guard_on:
                continue
            tracked = live.tracked
            full = live.slots.numel() // ps
            known = tracked.shadow.numel()
            if full <= known:
                continue
            new = torch.arange(known, full)
            fresh = self.shadow.alloc(new.numel())
            tracked.shadow = torch.cat((tracked.shadow, fresh))
            held = _released_among(live.pages, new)
            ids.append(fresh[~held])
            dev.append(page_slots(live.slots, new[~held], ps))
            if bool(held.any()):
                ids.append(fresh[held])
                dev.append(torch.zeros(0, dtype=torch.int64))
                host.append(live.pages.host_slots(new[held]))
        if not ids:
            return None
        host_slots = torch.cat(host) if host else torch.zeros(0, dtype=torch.int64)
        return torch.cat(ids), torch.cat(dev), host_slots

    def _exact_plan(self, lists: Sequence[Optional[torch.Tensor]], pool_pages: int) -> _ExactPlan:
        """Part 1: each request's listed logical pages, as physical or staged page ids.

        ``lists[i]`` None reads every page of request i (a short request); staged pages
        get ids from ``pool_pages`` on.
        """
        ps = self.page_size
        ids, tokens, logical, staged, slot_lists = [], [], [], [], []
        for live, listed in zip(self._live, lists):
            num_pages = -(-live.slots.numel() // ps)
            if listed is None:
                listed = torch.arange(num_pages)
            logical.append(listed)
            first = live.slots[listed * ps]
            physical = torch.div(first, ps, rounding_mode="floor")
            count = torch.full((listed.numel(),), ps, dtype=torch.int64)
            if listed.numel() and int(listed[-1]) == num_pages - 1:
                count[-1] = live.slots.numel() - (num_pages - 1) * ps
            held = _released_among(live.pages, listed)
            if bool(held.any()):
                where = torch.nonzero(held).flatten()
                base = sum(s.numel() for s in staged) // ps
                physical = physical.clone()
                physical[where] = pool_pages + base + torch.arange(where.numel())
                staged.append(live.pages.host_slots(listed[held]))
            ids.append(physical)
            tokens.append(count)
            # Slots for the page table: a staged page shows the padding slot.
            req_slots = page_slots(live.slots, listed, ps)
            if bool(held.any()):
                mask = held.repeat_interleave(count)
                req_slots = torch.where(mask, 0, req_slots)
            slot_lists.append(req_slots)
        indptr = torch.zeros(len(ids) + 1, dtype=torch.int64)
        if ids:
            indptr[1:] = torch.cumsum(torch.tensor([i.numel() for i in ids]), 0)
        plan = plan_paged_decode(
            indptr,
            torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64),
            torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int64),
            page_size=ps,
        )
        kv_indptr = torch.zeros(len(slot_lists) + 1, dtype=torch.int32)
        if slot_lists:
            kv_indptr[1:] = torch.cumsum(torch.tensor([s.numel() for s in slot_lists]), 0).to(torch.int32)
        kv_indices = torch.cat(slot_lists) if slot_lists else torch.zeros(0, dtype=torch.int64)
        staged_host = torch.cat(staged) if staged else torch.zeros(0, dtype=torch.int64)
        return _ExactPlan(plan, logical, staged_host, kv_indptr, kv_indices)

    def _outside_plan(self, lists: Sequence[Optional[torch.Tensor]]) -> OutsidePlan:
        """Part 2: the full pages each guarded request does not read exactly."""
        rows, shadow, logical = [], [], []
        for i, (live, listed) in enumerate(zip(self._live, lists)):
            if not live.guard_on or listed is None:
                continue
            full = live.tracked.shadow.numel()
            outside = torch.ones(full, dtype=torch.bool)
            outside[listed[listed < full]] = False
            pages = torch.nonzero(outside).flatten()
            if pages.numel():
                rows.append(i)
                shadow.append(live.tracked.shadow[pages])
                logical.append(pages)
        return OutsidePlan.build(rows, shadow, logical)

    # -- one layer -----------------------------------------------------------------

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
        """Attend one layer for the whole batch (see the module docstring).

        Args:
            q: ``[bs, q_heads, D]``; k_buffer, v_buffer: the layer's KV pool.
        """
        if self.promotions is not None:
            self.promotions.fence()  # pages promoted a step ahead may still be in flight
        ps = self.page_size
        whole = k_buffer.shape[0] // ps * ps  # a pool's rows past its last whole page are never a page
        k_pages = k_buffer[:whole].view(-1, ps, *k_buffer.shape[1:])
        v_pages = v_buffer[:whole].view(-1, ps, *v_buffer.shape[1:])
        self._write_shadow(layer_id, k_pages, v_pages)
        if self._exact is None:
            planned = [live.planned for live in self._live]
            self._exact = self._exact_plan(planned, k_pages.shape[0])
            self._outside = self._outside_plan(planned)
            self._tally = self._new_tally(q.device)
        exact, outside_plan = self._exact, self._outside
        per_layer = any(live.tracked is not None and live.tracked.state.params.policy == "quest" for live in self._live)
        if per_layer:
            exact, outside_plan = self._quest_layer(layer_id, q, k_pages.shape[0], sm_scale, logit_cap)
        run = dict(sm_scale=sm_scale, logit_cap=logit_cap)
        extra_k, extra_v = self._staged(layer_id, exact.staged_host)
        result = self._read(
            q, k_pages, v_pages, exact.plan, sinks=sinks, extra_k_pages=extra_k, extra_v_pages=extra_v, **run
        )
        output = result.output
        share = q.new_ones(q.shape[:2], dtype=torch.float32)  # exact pages' share of the combined denominator
        if not outside_plan.empty:
            output = output.clone()
            rows = outside_plan.rows
            estimate = estimate_outside(q[rows], self.shadow, layer_id, outside_plan, workspace=self._workspace, **run)
            combined = self._guard(layer_id, q, k_pages, v_pages, result, estimate, outside_plan, run, per_layer)
            output[rows] = combined.output
            share[rows] = combined.exact_share
        self._tally_exact(layer_id, q, result, exact, share, run, per_layer)
        self._step_layers += 1
        return LayerResult(output, self._rescaled(result, share), exact.kv_indptr, exact.kv_indices)

    def _write_shadow(self, layer_id: int, k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
        if self._pending is None:
            return
        ids, dev, host = self._pending
        ps = self.page_size
        shape = k_pages.shape[1:]
        k_flat, v_flat = k_pages.view(-1, *shape[1:]), v_pages.view(-1, *v_pages.shape[2:])
        keys, values = k_flat[dev], v_flat[dev]
        if host.numel():
            host_k, host_v = self.released.pools.host_layer(layer_id, host)
            keys = torch.cat((keys, host_k.to(keys.device, keys.dtype)))
            values = torch.cat((values, host_v.to(values.device, values.dtype)))
        self.shadow.write(layer_id, ids, keys.view(-1, ps, *shape[1:]), values.view(-1, ps, *v_pages.shape[2:]))

    def _staged(self, layer_id: int, host_slots: torch.Tensor):
        if host_slots.numel() == 0:
            return None, None
        k, v = self.released.pools.host_layer(layer_id, host_slots)
        ps = self.page_size
        return k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:])

    def _read_paged(self, q, k_pages, v_pages, plan, **kwargs) -> DecodeImportanceOutput:
        return decode_importance_paged(q, k_pages, v_pages, plan, workspace=self._workspace, **kwargs)

    def _quest_layer(self, layer_id: int, q: torch.Tensor, pool_pages: int, sm_scale: float, logit_cap: float):
        """Quest picks each layer's pages from that layer's query (a loop over its requests)."""
        lists: list[Optional[torch.Tensor]] = []
        for b, live in enumerate(self._live):
            listed = live.planned
            if live.tracked is not None and live.tracked.state.params.policy == "quest" and live.counts.warmups == 0:
                bounds = key_bound(
                    q[b], live.tracked.key_min[layer_id], live.tracked.key_max[layer_id],
                    sm_scale=sm_scale, logit_cap=logit_cap,
                )  # fmt: skip
                listed = quest_layer_pages(bounds.cpu(), live.tracked.state.params)  # planned on the host
            lists.append(listed)
        return self._exact_plan(lists, pool_pages), self._outside_plan(lists)

    def _guard(self, layer_id, q, k_pages, v_pages, result, estimate, outside_plan, run, per_layer: bool):
        """Part 3: fold the estimate in; read exactly what the bound cannot vouch for."""
        rows = outside_plan.rows
        lse, out = result.lse[rows], result.output[rows]
        combined = combine(lse, out, estimate)
        dev = lse.device
        thresholds = torch.tensor([self._live[int(r)].tracked.state.params.guard_threshold for r in rows], device=dev)
        valid = outside_plan.valid.to(dev)
        keep = valid.clone()
        for round_ in range(GUARD_ROUNDS + 1):
            need = combined.relative > thresholds
            if not bool(need.any()):
                break
            chosen = keep & need[:, None]  # the last round: every outside page
            if round_ < GUARD_ROUNDS:
                picked = torch.zeros_like(valid)
                for t in thresholds[need].unique().tolist():
                    picked |= pages_to_read(combined, keep, float(t)) & (need & (thresholds == t))[:, None]
                if bool(picked.any()):
                    chosen = picked
            lse_a, out_a = self._read_exactly(layer_id, q, k_pages, v_pages, outside_plan, chosen, run)
            lse, out = _merge(lse, out, lse_a, out_a)
            keep &= ~chosen
            combined = combine(lse, out, estimate, keep)
        read = valid & ~keep
        # Estimated masses (of the combined denominator) rank unread pages for promotion.
        ratio = torch.exp(estimate.lse - combined.lse).nan_to_num(0.0)  # [n, Hq]
        mass = (estimate.page_share * ratio[..., None]).amax(dim=1).double()  # [n, P]
        tally = self._tally if not per_layer else self._new_outside_tally(outside_plan, dev)
        torch.maximum(tally.outside_mass, mass, out=tally.outside_mass)
        tally.outside_read |= read
        tally.guard_reads += read.any(dim=1)
        tally.pages_guard_read += read.sum(dim=1)
        tally.pages_estimated += keep.sum(dim=1)
        if per_layer:
            self._fold_outside(outside_plan, tally, layers=1)
        return combined

    def _read_exactly(self, layer_id, q, k_pages, v_pages, outside_plan, chosen, run):
        """Exact lse and output of the ``chosen`` outside pages of each planned request."""
        rows = outside_plan.rows
        lists: list[torch.Tensor] = []
        subset = []
        chosen = chosen.cpu()  # the lists are planned on the host
        for i, row in enumerate(rows.tolist()):
            subset.append(self._live[row])
            lists.append(outside_plan.logical[i][chosen[i]])
        saved = self._live
        self._live = subset
        try:
            plan = self._exact_plan(lists, k_pages.shape[0])
        finally:
            self._live = saved
        extra_k, extra_v = self._staged(layer_id, plan.staged_host)
        res = self._read(q[rows], k_pages, v_pages, plan.plan, extra_k_pages=extra_k, extra_v_pages=extra_v, **run)
        for live, listed in zip(subset, lists):
            live.counts.pages_read_from_host += int(_released_among(live.pages, listed).sum())
        lse = torch.where(plan.plan.live.to(res.lse.device)[:, None], res.lse, float("-inf"))
        return lse, res.output

    def _new_tally(self, device: torch.device) -> _StepTally:
        # On the layers' device: folded into the requests (on the host) once per step.
        width = self._exact.plan.max_pages
        bs = len(self._live)
        by_max = torch.tensor(
            [live.tracked is not None and live.tracked.state.params.ranks_by_max for live in self._live],
            device=device,
        )
        tally = _StepTally(torch.zeros(bs, width, dtype=torch.float64, device=device), by_max)
        self._add_outside_tally(tally, self._outside, device)
        guard_off = [live for live in self._live if live.bounds_unread]
        if guard_off:
            width = max(live.tokens.numel() for live in guard_off)
            tally.bound_mass = torch.zeros(len(guard_off), width, dtype=torch.float64, device=device)
        return tally

    def _new_outside_tally(self, outside_plan: OutsidePlan, device: torch.device) -> _StepTally:
        tally = _StepTally(torch.zeros(0, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool))
        self._add_outside_tally(tally, outside_plan, device)
        return tally

    @staticmethod
    def _add_outside_tally(tally: _StepTally, outside_plan: OutsidePlan, device: torch.device) -> None:
        n, width = outside_plan.shadow.shape
        tally.outside_mass = torch.zeros(n, width, dtype=torch.float64, device=device)
        tally.outside_read = torch.zeros(n, width, dtype=torch.bool, device=device)
        tally.guard_reads = torch.zeros(n, dtype=torch.int64, device=device)
        tally.pages_guard_read = torch.zeros(n, dtype=torch.int64, device=device)
        tally.pages_estimated = torch.zeros(n, dtype=torch.int64, device=device)

    def _tally_exact(self, layer_id, q, result, exact: _ExactPlan, share, run, per_layer: bool) -> None:
        """Fold one layer's exact masses into the step's tally (or, when the lists change
        per layer — the quest baseline — straight into each request)."""
        per_kv = result.importance_per_kv_head.double()  # [bs, W, kv]
        kv = per_kv.shape[-1]
        group_share = share.view(share.shape[0], kv, -1).mean(-1).double()  # [bs, kv]
        masses = per_kv * group_share[:, None, :]
        tally = self._tally
        if per_layer:
            for b, live in enumerate(self._live):
                if live.tracked is None:
                    continue
                listed = exact.logical[b]
                m = masses[b, : listed.numel()].cpu()
                if bool(tally.by_max[b]):
                    live.mass[listed] = torch.maximum(live.mass[listed], m.amax(dim=1))
                else:
                    live.mass[listed] += m.mean(dim=1)
                live.layers[listed] += 1
                live.counts.pages_attended += listed.numel()
                live.counts.pages_read_from_host += int(_released_among(live.pages, listed).sum())
        else:
            reduced = torch.where(tally.by_max[:, None], masses.amax(dim=2), masses.mean(dim=2))
            if reduced.shape[1] == tally.exact_mass.shape[1]:
                summed = tally.exact_mass + reduced
                tally.exact_mass = torch.where(tally.by_max[:, None], torch.maximum(tally.exact_mass, reduced), summed)
            tally.layers += 1
        if tally.bound_mass is not None:
            self._tally_bounds(layer_id, q, result, run)

    def _tally_bounds(self, layer_id, q, result, run) -> None:
        """Guard off, nothing estimated: rank unread pages by their key min/max bound
        (Quest's), as a mass against the attended denominator, largest over heads."""
        rows = [b for b, live in enumerate(self._live) if live.bounds_unread]
        mins = [self._live[b].tracked.key_min[layer_id] for b in rows]
        maxs = [self._live[b].tracked.key_max[layer_id] for b in rows]
        pad = torch.nn.utils.rnn.pad_sequence
        kmin = pad(mins, batch_first=True, padding_value=float("inf"))  # [m, Pmax, kv, D]
        kmax = pad(maxs, batch_first=True, padding_value=float("-inf"))
        index = torch.tensor(rows)
        bounds = key_bound(q[index], kmin, kmax, **run).double()  # [m, Pmax, Hq]
        tokens = pad([self._live[b].tokens for b in rows], batch_first=True).to(q.device, torch.float64)
        log_mass = bounds + tokens.log()[..., None] - result.lse[index].double()[:, None, :]
        page_bound = log_mass.amax(dim=2).clamp(max=0.0).exp().nan_to_num(0.0)
        width = page_bound.shape[1]
        tally = self._tally.bound_mass
        tally[:, :width] = torch.maximum(tally[:, :width], page_bound)

    def _fold_outside(self, outside_plan: OutsidePlan, tally: _StepTally, layers: int) -> None:
        tally = _on_host(tally)
        for i, row in enumerate(outside_plan.rows.tolist()):
            live = self._live[row]
            cols = outside_plan.valid[i]
            logical = outside_plan.logical[i][cols]
            live.outside_mass[logical] = torch.maximum(live.outside_mass[logical], tally.outside_mass[i][cols])
            read = tally.outside_read[i][cols]
            live.guarded[logical[read]] = True
            reads = int(tally.pages_guard_read[i])
            live.counts.guard_checks += layers
            live.counts.guard_reads += int(tally.guard_reads[i])
            live.counts.pages_guard_read += reads
            live.counts.pages_attended += reads
            live.counts.pages_estimated += int(tally.pages_estimated[i])

    def _fold_tally(self) -> None:
        """Once per step: the tally into each request's accumulators."""
        tally, exact = self._tally, self._exact
        if tally is None:
            return
        tally = _on_host(tally)  # one copy per step from the layers' device
        guard_off = 0
        for b, live in enumerate(self._live):
            if live.tracked is None:
                continue
            live.counts.pages_dense += live.tokens.numel() * self._step_layers
            if tally.bound_mass is not None and live.bounds_unread:
                num = live.tokens.numel()
                torch.maximum(live.outside_mass, tally.bound_mass[guard_off, :num], out=live.outside_mass)
                guard_off += 1
            if tally.layers == 0:
                continue
            listed = exact.logical[b]
            live.mass[listed] = tally.exact_mass[b, : listed.numel()]
            live.layers[listed] += tally.layers
            live.counts.pages_attended += listed.numel() * tally.layers
            live.counts.pages_read_from_host += int(_released_among(live.pages, listed).sum()) * tally.layers
        if tally.layers and not self._outside.empty:
            self._fold_outside(self._outside, tally, layers=tally.layers)

    @staticmethod
    def _rescaled(result, share: torch.Tensor) -> torch.Tensor:
        kv = result.importance_per_kv_head.shape[-1]
        group_share = share.view(share.shape[0], kv, -1).mean(-1)  # [bs, kv]
        return (result.importance_per_kv_head * group_share[:, None, :]).mean(-1)

    # -- after the last layer ------------------------------------------------------

    def end_step(self) -> HotSetCounts:
        """Fold the step into each long request's state, then plan the next step:
        release what it leaves out, promote what it adds. Returns the step's counts."""
        step = HotSetCounts()
        ps = self.page_size
        self._fold_tally()
        for live in self._live:
            if live.tracked is None:
                continue
            state = live.tracked.state
            attended = live.layers > 0
            mass = torch.zeros_like(live.mass)
            if state.params.ranks_by_max:
                mass[attended] = live.mass[attended]
            else:
                mass[attended] = live.mass[attended] / live.layers[attended].double()
            late = live.guarded.clone()
            late[live.planned] = False
            state.observe(attended, mass, live.outside_mass, needed=late)
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
                pools, moves = self.released.pools, self.released.counts
                keep = torch.zeros(num_pages, dtype=torch.bool)
                keep[plan] = True
                # Only full pages leave: the last one is still being written.
                full = torch.arange(num_pages) < length // ps
                live.pages.release(torch.nonzero(full & ~keep).flatten(), pools, moves)
                live.pages.restore(plan, self._promoting(), moves, note_refusal=False)
        if self.released.counts.pages_released:
            self.released.reopen = True
        step.add_release(self.released.take_counts())
        self._live = []
        self._exact = self._outside = self._pending = self._tally = None
        self.totals.add(step)
        return step


def _on_host(tally: _StepTally) -> _StepTally:
    """The tally with its tensors on the host, where the requests' state lives."""
    return replace(
        tally, **{f.name: v.cpu() for f in fields(tally) if isinstance(v := getattr(tally, f.name), torch.Tensor)}
    )


def _merge(lse_a, out_a, lse_b, out_b):
    """Two softmax parts over disjoint tokens, as one."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    wa = torch.where(torch.isfinite(lse_a), torch.exp(lse_a - safe), 0.0)[..., None]
    wb = torch.where(torch.isfinite(lse_b), torch.exp(lse_b - safe), 0.0)[..., None]
    return lse, wa * out_a + wb * out_b


def _released_among(pages: Optional[RequestPages], wanted: torch.Tensor) -> torch.Tensor:
    held = torch.zeros(wanted.numel(), dtype=torch.bool)
    if pages is not None and pages.released.numel():
        inside = wanted < pages.released.numel()
        held[inside] = pages.released[wanted[inside]]
    return held
