"""One decode step over hot sets: plan per request, attend per layer, guard, observe.

The granularity is the *step*: a request reads the same planned pages exactly in every layer
(SGLang stores all layers of a page in one page, which ``residency.py`` moves). The ``quest``
baseline keeps every page on the device and picks each layer's from its query (``quest_lists``).

A layer attends in up to two parts, one batched call each for the whole batch:

1. part 1 exactly (``sgl_kernel_ext.decode_importance_paged``; short requests read
   every page here): the planned pages of an unguarded request; the sinks, window and
   not-yet-coded pages of a guarded one (``page_lists.plan_exact``);
2. with the guard on (``guard_threshold < 1``), every other full page of a long
   request (its *rest*) through its 4-bit key codes (``estimate.estimate_outside``):
   the pages its query heads want by top-p are read exactly, at most the layer's read
   cap and only where they are on the device (a released one is a miss, promoted for
   later steps); the rest is estimated from the request's page sample (resident, read
   page by page, ``estimate.sampled_pages``) with the smaller of a deterministic and a
   statistical bound on the layer's output error; a bound over the threshold flags the
   layer-step and raises that layer's cap for the request's later steps
   (``guard.layer.guard_layer``, ``request_state.TrackedRequest.follow_flags``).

The step's lists are planned on the host once, where it begins, and the guard's put on the
layers' device (``page_lists.GuardLists``): no layer reads a device value back or a host copy.
Full pages are summarised once, before any release (``coding.py``; a streamed prompt's as it
prefills, ``prefill.py``, which also seeds a first step from the prefill).

A backend drives it: ``begin_step`` per decode batch, ``attend`` per layer, ``end_step``
after the last (or ``plan_step``, a ``graph.step.GraphStep``'s layers, then ``end_step``),
which plans the *next* step (or the one after, a step late) and returns, as data
(``pages.state.PageMoves``), the pages that plan leaves out and the released ones it keeps,
moved by the residency owner between steps. A planned page with no device page is read from
its host copy (staged before the layers), counted. Exact pages get exact masses; rest pages
masses estimated from their key codes (guard off: their key bound), ranking them for
promotion; tallied as tensors, folded into each request once per step (``step_tally.py``).

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from sgl_importance.hot_set.coding import summarise_pages
from sgl_importance.hot_set.guard.estimate import (
    OutsidePlan,
    Sampled,
    estimate_outside,
    estimate_outside_ranged,
    sampled_pages,
)
from sgl_importance.hot_set.guard.key_codes import GuardPool
from sgl_importance.hot_set.guard.key_ranges import KeyRanges
from sgl_importance.hot_set.guard.layer import GuardOutcome, guard_layer, part_share, read_rest, weigh_bounds_triton
from sgl_importance.hot_set.guard_reads import exact_reader, host_pages, pages_of, reads_with_kernel
from sgl_importance.hot_set.pages.footprint import PageBytes, held_bytes
from sgl_importance.hot_set.pages.state import MoveReason, PageMoves, RequestMoves
from sgl_importance.hot_set.params import HotSetParams
from sgl_importance.hot_set.plan.page_lists import (
    ExactAttention,
    ExactPlan,
    GuardLists,
    LayerResult,
    SamplePlan,
    plan_exact,
    plan_outside,
    quest_lists,
)
from sgl_importance.hot_set.plan.request_state import LiveRequest, TrackedRequest, plan_moves
from sgl_importance.hot_set.plan.sample import PageDraw, request_seed
from sgl_importance.hot_set.plan.selection import HotSetCounts, RequestHotSet
from sgl_importance.hot_set.plan.step_tally import StepTally, shared_masses
from sgl_importance.hot_set.prefill import apply_seed
from sgl_importance.hot_set.record import LongRequest
from sgl_importance.hot_set.request_params import RequestParams
from sgl_importance.hot_set.residency import Residency
from sgl_kernel_ext import DecodeImportanceOutput, PagedDecodeWorkspace, decode_importance_paged, masked_page_parts


class HotSetDecoder:
    """Hot-set decode for the requests of one model runner.

    Args:
        params: the policy and its budget.
        ranges: the key-range pool the full pages' ranges are written into (fixed).
        pool_pages: pages of the device KV pool (its padding page 0 included).
        page_size: tokens per page.
        threshold: requests longer than this many tokens use the hot set.
        residency: the process's page records and their owner (the runtime's; a private
            one when None); requests it admitted give back device pages outside their hot
            set, moved by the owner from what ``end_step`` returns.
        request_params: parameters requests chose for themselves
            (the runtime's; a private, empty one when None); others decode with ``params``.
        guard: the guard's key-code pool (allocated once at start-up by the backend;
            default: as many pages as ``ranges`` holds, created on first use).
        exact: what reads pages exactly (default: ``decode_importance_paged``).
    """

    def __init__(
        self,
        params: HotSetParams,
        ranges: KeyRanges,
        *,
        pool_pages: int,
        page_size: int,
        threshold: int,
        residency: Optional[Residency] = None,
        request_params: Optional[RequestParams] = None,
        guard: Optional[GuardPool] = None,
        exact: Optional[ExactAttention] = None,
    ) -> None:
        self.params = params
        self.request_params = request_params if request_params is not None else RequestParams()
        self.ranges = ranges
        self.pool_pages = pool_pages
        self.page_size = page_size
        self.threshold = threshold
        self.residency = residency if residency is not None else Residency()
        self._guard = guard
        self.seed_first_step = False  # --hot-set-first-step seeded: the extend seeds its records (prefill.seed_layer)
        self.prefill_counts = HotSetCounts()  # what streamed prefills counted, added at the next end_step
        self.totals = HotSetCounts()
        self._live: list[LiveRequest] = []
        # The eager step's lists and tally (plan_lists), dropped by fold_step.
        self._exact: Optional[ExactPlan] = None
        self._outside: Optional[OutsidePlan] = None
        self._sample: Optional[SamplePlan] = None
        self._guard_lists: Optional[GuardLists] = None
        self._tally: Optional[StepTally] = None
        self._pool_pages_planned = 0
        self._step_layers = 0
        self.pool_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (K, V) viewed as pages
        self._workspace = PagedDecodeWorkspace()
        self.exact = exact or self._read_paged  # what reads pages exactly (the guard's reads too)
        self.last_guard: Optional[GuardOutcome] = None
        # F(request) summed over the last step's tracked requests (footprint.held_bytes).
        self.held_bytes = 0

    @property
    def tracked(self) -> dict[str, TrackedRequest]:
        return self.residency.tracked()

    def track(self, rid: str) -> LongRequest:
        """``rid``'s record, its selection part made with its settings where it has none."""
        record = self.residency.open(rid)
        if record.tracked is None:
            params = self.request_params.get(rid, self.params)
            record.tracked = TrackedRequest(RequestHotSet(params), draw=PageDraw(request_seed(rid)))
        return record

    @property
    def guard(self) -> GuardPool:
        if self._guard is None:  # a decoder built without one (tests): a row per range row
            self._guard = GuardPool.beside(self.ranges, self.page_size)
        return self._guard

    # -- planning, once per step ---------------------------------------------------

    def begin_step(
        self,
        rids: Sequence[str],
        slots: Sequence[torch.Tensor],
        rows: Optional[Sequence[torch.Tensor]] = None,
    ) -> None:
        """Plan the step for the batch's requests: ``slots``, request i's token slots (released
        pages show the padding slot); ``rows``, its ``req_to_token`` row (a view) where pages
        may be released (None keeps every page on the device)."""
        self.plan_step(rids, slots, rows)
        self.plan_lists()

    def plan_step(
        self,
        rids: Sequence[str],
        slots: Sequence[torch.Tensor],
        rows: Optional[Sequence[torch.Tensor]] = None,
    ) -> list[LiveRequest]:
        """``begin_step``'s plan per request, without the eager step's lists (a
        ``graph.step.GraphStep`` writes its own); returns the step's requests."""
        ps = self.page_size
        # A request absent from the batch finished or was retracted; a retracted
        # one is prefilled again into new pages, so its state would be stale.
        self.drop_absent(set(rids))
        self._live = []
        for i, (rid, req_slots) in enumerate(zip(rids, slots)):
            # Slots stay where they are (the device's row in the server): the plan
            # gathers from them, the host never reads them.
            if req_slots.numel() <= self.threshold:
                self.forget_request(rid)
                self._live.append(LiveRequest(req_slots, None))
                continue
            record = self.track(rid)
            tracked, record.prefilling = record.tracked, False
            pages = None
            if rows is not None and self.residency.enabled:
                pages = record.pages  # admitted by the scheduler, or None
            num_pages = -(-req_slots.numel() // ps)
            if pages is not None:
                req_slots = rows[i][: req_slots.numel()]
            if record.seed is not None:  # its first step, planned from its prefill
                apply_seed(self, rid, LiveRequest(req_slots, tracked, pages=pages), num_pages)
            plan, counts = tracked.take_plan(num_pages)
            tracked.seeded = False
            self._live.append(LiveRequest.begin(req_slots, tracked, pages, plan, counts, ps))
        self._step_layers = 0
        return self._live

    def plan_lists(self, pool_pages: Optional[int] = None) -> None:
        """The planned step's part 1 and part 2 lists and its tally, built once where the
        eager step begins (the layers only read them). ``pool_pages``: the device pool's
        pages (listed ids at or past it name staged host pages; default ``pool_pages``)."""
        pool_pages = self.pool_pages if pool_pages is None else pool_pages
        planned = [live.planned for live in self._live]
        ps = self.page_size
        self._exact = plan_exact(self._live, planned, pool_pages, ps)
        self._outside = plan_outside(self._live, planned)
        self._sample = SamplePlan.build(self._live, self._outside, ps)
        device = self.ranges.device
        layers = self.ranges.num_layers
        self._guard_lists = GuardLists.build(self._live, self._outside, self._sample, ps, device, layers, pool_pages)
        prepare = getattr(self.exact, "slots", None)  # a Triton reader: the tally runs its kernel too
        run = dict(page_size=ps, kv_heads=self.ranges.num_kv_heads, use_triton=prepare is not None)
        self._tally = StepTally.for_step(self._live, self._exact, self._outside, device, layers, **run)
        self._pool_pages_planned = pool_pages
        if prepare is not None:
            # A reader that turns the plan into device lists (TritonPageListDecode) does it
            # here, once per step, rather than in the first layer; the host says whether
            # pages are staged, so the device plan is never read back.
            prepare(self._exact.plan, pool_pages, device, staged=self._exact.staged_host.numel() > 0)

    def forget_request(self, rid: str) -> None:
        """End ``rid``'s selection part (and its seed), its pool rows back."""
        record = self.residency.record(rid)
        if record is None:
            return
        tracked, record.tracked, record.seed, record.prefilling = record.tracked, None, None, False
        self.residency.close_if_empty(rid)
        if tracked is not None:
            self.ranges.free(tracked.ranges)
            if tracked.codes.numel():
                self.guard.free(tracked.codes)

    def drop_absent(self, rids: Sequence[str]) -> None:  # begin_step's rule, for a step without it (a CUDA graph's)
        for rid in self.residency.absent(rids):
            self.forget_request(rid)

    def shrink(self) -> PageMoves:
        """Every hot set the guard grew (``TrackedRequest.kept``) back to its budget for good, its
        next step planned again: per such request, the full pages that plan leaves out (for the
        residency owner to release now: SGLang is about to retract for want of room)."""
        moves = PageMoves(reason=MoveReason.SHRINK)
        for rid, tracked in self.tracked.items():
            if tracked.kept is None or not self.residency.admitted(rid) or tracked.next_plan is None:
                continue
            tracked.kept, tracked.grows, num_pages = None, False, tracked.next_plan[0]
            plan, counts = tracked.plan_pages(num_pages)
            tracked.next_plan = (num_pages, plan, counts)
            moves.requests.append(RequestMoves(rid, release=plan_moves(rid, plan, num_pages, num_pages - 1).release))
        return moves

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
        ps = self.page_size
        k_pages, v_pages = self.pool_as_pages(layer_id, k_buffer, v_buffer)
        if k_pages.shape[0] != self._pool_pages_planned:
            # A pool whose rows end in a partial page (never SGLang's paged pools): the
            # staged pages' ids start at its whole pages, so plan the lists again.
            self.plan_lists(k_pages.shape[0])
        exact, guard_lists = self._exact, self._guard_lists
        per_layer = any(live.tracked is not None and live.tracked.state.params.policy == "quest" for live in self._live)
        if per_layer:
            exact, outside_plan = self._quest_layer(layer_id, q, k_pages.shape[0], sm_scale, logit_cap)
            sample_plan = SamplePlan.build(self._live, outside_plan, ps)
            layers = self.ranges.num_layers
            guard_lists = GuardLists.build(
                self._live, outside_plan, sample_plan, ps, q.device, layers, k_pages.shape[0], layer=layer_id
            )
        run = dict(sm_scale=sm_scale, logit_cap=logit_cap)
        extra_k, extra_v = self._staged(layer_id, exact.staged_host)
        result = self.exact(
            q, k_pages, v_pages, exact.plan, sinks=sinks, extra_k_pages=extra_k, extra_v_pages=extra_v, **run
        )
        output = result.output
        share = None  # part 1's share of the combined denominator: all of it, unless a guard combined
        if not guard_lists.empty:
            output = output.clone()
            rows = guard_lists.outside.rows
            guarded, rows_share = self._guard_layer(layer_id, q, k_pages, v_pages, result, guard_lists, run, per_layer)
            output[rows] = guarded.to(output.dtype)
            if rows_share is not None:
                share = q.new_ones(q.shape[:2], dtype=torch.float32)
                share[rows] = rows_share
        self._tally.add_exact(self._live, layer_id, q, result, exact, share, run, per_layer, self.ranges)
        self._step_layers += 1
        masses = shared_masses(result.importance_per_kv_head, share)
        return LayerResult(output, masses, exact.kv_indptr, exact.kv_indices)

    def pool_as_pages(self, layer_id: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor):
        """The layer's pool viewed as pages (kept: ``end_step`` codes full pages from it)."""
        whole = k_buffer.shape[0] // self.page_size * self.page_size  # rows past the last whole page are no page
        pages = tuple(b[:whole].view(-1, self.page_size, *b.shape[1:]) for b in (k_buffer, v_buffer))
        self.pool_views[layer_id] = pages
        return pages

    def _page_bytes(self) -> PageBytes:
        """One page's device bytes (all layers): its KV in the pool, its range and code rows."""
        kv = sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size() for k, v in self.pool_views.values())
        return PageBytes(kv, self.ranges.row_bytes, self.guard.bytes_per_page())

    def _staged(self, layer_id: int, host_slots: torch.Tensor):
        if host_slots.numel() == 0:
            return None, None
        k, v = self.residency.read_host(layer_id, host_slots)
        return tuple(x.view(-1, self.page_size, *x.shape[1:]) for x in (k, v))

    def _read_paged(self, q, k_pages, v_pages, plan, **kwargs) -> DecodeImportanceOutput:
        return decode_importance_paged(q, k_pages, v_pages, plan, workspace=self._workspace, **kwargs)

    def _quest_layer(
        self, layer_id: int, q: torch.Tensor, pool_pages: int, sm_scale: float, logit_cap: float
    ) -> tuple[ExactPlan, OutsidePlan]:
        """Quest picks each layer's pages from that layer's query: that layer's part 1 and 2."""
        lists = quest_lists(self._live, self.ranges, layer_id, q, sm_scale=sm_scale, logit_cap=logit_cap)
        return plan_exact(self._live, lists, pool_pages, self.page_size), plan_outside(self._live, lists)

    def _sample_pages(self, layer_id: int, q_rows, k_pages, v_pages, sample: SamplePlan, run, kernels: bool) -> Sampled:
        """The sampled pages' own parts, each page read on its own: on the Triton backend
        from the pool in one launch (``masked_page_parts``, a captured step's) where every
        sampled page is on the device; else gathered, host copies put in where released."""
        if kernels and sample.host_index.numel() == 0:  # known on the host when the step was planned
            return Sampled(*masked_page_parts(q_rows, k_pages, v_pages, sample.physical, sample.valid, **run))
        read = self.residency.read_host
        keys, values = pages_of(read, layer_id, k_pages, v_pages, sample.physical, sample.host_index, sample.host_slots)
        return sampled_pages(q_rows, keys, values, sample.valid, **run)

    def _guard_layer(self, layer_id, q, k_pages, v_pages, result, lists: GuardLists, run, per_layer: bool):
        """Part 2: the rest pages' intervals, the selection's pages read, the rest estimated.
        Returns the guarded rows' output and part 1's share of their chosen denominator
        (None: the kernels scaled the rows' masses in ``result`` already).

        Everything it reads was put on the layers' device with the step's lists
        (``GuardLists``): it reads no value back to the host. On the Triton backend it runs
        a captured step's kernels (``read_rest`` and ``weigh_bounds_triton``, as ``graph.guard.GraphGuard``);
        elsewhere torch, whose reader reads a wanted released page from its host copy where
        it lies (``guard_reads``)."""
        plan = lists.outside
        rows = plan.rows
        q_rows = q[rows]
        layers = self.ranges.num_layers
        tally = self._tally if not per_layer else StepTally.for_outside(lists.host, plan.rows.device, layers)
        kernels = reads_with_kernel(self)
        if kernels:  # the range tables read by id inside the key codes' launch
            tables = (self.ranges.key_min[layer_id], self.ranges.key_max[layer_id])
            outside = estimate_outside_ranged(q_rows, self.guard, layer_id, plan, tables, lists.range_ids, **run)
        else:
            ranges = lists.key_range(self.ranges, layer_id)
            outside = estimate_outside(q_rows, self.guard, layer_id, plan, *ranges, **run)
        sampled = self._sample_pages(layer_id, q_rows, k_pages, v_pages, lists.sample, run, kernels)
        host = host_pages(self, layer_id, k_pages)
        reader = exact_reader(self, layer_id, q, k_pages, v_pages, lists, run, host)
        lse, part1 = result.lse[rows], result.output[rows]
        selection = (*lists.of_layer(layer_id), reader)
        if kernels:
            rest = (outside, sampled, plan.valid, plan.sampled, plan.inclusion, lists.released)
            reads = read_rest(lse, part1, *rest, *selection, use_triton=True)
            out, per_kv = torch.empty_like(part1), result.importance_per_kv_head[rows]
            ends = dict(tally=tally.guard, output=out, per_kv=per_kv, layer=layer_id % layers, layers=layers)
            weigh_bounds_triton(reads, outside, plan.valid, plan.sampled, lists.thresholds, lse, part1, **ends)
            result.importance_per_kv_head[rows] = per_kv
            share = None
        else:
            estimate = (outside, sampled, plan.valid, plan.sampled, plan.inclusion, lists.thresholds, lists.released)
            outcome = guard_layer(lse, part1.float(), *estimate, *selection, from_host=host is not None)
            self.last_guard = outcome  # what the layer's guard did (benchmarks read its bound)
            tally.add_guard(outcome, plan, layer_id, lists.released)
            out, share = outcome.combined.output, part_share(lse, outcome.combined.lse)
        if per_layer:
            tally.fold_outside(self._live, lists.host, layers=1)
        return out, share

    # -- after the last layer ------------------------------------------------------

    def fold_step(self) -> list[LiveRequest]:
        """An eager step's tally into its requests; the step's lists dropped. Returns its requests."""
        if self._tally is not None:
            self._tally.fold(self._live, self._exact, self._outside, self._step_layers)
        live, self._live = self._live, []
        self._exact = self._outside = self._sample = self._tally = self._guard_lists = None
        return live

    def end_step(self, step_live: Optional[list[LiveRequest]] = None, ahead: Sequence[int] | int = 1) -> "StepResult":
        """Fold a step into each long request's state, code its newly full pages, then plan
        the step ``ahead`` steps on. Returns the step's counts (with the owner's page moves
        since the last step) and what that plan wants moved: the full pages it leaves out,
        the released ones it reads. ``step_live``: a step folded already (``fold_step``,
        ``GraphStep.fold``), perhaps ended a step late (``--hot-set-plan-ahead``, ``ahead``
        2, or one per request: a request dropped since gives its counts only); None: the
        eager step just run."""
        step_live = self.fold_step() if step_live is None else step_live
        aheads = [ahead] * len(step_live) if isinstance(ahead, int) else list(ahead)
        step, moves = HotSetCounts(), PageMoves()
        held, page = 0, self._page_bytes()
        ps = self.page_size
        current = {id(tracked) for tracked in self.tracked.values()}
        for live, ahead in zip(step_live, aheads):
            if live.tracked is None:
                continue
            if id(live.tracked) not in current:  # left since it ran: its counts only
                step.add(live.counts)
                continue
            state = live.tracked.state
            attended = live.layers > 0
            mass = torch.zeros_like(live.mass_over_layers)
            if state.params.ranks_by_max:
                mass[attended] = live.mass_over_layers[attended]
            else:
                mass[attended] = live.mass_over_layers[attended] / live.layers[attended].double()
            late = live.guarded.clone()  # wanted by some layer outside the hot set: promotion candidates
            late[live.kept] = False
            state.observe(attended, mass, live.outside_mass, needed=late)
            if live.flagged is not None:
                live.tracked.follow_flags(live.flagged, live.wanted, live.tokens.numel(), missed=live.missed())
            live.counts.steps = 1
            live.counts.late_arrivals = int(late.sum())
            length = live.slots.numel()
            # The pages full now, while on the device (a history never loaded back: its host copies).
            host = self.residency.read_host
            refused = summarise_pages(self.ranges, self.guard, live, length // ps, self.pool_views, ps, host)
            live.counts.ranges_refused, live.counts.guard_refused, live.counts.ranges_regained = refused
            step.add(live.counts)
            # The step ``ahead`` decodes that many more tokens: plan it now.
            num_pages = -(-(length + ahead) // ps)
            plan, counts = live.tracked.plan_pages(num_pages)
            live.tracked.next_plan = (num_pages, plan, counts)
            # F(request) during this step: its pages on the device, its pool rows.
            on_device = live.tokens.numel()
            if live.pages is not None:
                on_device -= int(live.pages.off_device(torch.arange(on_device)).sum())
            held += held_bytes(on_device, live.tracked.ranges.numel(), live.tracked.codes.numel(), page)
            if live.pages is not None:  # only full pages leave: the last one is still being written
                moves.requests.append(plan_moves(live.pages.owner, plan, num_pages, length // ps))
        step.add(self.residency.take_counts())
        step.add(self.prefill_counts)
        self.prefill_counts = HotSetCounts()
        self.held_bytes = held
        self.totals.add(step)
        return StepResult(step, moves)


class StepResult(NamedTuple):
    """What a step hands back: its counts and the page moves the next step wants."""

    counts: HotSetCounts
    moves: PageMoves
