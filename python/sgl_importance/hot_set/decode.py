"""One decode step over hot sets: plan per request, attend per layer, guard, observe.

The granularity is the *step*: a request attends over the same planned pages in
every layer of a step. SGLang stores all layers of a page in one physical page, so
what a device can hold — and what milestone 2 releases and copies back — is a page
across all layers; a per-layer set would need per-layer residency. Each layer
still checks its own query against the page summaries (the guard), so a page one
layer needs is added for that layer, never missed.

``HotSetDecoder`` is driven by an attention backend: ``begin_step`` once per decode
batch with each request's token slots, ``attend`` once per layer, ``end_step``
after the last layer. Attention is ``sgl_kernel_ext.decode_importance_reference``
over the attended slots, which returns exact masses of the attended pages.
Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch

from sgl_importance.hot_set.guard import pages_to_add
from sgl_importance.hot_set.selection import HotSetCounts, HotSetParams, RequestHotSet
from sgl_importance.hot_set.summaries import PageSummaries
from sgl_kernel_ext import decode_importance_reference


class LayerResult(NamedTuple):
    """One layer's attention over the batch, in the layout the page table takes.

    Attributes:
        output: ``[bs, q_heads, Dv]`` float32.
        importance: ``[bs, max_pages]`` mass per attended page, in attended order.
        kv_indptr, kv_indices: the slots attended (int32 / int64).
    """

    output: torch.Tensor
    importance: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


@dataclass
class _Live:
    """A request of the step in progress."""

    slots: torch.Tensor  # the request's token slots, in sequence order
    state: Optional[RequestHotSet]  # None: short request, attends densely
    planned: Optional[torch.Tensor] = None  # logical pages, ascending
    physical: Optional[torch.Tensor] = None  # physical page of each logical page
    tokens: Optional[torch.Tensor] = None  # tokens in each logical page
    mass_sum: Optional[torch.Tensor] = None
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
        summaries: the page summaries the KV writes keep up to date.
        page_size: tokens per page.
        threshold: requests longer than this many tokens use the hot set.
    """

    def __init__(self, params: HotSetParams, summaries: PageSummaries, *, page_size: int, threshold: int) -> None:
        self.params = params
        self.summaries = summaries
        self.page_size = page_size
        self.threshold = threshold
        self.states: dict[str, RequestHotSet] = {}
        self.totals = HotSetCounts()
        self._live: list[_Live] = []

    def begin_step(self, rids: Sequence[str], slots: Sequence[torch.Tensor]) -> None:
        """Plan the step for the batch's requests (``slots[i]``: request i's token slots)."""
        ps = self.page_size
        # A request absent from the batch finished or was retracted; a retracted
        # one is prefilled again into new pages, so its state would be stale.
        present = set(rids)
        self.states = {rid: s for rid, s in self.states.items() if rid in present}
        self._live = []
        for rid, req_slots in zip(rids, slots):
            req_slots = req_slots.to(torch.int64)
            if req_slots.numel() <= self.threshold:
                self.states.pop(rid, None)
                self._live.append(_Live(req_slots, None))
                continue
            state = self.states.setdefault(rid, RequestHotSet(self.params))
            num_pages = -(-req_slots.numel() // ps)
            physical = torch.div(req_slots[::ps], ps, rounding_mode="floor")
            planned, counts = state.plan(num_pages)
            tokens = torch.full((num_pages,), ps, dtype=torch.int64)
            tokens[-1] = req_slots.numel() - (num_pages - 1) * ps
            f64 = dict(dtype=torch.float64)
            self._live.append(
                _Live(
                    req_slots,
                    state,
                    planned=planned,
                    physical=physical,
                    tokens=tokens,
                    mass_sum=torch.zeros(num_pages, **f64),
                    layers=torch.zeros(num_pages, dtype=torch.int64),
                    bound_mass=torch.zeros(num_pages, **f64),
                    guarded=torch.zeros(num_pages, dtype=torch.bool),
                    counts=counts,
                )
            )

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
            if live.state is None:
                slots = live.slots
                result = _attend(qb, k_buffer, v_buffer, slots, **run)
            else:
                pages = live.planned
                slots = page_slots(live.slots, pages, self.page_size)
                result = _attend(qb, k_buffer, v_buffer, slots, **run)
                bounds = self.summaries.bound(layer_id, q[b], live.physical, sm_scale=sm_scale, logit_cap=logit_cap)
                outside = torch.ones(live.tokens.numel(), dtype=torch.bool)
                outside[pages] = False
                out_idx = torch.nonzero(outside).flatten()
                lse = result.lse[0]
                add = pages_to_add(bounds[out_idx], live.tokens[out_idx], lse, self.params.guard_threshold)
                if add.numel():
                    live.guarded[out_idx[add]] = True
                    pages = torch.sort(torch.cat((pages, out_idx[add]))).values
                    slots = page_slots(live.slots, pages, self.page_size)
                    result = _attend(qb, k_buffer, v_buffer, slots, **run)
                    lse = result.lse[0]
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

    def end_step(self) -> HotSetCounts:
        """Fold the step into each long request's state; returns the step's counts."""
        step = HotSetCounts()
        for live in self._live:
            if live.state is None:
                continue
            attended = live.layers > 0
            mass = torch.zeros_like(live.mass_sum)
            mass[attended] = live.mass_sum[attended] / live.layers[attended].double()
            live.state.observe(attended, mass, live.bound_mass)
            late = live.guarded.clone()
            late[live.planned] = False
            live.counts.steps = 1
            live.counts.late_arrivals = int(late.sum())
            live.counts.guard_fallbacks = int(bool(live.guarded.any()))
            step.add(live.counts)
        self._live = []
        self.totals.add(step)
        return step


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
