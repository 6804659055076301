"""The guard inside a captured hot-set step: issue 46's selection over lists of fixed shape.

A guarded layer (``decode.HotSetDecoder._guard_layer``) already runs on ``[n, P]`` lists
with no host read (``guard.layer.guard_layer``); what a graph cannot take is that ``n`` (the
guarded requests), ``P`` (their rest pages) and ``S`` (their samples) change every step.
``GraphGuard`` holds the lists at the step's capacity instead: every batch row is a row
(one with no rest lists nothing), ``P`` is the longest context's pages and ``S`` a fixed
sample capacity, written between steps from the decoder's plan (``page_lists.plan_outside``,
``TrackedRequest.rest_caps``: what the eager step builds) with one copy per buffer, the
pages' physical ids gathered in the step's prologue. Per layer, inside the graph: the key
codes' estimate of every rest page, the sample read page by page, the selection (top-p, at
most the cap, one read of the chosen pages), the bound and the flag, as the eager layer
does; the output of a row without a rest is its exact part's. What the layers find is
kept in one float64 tally, copied to the host once with the step's (``read_back``).

On the Triton backend (``triton``) the layer is the kernels a GPU runs, fused where torch
glue stood (under the interpreter on a CPU), twelve launches: the key codes' pass reading each
page's range from the range tables and its value norms by code row (``key_code_pages_ranged``),
the sampled pages' own parts from the pool (``masked_page_parts``), the selection by bisection
(``guard_select_triton``, three), the masked read and its split merge (two), the read part
merged into part 1 and the sampled estimate with its masks inside (``combine_rest_triton``,
two), and the end of the layer, its output into SGLang's buffer, its importance rescaled and its
tally row, in three (``guard_finish_triton``: the bound per head, the choice, the masses per
page block): ``guard.layer.weigh_bounds_triton``, the eager Triton
step's layer too. Elsewhere, torch (``guard.layer.guard_layer`` and ``step_tally.keep_in_tally``:
the reference the kernels are tested against).

Refused (the batch runs eagerly, counted): a guarded request's first step (its dense
warm-up seeds the read caps from per-layer top-p counts), a sample larger than the
capacity, a sampled page with no device page.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from sgl_importance.hot_set.guard.estimate import (
    OutsidePlan,
    Sampled,
    estimate_outside,
    estimate_outside_ranged,
    sampled_pages,
)
from sgl_importance.hot_set.guard.key_codes import GuardPool
from sgl_importance.hot_set.guard.key_ranges import KeyRanges
from sgl_importance.hot_set.guard.layer import guard_layer, part_share, read_rest, weigh_bounds_triton
from sgl_importance.hot_set.plan.page_lists import plan_outside
from sgl_importance.hot_set.plan.request_state import LiveRequest, released_among
from sgl_importance.hot_set.plan.sample import FRACTION, MIN_PAGES
from sgl_importance.hot_set.plan.step_tally import fold_guard, guard_rows, keep_in_tally, kv_group_share
from sgl_kernel_ext import (
    DecodeImportanceOutput,
    decode_importance_paged,
    masked_page_attention,
    masked_page_parts,
    plan_from_table,
)

# Columns of the int64 lists: logical page, guard id, range id, flags (valid, sampled, released).
LOGICAL, CODES, RANGES, FLAGS = range(4)
VALID, SAMPLED, RELEASED = 1, 2, 4


def sample_capacity(pages: int) -> int:
    """Sampled pages a row holds: twice the most a request of ``pages`` pages expects
    (``sample.inclusion`` is at most ``max(FRACTION, MIN_PAGES / pages)``) and 16 (the draw is
    Bernoulli); a request sampling more runs eagerly, counted."""
    return min(pages, 2 * max(math.ceil(pages * FRACTION), MIN_PAGES) + 16)


class GraphGuard:
    """The guard's fixed-shape lists and tally for a ``graph.step.GraphStep`` (see the module docstring)."""

    def __init__(
        self,
        rows: int,
        pages: int,
        *,
        num_layers: int,
        page_size: int,
        pool: GuardPool,
        ranges: KeyRanges,
        device: torch.device,
        triton: bool,
    ) -> None:
        self.rows, self.pages, self.num_layers, self.page_size = rows, pages, num_layers, page_size
        self.samples = sample_capacity(pages)
        self.pool, self.ranges, self.device, self.triton = pool, ranges, device, triton
        pinned = device.type == "cuda"
        i64, f32 = dict(dtype=torch.int64), dict(dtype=torch.float32)
        # Host-written: the lists, and per row [inclusion, threshold, top-p per layer, cap per layer];
        # two of each, taken in turn with the step's (``GraphStep.prepare``).
        self._stages = [torch.zeros(rows, 4, pages, pin_memory=pinned, **i64) for _ in range(2)]
        self._lists = torch.zeros(rows, 4, pages, device=device, **i64)
        self._stages_f = [torch.zeros(rows, 2 + 2 * num_layers, pin_memory=pinned, **f32) for _ in range(2)]
        self._params = torch.zeros(rows, 2 + 2 * num_layers, device=device, **f32)
        # Written by the prologue.
        self.physical = torch.zeros(rows, pages, device=device, **i64)
        self.valid = torch.zeros(rows, pages, dtype=torch.bool, device=device)
        self.sampled = torch.zeros(rows, pages, dtype=torch.bool, device=device)
        self.released = torch.zeros(rows, pages, dtype=torch.bool, device=device)
        self.caps = torch.zeros(rows, num_layers, device=device, **i64)
        self.index = torch.arange(rows, device=device)
        # The tally: the eager step's guard rows (step_tally.guard_rows), in float64: the masses
        # rank pages for promotion as the eager step's do (ties included).
        self.tally = guard_rows(rows, pages, num_layers, device)
        self._tally_hosts = [torch.zeros(self.tally.shape, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self._guarded: list[int] = []  # batch rows with a rest (host)

    @property
    def nbytes(self) -> int:
        held = (self._lists, self._params, self.physical, self.valid, self.sampled, self.released, self.caps)
        return sum(t.numel() * t.element_size() for t in (*held, self.index, self.tally))

    # -- between steps (host) ------------------------------------------------------------

    def prepare(self, live: Sequence[LiveRequest], turn: int) -> Optional[str]:
        """Write the batch's guard lists (every row; one with no rest lists nothing) from
        staging buffer ``turn``; returns why it cannot take them instead, None when written
        (and ``guarded``: some row has a rest)."""
        for req in live:
            if req.guard_on and req.tracked.state.step == 0:
                return "warmup"
        plan = plan_outside(live, [req.planned for req in live])
        stage, stage_f = self._stages[turn], self._stages_f[turn]
        stage.zero_()
        stage_f.zero_()
        stage_f[:, 0] = 1.0  # inclusion of rows with nothing sampled (never read)
        stage_f[:, 1] = float("inf")  # no threshold for rows with no rest
        self._guarded = []
        layers = self.num_layers
        for i, b in enumerate(plan.rows.tolist()):
            req = live[b]
            cols = plan.valid[i]
            pages = plan.logical[i][cols]
            n = pages.numel()
            sampled = plan.sampled[i][cols]
            released = released_among(req.pages, pages)
            if n > self.pages:
                return "pages"
            if int(sampled.sum()) > self.samples:
                return "sample"
            if bool((released & sampled).any()):
                return "staged"  # a sampled page is read from the device, never the host
            tracked, params = req.tracked, req.tracked.state.params
            stage[b, LOGICAL, :n] = pages
            stage[b, CODES, :n] = plan.codes[i][cols]
            stage[b, RANGES, :n] = tracked.ranges[pages]
            stage[b, FLAGS, :n] = VALID + SAMPLED * sampled.long() + RELEASED * released.long()
            caps = tracked.rest_caps(req.tokens.numel(), req.planned.numel(), int(sampled.sum()), layers)
            stage_f[b, 0] = float(plan.inclusion[i])
            stage_f[b, 1] = params.guard_threshold
            stage_f[b, 2 : 2 + layers] = torch.where(tracked.caps >= 1.0, 1.0, params.top_p).float()
            stage_f[b, 2 + layers :] = caps.float()
            self._guarded.append(b)
        self._lists.copy_(stage, non_blocking=True)
        self._params.copy_(stage_f, non_blocking=True)
        return None

    @property
    def guarded(self) -> bool:
        """Some row of the prepared batch has a rest (the step needs the guarded graph)."""
        return bool(self._guarded)

    def clear(self) -> None:
        """Every row lists nothing (a graph's capture)."""
        self._lists.zero_()
        self._params.zero_()
        self._guarded = []

    # -- inside the step (what a graph records) -----------------------------------------

    def prologue(self, bs: int, req_to_token: torch.Tensor, rows: torch.Tensor) -> None:
        """The rest pages' physical ids (``rows``: each row's ``req_to_token`` row), the flags, the tally zeroed."""
        ps = self.page_size
        lists = self._lists[:bs]
        flags = lists[:, FLAGS]
        torch.ne(torch.bitwise_and(flags, VALID), 0, out=self.valid[:bs])
        torch.ne(torch.bitwise_and(flags, SAMPLED), 0, out=self.sampled[:bs])
        torch.ne(torch.bitwise_and(flags, RELEASED), 0, out=self.released[:bs])
        firsts = req_to_token[rows[:, None], lists[:, LOGICAL] * ps].to(torch.int64)
        # A released page (or padding) shows SGLang's padding slot: page 0, never read.
        torch.floor_divide(firsts, ps, out=self.physical[:bs])
        self.physical[:bs].mul_(self.valid[:bs] & ~self.released[:bs])
        self.caps[:bs].copy_(self._params[:bs, 2 + self.num_layers :])
        self.tally.zero_()

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        part1: DecodeImportanceOutput,
        out: torch.Tensor,
        *,
        sm_scale: float,
        logit_cap: float,
    ) -> DecodeImportanceOutput:
        """One layer's guard over every row, its output written into ``out`` (the part-1
        output where a row has no rest); returned with part 1's page masses as shares of
        the combined denominator (each KV head's scaled by the mean share its query heads' part 1 holds)."""
        bs = q.shape[0]
        run = dict(sm_scale=sm_scale, logit_cap=logit_cap)
        lists, params = self._lists[:bs], self._params[:bs]
        valid, sampled, released = self.valid[:bs], self.sampled[:bs], self.released[:bs]
        plan = OutsidePlan(self.index[:bs], lists[:, CODES], lists[:, LOGICAL], valid, sampled, params[:, 0])
        if self.triton:  # on the Triton backend the kernels a GPU runs (under the interpreter on a CPU)
            tables = (self.ranges.key_min[layer_id], self.ranges.key_max[layer_id])
            outside = estimate_outside_ranged(q, self.pool, layer_id, plan, tables, lists[:, RANGES], **run)
        else:  # torch (a recording replays torch and Triton only: no C kernel)
            kmin, kmax = self.ranges.gather(layer_id, lists[:, RANGES])
            native = None if self.device.type == "cuda" else False
            outside = estimate_outside(q, self.pool, layer_id, plan, kmin, kmax, use_native=native, **run)
        sample = self._sample(q, k_pages, v_pages, sampled[:, : self.samples], run)  # sampled columns are valid
        column = layer_id % self.num_layers
        rest = (outside, sample, valid, sampled, params[:, 0])
        reader = self._reader(q, k_pages, v_pages, bs, run)
        top_p, cap = params[:, 2 + column], self.caps[:bs, column]
        if self.triton:  # the eager Triton step's layer: its end in one kernel, the tally row written there
            reads = read_rest(part1.lse, part1.output, *rest, released, top_p, cap, reader, use_triton=True)
            per_kv = part1.importance_per_kv_head
            ends = dict(tally=self.tally[:bs], output=out, per_kv=per_kv, layer=column, layers=self.num_layers)
            weigh = (reads, outside, valid, sampled, params[:, 1], part1.lse, part1.output)
            return DecodeImportanceOutput(out, part1.lse, weigh_bounds_triton(*weigh, **ends), per_kv)
        outcome = guard_layer(part1.lse, part1.output.float(), *rest, params[:, 1], released, top_p, cap, reader)
        keep_in_tally(self.tally[:bs], outcome, sampled, column, self.num_layers)
        has_rest = valid.any(dim=1)
        out.copy_(torch.where(has_rest[:, None, None], outcome.combined.output, part1.output.float()))
        share = torch.where(has_rest[:, None], part_share(part1.lse, outcome.combined.lse), 1.0)
        per_kv = part1.importance_per_kv_head * kv_group_share(share, k_pages.shape[2])[:, None, :]
        return DecodeImportanceOutput(out, part1.lse, per_kv.mean(dim=-1), per_kv)

    def _sample(self, q, k_pages, v_pages, in_sample: torch.Tensor, run: dict) -> Sampled:
        """The sampled pages' own parts (the plan lists them first; all on the device)."""
        ids = self.physical[: q.shape[0], : in_sample.shape[1]]
        if self.triton:  # read from the pool in one launch, no gathered copy
            return Sampled(*masked_page_parts(q, k_pages, v_pages, ids, in_sample, **run))
        return sampled_pages(q, k_pages[ids], v_pages[ids], in_sample, **run)

    def _reader(self, q, k_pages, v_pages, bs: int, run: dict):
        physical = self.physical[:bs]
        if self.triton:
            return lambda chosen: masked_page_attention(q, k_pages, v_pages, physical, chosen, **run)
        ps = self.page_size

        def read(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            plan = plan_from_table(physical, torch.where(chosen, ps, 0), ps)
            res = decode_importance_paged(q, k_pages, v_pages, plan, native=False, chunk_pages=0, **run)
            return torch.where(plan.live[:, None], res.lse, float("-inf")), res.output.float()

        return read

    # -- after the step (host) ----------------------------------------------------------

    def read_back(self, turn: int) -> GuardReadBack:
        """After the replay: the tally's copy to the host, with what ``fold`` reads of the step."""
        host = self._tally_hosts[turn]
        host.copy_(self.tally, non_blocking=True)
        return GuardReadBack(host, self._stages[turn], list(self._guarded))

    def fold(self, live: Sequence[LiveRequest], step: GuardReadBack) -> None:
        """A step's guard tally (landed) into its guarded requests (``step_tally.fold_guard``, as
        the eager step folds its rows)."""
        for b in step.guarded:
            n = int((step.lists[b, FLAGS] & VALID).sum())  # valid columns come first
            fold_guard(live[b], step.tally[b], step.lists[b, LOGICAL, :n], slice(0, n), self.pages, self.num_layers)


class GuardReadBack(NamedTuple):
    """A replayed step's guard tally on the host and the lists it was written by."""

    tally: torch.Tensor  # the tally's host copy
    lists: torch.Tensor  # the step's host staging lists (read until the turn comes round again)
    guarded: list[int]  # its batch rows with a rest
