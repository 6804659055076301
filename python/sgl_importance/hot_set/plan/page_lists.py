"""Which pages each layer of a hot-set step reads, as lists the kernels take.

- part 1 (``plan_exact``): each request's listed logical pages as physical page ids
  for ``sgl_kernel_ext.plan_paged_decode``; a released page is staged from its host
  copy and gets an id past the pool's last page, and the page-table slots show it as
  the padding slot;
- part 2 (``plan_outside``): the full pages a guarded request does not read exactly
  (its rest), by the guard ids of their key codes, sampled pages first
  (``estimate.OutsidePlan``), and where the sampled ones are (``SamplePlan``);
- what a guarded layer reads, on the layers' device, once per step (``GuardLists``):
  the outside plan, its rest pages' physical ids, thresholds and key ranges of every
  layer, so that no layer builds anything from Python lists or reads a tensor back;
- the ``quest`` baseline's per-layer lists, picked from that layer's query
  (``quest_lists``);
- what reads part 1 (``ExactAttention``, the exact reader's contract) and what a
  layer hands back (``LayerResult``).

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, Sequence

import torch

from sgl_importance.hot_set.guard.estimate import OutsidePlan, on_device
from sgl_importance.hot_set.guard.key_ranges import KeyRanges, key_bound
from sgl_importance.hot_set.plan.request_state import LiveRequest, page_slots, released_among
from sgl_importance.hot_set.plan.selection import quest_layer_pages
from sgl_kernel_ext import DecodeImportanceOutput, PagedDecodePlan, plan_paged_decode


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
    """One layer's attention over the batch, in the layout the page importance table takes.

    Attributes:
        output: ``[bs, q_heads, Dv]`` float32.
        importance: ``[bs, max_pages]`` exact mass of each page read in part 1, in listed
            order, normalised by the step's combined denominator.
        kv_indptr, kv_indices: the slots of those pages (int32 / int64); a page read from
            its host copy appears as the padding page, which the page importance table ignores.
    """

    output: torch.Tensor
    importance: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


@dataclass
class ExactPlan:
    """Part 1 of a layer: the pages each request reads exactly, as the kernel takes them."""

    plan: PagedDecodePlan
    logical: list[torch.Tensor]  # per request: the logical pages listed
    staged_host: torch.Tensor  # host slots of the staged pages, page after page
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


def plan_exact(
    live: Sequence[LiveRequest], lists: Sequence[Optional[torch.Tensor]], pool_pages: int, page_size: int
) -> ExactPlan:
    """Part 1: each request's listed logical pages, as physical or staged page ids.

    The host knows what is listed (logical pages, their token counts, which are
    released); the physical ids come from the requests' slots where they live (the
    device's ``req_to_token`` rows in the server): gathered there, never read back.

    Args:
        live: the requests, in batch order.
        lists: ``lists[i]`` the logical pages request i reads (ascending); None reads
            every page (a short request).
        pool_pages: pages in the layer's pool; staged pages get ids from here on.
        page_size: tokens per page.
    """
    ps = page_size
    ids, tokens, logical, staged, slot_lists = [], [], [], [], []
    staged_pages = 0
    for req, listed in zip(live, lists):
        length = req.slots.numel()
        num_pages = -(-length // ps)
        if listed is None:
            listed = torch.arange(num_pages)
        logical.append(listed)
        dev = req.slots.device
        physical = torch.div(req.slots[(listed * ps).to(dev)], ps, rounding_mode="floor").to(torch.int64)
        count = torch.full((listed.numel(),), ps, dtype=torch.int64)
        if listed.numel() and int(listed[-1]) == num_pages - 1:
            count[-1] = length - (num_pages - 1) * ps
        held = released_among(req.pages, listed)
        req_slots = page_slots(req.slots, listed, ps)
        if bool(held.any()):  # host state: which listed pages are released
            where = torch.nonzero(held).flatten()
            ids_staged = pool_pages + staged_pages + torch.arange(where.numel())
            physical = physical.index_put((where.to(dev),), ids_staged.to(dev))
            staged_pages += where.numel()
            staged.append(req.pages.host_slots(listed[held]))
            # Slots for the page importance table: a staged page shows the padding slot.
            mask = held.repeat_interleave(count)
            req_slots = torch.where(mask.to(dev), 0, req_slots)
        ids.append(physical)
        tokens.append(count)
        slot_lists.append(req_slots.to(torch.int64))
    counts = [i.numel() for i in ids]
    indptr = torch.zeros(len(ids) + 1, dtype=torch.int64)
    if ids:
        indptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    device = ids[0].device if ids else torch.device("cpu")
    plan = plan_paged_decode(
        indptr.to(device),
        torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64),
        torch.cat(tokens).to(device) if tokens else torch.zeros(0, dtype=torch.int64),
        page_size=ps,
        max_pages=max(counts, default=0) or 1,  # known here: the plan is never read back
    )
    kv_indptr = torch.zeros(len(slot_lists) + 1, dtype=torch.int32)
    if slot_lists:
        kv_indptr[1:] = torch.cumsum(torch.tensor([s.numel() for s in slot_lists]), 0).to(torch.int32)
    kv_indices = torch.cat(slot_lists) if slot_lists else torch.zeros(0, dtype=torch.int64)
    staged_host = torch.cat(staged) if staged else torch.zeros(0, dtype=torch.int64)
    return ExactPlan(plan, logical, staged_host, kv_indptr.to(device), kv_indices)


def plan_outside(live: Sequence[LiveRequest], lists: Sequence[Optional[torch.Tensor]]) -> OutsidePlan:
    """Part 2: the coded full pages each guarded request does not read exactly (its
    rest), its sampled pages first."""
    rows, codes, logical, sampled, inclusion = [], [], [], [], []
    for i, (req, listed) in enumerate(zip(live, lists)):
        if not req.guard_on or listed is None:
            continue
        tracked = req.tracked
        full = tracked.codes.numel()
        outside = torch.ones(full, dtype=torch.bool)
        outside[listed[listed < full]] = False
        members = tracked.draw.members(full, tracked.sample_pi)
        first = torch.nonzero(outside & members).flatten()
        then = torch.nonzero(outside & ~members).flatten()
        pages = torch.cat((first, then))
        if pages.numel():
            rows.append(i)
            codes.append(tracked.codes[pages])
            logical.append(pages)
            sampled.append(torch.arange(pages.numel()) < first.numel())
            inclusion.append(tracked.sample_pi)
    return OutsidePlan.build(rows, codes, logical, sampled, inclusion)


@dataclass
class SamplePlan:
    """Where the sampled rest pages of a step's outside plan are, ``[n, S]``.

    ``S`` is the most sampled pages of any request (the plan's first columns).
    A sampled page is planned, so resident; one whose promotion was refused is read
    from its host copy (``host_index`` into the flattened table, ``host_slots``).
    """

    physical: torch.Tensor  # int64 [n, S], device page id (0 on padding or host)
    valid: torch.Tensor  # bool [n, S]
    host_index: torch.Tensor  # int64 [k]
    host_slots: torch.Tensor  # int64 [k * page_size]

    @staticmethod
    def build(live: Sequence[LiveRequest], outside: OutsidePlan, page_size: int) -> "SamplePlan":
        width = int(outside.sampled.sum(dim=1).max()) if outside.rows.numel() else 0
        n = outside.rows.numel()
        # Physical ids are gathered where the slots live (the device), never read back.
        physical = torch.zeros(n, width, dtype=torch.int64, device=_slots_device(live))
        valid = outside.sampled[:, :width].clone()
        host_index, host_slots = [], []
        for i, row in enumerate(outside.rows.tolist()):
            req = live[row]
            pages = outside.logical[i, :width][valid[i]]
            held = released_among(req.pages, pages)
            first = req.slots[(pages * page_size).to(req.slots.device)]
            ids = torch.div(first, page_size, rounding_mode="floor").to(torch.int64)
            physical[i, : pages.numel()] = torch.where(held.to(ids.device), 0, ids)
            if bool(held.any()):  # host state
                where = torch.nonzero(held).flatten()
                host_index.append(i * width + where)
                host_slots.append(req.pages.host_slots(pages[held]))
        empty = torch.zeros(0, dtype=torch.int64)
        return SamplePlan(
            physical,
            valid,
            torch.cat(host_index) if host_index else empty,
            torch.cat(host_slots) if host_slots else empty,
        )


@dataclass
class GuardLists:
    """Everything a guarded layer reads besides the pool, built once per step.

    Tensors are on the layers' device (``n`` guarded requests, ``P`` rest columns), so
    that a layer neither plans nor waits on the host: its selection reads chosen columns
    of the fixed ``physical`` list under a mask (``guard_reads.exact_reader``).

    Attributes:
        host: the step's outside plan as planned (on the host; folded at the step's end).
        outside: the same plan on the device.
        sample: the sample plan, its ``physical``/``valid`` on the device.
        physical: int64 ``[n, P]`` each rest page's device page id (0 on padding and on
            pages released to the host pool).
        released: bool ``[n, P]`` rest pages released to the host pool (read from the host
            copy where the reader can, ``guard_reads``; elsewhere a layer wanting one misses it).
        host_table: int64 ``[n, P]`` ``physical`` with each released page named by its host
            page as a staging page (the pool's page count plus its host page): the table a
            reader of the host pool's layer view reads (``guard_reads``), made once a step.
        thresholds: float32 ``[n]`` each request's ``guard_threshold``.
        top_p: float32 ``[n, L]`` each request's ``top_p`` per layer (1 where the layer's cap
            has risen to every page: a layer that keeps flagging reads densely).
        caps: int64 ``[n, L]`` the most rest pages each layer reads exactly (the
            request's read cap for that layer less part 1's pages and its sample).
        range_ids: int64 ``[n, P]`` the rest pages' range ids (``key_ranges.KeyRanges``,
            0 on padding): a layer gathers its own ranges by them (``key_range``), the
            ones their codes were written against.
        empty: no guarded request has a rest page (nothing to guard).
        layer: the one layer the lists were built for (lists that change per layer,
            the ``quest`` baseline's), or None: every layer.
    """

    host: OutsidePlan
    outside: OutsidePlan
    sample: SamplePlan
    physical: torch.Tensor
    released: torch.Tensor
    host_table: torch.Tensor
    thresholds: torch.Tensor
    top_p: torch.Tensor
    caps: torch.Tensor
    range_ids: torch.Tensor
    empty: bool
    layer: Optional[int] = None

    def of_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s ``[n]`` top-p and cap (a step asking more layers than the model has,
        in tests, wraps around)."""
        column = layer % self.caps.shape[1]
        return self.top_p[:, column], self.caps[:, column]

    def key_range(self, ranges: KeyRanges, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s ``[n, P, Hkv, D]`` key min and max of the rest pages (a gather by id)."""
        return ranges.gather(layer, self.range_ids)

    @staticmethod
    def build(
        live: Sequence[LiveRequest],
        outside: OutsidePlan,
        sample: SamplePlan,
        page_size: int,
        device: torch.device,
        num_layers: int,
        pool_pages: int,
        layer: Optional[int] = None,
    ) -> "GuardLists":
        """From the step's plans (on the host), once per step (or for ``layer`` alone);
        ``pool_pages``: the device pool's pages (staged page ids start there)."""
        n, width = outside.logical.shape
        empty = outside.empty  # decided on the host plan: no device value is read
        # Physical ids are gathered where the slots live (the device), never read back.
        physical = torch.zeros(n, width, dtype=torch.int64, device=_slots_device(live))
        released = torch.zeros(n, width, dtype=torch.bool)
        host_ids = torch.zeros(n, width, dtype=torch.int64)
        thresholds, top_p, caps = [], [], []
        range_ids = torch.zeros(n, width, dtype=torch.int64)
        for i, row in enumerate(outside.rows.tolist()):
            req = live[row]
            cols = outside.valid[i]
            pages = outside.logical[i][cols]
            held = released_among(req.pages, pages)
            first = req.slots[(pages * page_size).to(req.slots.device)]
            ids = torch.div(first, page_size, rounding_mode="floor").to(torch.int64)
            physical[i, : pages.numel()] = torch.where(held.to(ids.device), 0, ids)  # valid columns come first
            released[i, : pages.numel()] = held
            if bool(held.any()):  # host state
                host_ids[i, : pages.numel()][held] = pool_pages + req.pages.host_page[pages[held]]
            params = req.tracked.state.params
            thresholds.append(params.guard_threshold)
            sampled = int(outside.sampled[i].sum())
            caps.append(req.tracked.rest_caps(req.tokens.numel(), req.planned.numel(), sampled, num_layers))
            top_p.append(torch.where(req.tracked.caps >= 1.0, 1.0, params.top_p))
            range_ids[i, : pages.numel()] = req.tracked.ranges[pages]
        move = lambda t: on_device(t, device)  # noqa: E731
        released, host_ids, physical = move(released), move(host_ids), move(physical)
        return GuardLists(
            host=outside,
            outside=OutsidePlan(*(move(getattr(outside, f)) for f in outside.__dataclass_fields__)),
            sample=SamplePlan(move(sample.physical), move(sample.valid), sample.host_index, sample.host_slots),
            physical=physical,
            released=released,
            host_table=torch.where(released, host_ids, physical),
            thresholds=torch.tensor(thresholds, dtype=torch.float32, device=device),
            top_p=move(torch.stack(top_p).float() if top_p else torch.zeros(0, num_layers)),
            caps=move(torch.stack(caps) if caps else torch.zeros(0, num_layers, dtype=torch.int64)),
            range_ids=move(range_ids),
            empty=empty,
            layer=layer,
        )


def quest_lists(
    live: Sequence[LiveRequest],
    ranges: KeyRanges,
    layer_id: int,
    q: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float,
) -> list[Optional[torch.Tensor]]:
    """The ``quest`` baseline picks each layer's pages from that layer's query (a loop
    over its requests); the other requests keep their planned lists."""
    lists: list[Optional[torch.Tensor]] = []
    for b, req in enumerate(live):
        listed = req.planned
        if req.tracked is not None and req.tracked.state.params.policy == "quest" and req.counts.warmups == 0:
            # Every page: full ones by their range id, the partial last (in the window,
            # never ranked) by the padding id's empty range.
            ids = torch.zeros(req.tokens.numel(), dtype=torch.int64)
            ids[: req.tracked.ranges.numel()] = req.tracked.ranges[: ids.numel()]
            bounds = key_bound(q[b], *ranges.gather(layer_id, ids), sm_scale=sm_scale, logit_cap=logit_cap)
            listed = quest_layer_pages(bounds.cpu(), req.tracked.state.params)  # planned on the host
        lists.append(listed)
    return lists


def _slots_device(live: Sequence[LiveRequest]) -> torch.device:
    """Where the step's slots live (the device's ``req_to_token`` rows in the server)."""
    return live[0].slots.device if live else torch.device("cpu")
