"""A hot-set decode step in fixed shapes: what a CUDA graph captures and replays.

An eager hot-set step (``decode.HotSetDecoder``) sizes its tensors by the step's plan
(the longest list, the guarded rows, the sample) and branches on it in Python, so a
graph would replay the captured step's choices. ``GraphStep`` runs the same step for
rows whose guard is off (``HOT``: a hot set, its unread pages ranked by their key bound;
``DENSE``: a short request or the ``dense`` policy, every page) over buffers allocated
once for ``GraphCapacity``: ``rows`` requests of at most ``pages`` pages each.

- Between steps, on the host (``prepare``): the decoder has planned the step
  (``HotSetDecoder.plan_step``); each row's plan is written into one staging buffer
  (the ``req_to_token`` row, the logical pages it reads, their tokens, the range ids of
  its full pages) and uploaded in one copy (two staging buffers, taken in turn). A batch the buffers
  cannot take is refused, with the reason, and runs eagerly: more rows or a longer list
  than the capacity, a guarded row where no guard graph was built (``graph/guard.py``
  takes them where one was), a planned page with no device page (it would be staged from the host), the ``quest``
  baseline (its lists change per layer).
- Inside the step (``prologue``, ``attend`` per layer: what a graph records),
  fixed-shape ops only, no host read, no upload, every buffer where it was
  when the graph was captured; Python values are the captured batch size and the model's
  constants, never the plan's:

  - prologue: each row's physical pages gathered from ``req_to_token`` by its logical
    pages, the padding columns masked, the tally zeroed;
  - per layer: exact attention over every row's ``pages`` columns (the padding ones add
    nothing), written into the caller's ``out``; in one launch (``sgl_kernel_ext.page_tally``)
    each page's mass added to the tally (summed over layers and the mean over KV heads, and
    the largest over both) and the key bound of each full page of a ``HOT`` row against the
    layer's denominator, the largest over layers and heads (the eager step's tally runs the same
    launch: ``plan.step_tally``).
- After the replay, on its stream (``read_back``): the tally copied to the host in one
  copy (into pinned memory on CUDA, the turn's buffer), an event after it.
- After the step, on the host (``fold``, once that event has passed): the tally into the
  step's requests (``step_tally.fold_pages``, as the eager step's fold); then the decoder's
  ``end_step`` as after an eager step (with ``--hot-set-plan-ahead``, one step later).

The work per layer is the capacity's, not the plan's: on a GPU the kernel loops by the
device's counts (``TritonPageListDecode``: padding columns cost grid slots, no reads);
the torch reader computes every column and is for tests and the CPU's harness.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from sgl_importance.hot_set.graph.guard import GraphGuard, GuardReadBack
from sgl_importance.hot_set.guard.key_codes import GuardPool
from sgl_importance.hot_set.guard.key_ranges import KeyRanges
from sgl_importance.hot_set.plan.request_state import LiveRequest, released_among
from sgl_importance.hot_set.plan.step_tally import fold_pages
from sgl_kernel_ext import DecodeImportanceOutput, PagedDecodePlan, PagedDecodeWorkspace, decode_importance_paged
from sgl_kernel_ext.page_list import PageListSlots, TritonPageListDecode, page_list_slots
from sgl_kernel_ext.page_tally import BOUND, tally_pages


class GraphCapacity(NamedTuple):
    """What a captured hot-set step holds: ``rows`` requests, ``pages`` listed pages each."""

    rows: int
    pages: int


class GraphStep:
    """One model runner's fixed-shape hot-set step (see the module docstring).

    Args:
        capacity: rows and pages per row of the buffers.
        num_layers: attention layers a step runs.
        page_size: tokens per page.
        ranges: the decoder's key-range pool (read by range id).
        device: the layers' device.
        exact: the exact reader; None: ``decode_importance_paged``'s torch path over every
            column; a ``TritonPageListDecode``: its kernel, slot lists built in the prologue.
    """

    def __init__(
        self,
        capacity: GraphCapacity,
        *,
        num_layers: int,
        page_size: int,
        ranges: KeyRanges,
        device: torch.device | str,
        exact: Optional[TritonPageListDecode] = None,
        guard_pool: Optional[GuardPool] = None,
    ) -> None:
        rows, pages = capacity
        if rows < 1 or pages < 1:
            raise ValueError(f"a graph step needs rows and pages >= 1, got {capacity}")
        self.capacity = capacity
        self.num_layers = num_layers
        self.page_size = page_size
        self.ranges = ranges
        self.device = torch.device(device)
        self.exact = exact
        dev = self.device
        pinned = dev.type == "cuda"
        # One int64 buffer for the whole plan: [row, logical..., tokens..., range ids...]. Two
        # host stages, taken in turn: a step's upload may still be queued (``--hot-set-plan-ahead``)
        # when the next plan is written.
        width = 1 + 3 * pages
        self._stages = [torch.zeros(rows, width, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0  # the stage (and tally copy) of the prepared step
        self._plan = torch.zeros(rows, width, dtype=torch.int64, device=dev)
        self.rows = self._plan[:, 0]
        self.logical = self._plan[:, 1 : 1 + pages]
        self.tokens = self._plan[:, 1 + pages : 1 + 2 * pages]
        self.range_ids = self._plan[:, 1 + 2 * pages :]
        # Written by the prologue from the plan and req_to_token.
        self.table = torch.zeros(rows, pages, dtype=torch.int64, device=dev)
        self.listed_tokens = torch.zeros(rows, pages, dtype=torch.int64, device=dev)
        self.bias = torch.zeros(rows, pages * page_size, dtype=torch.float32, device=dev)
        self.live = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.tally = torch.zeros(3, rows, pages, dtype=torch.float32, device=dev)
        # Where ``read_back`` copies it, by turn: a step's copy is folded while the next may land.
        self._tally_hosts = [torch.zeros(3, rows, pages, dtype=torch.float32, pin_memory=pinned) for _ in range(2)]
        self._offsets = torch.arange(page_size, device=dev)
        self._workspace = PagedDecodeWorkspace()
        self._plans: dict[int, PagedDecodePlan] = {}
        self._slots: Optional[PageListSlots] = None
        self._live: list[LiveRequest] = []
        self.refusals: dict[str, int] = {}
        # Guarded rows (graph_guard.py), where a guard pool is given; ``guard_mode``: the step
        # being captured or replayed runs the guard (its own graph: the caller sets it).
        self.guard: Optional[GraphGuard] = None
        if guard_pool is not None:
            self.guard = GraphGuard(
                rows,
                pages,
                num_layers=num_layers,
                page_size=page_size,
                pool=guard_pool,
                ranges=ranges,
                device=dev,
                triton=exact is not None,
            )
        self.guard_mode = False

    @property
    def nbytes(self) -> int:
        """Device bytes of the step's buffers (what ``prepare`` and the prologue write)."""
        held = (self._plan, self.table, self.listed_tokens, self.bias, self.live, self.tally)
        return sum(t.numel() * t.element_size() for t in held) + (self.guard.nbytes if self.guard else 0)

    @property
    def guarded(self) -> bool:
        """The prepared batch has a guarded row: it needs the guarded graph (``guard_mode``)."""
        return self.guard is not None and self.guard.guarded

    # -- between steps (host) --------------------------------------------------------

    def refusal(self, live: Sequence[LiveRequest], padded_bs: Optional[int] = None) -> Optional[str]:
        """Why the buffers cannot take this planned batch (None: they can); ``padded_bs``:
        the batch size it replays at (SGLang pads a batch to a size it captured)."""
        rows, pages = self.capacity
        if max(len(live), padded_bs or 0) > rows:
            return "rows"
        for req in live:
            if -(-req.slots.numel() // self.page_size) > pages:
                return "pages"
            tracked = req.tracked
            if tracked is None:
                continue
            if req.guard_on and self.guard is None:
                return "guard"
            if tracked.state.params.policy == "quest":
                return "quest"
            if released_among(req.pages, req.planned).any():
                return "staged"
        return None

    def prepare(
        self, live: Sequence[LiveRequest], rows: Sequence[int], padded_bs: Optional[int] = None
    ) -> Optional[str]:
        """Write the planned batch into the buffers (one upload); returns why it was
        refused instead (nothing written), None when written.

        Args:
            live: the decoder's requests of the step (``HotSetDecoder.plan_step``).
            rows: their ``req_to_token`` rows, in batch order.
            padded_bs: the batch size it replays at (rows past the batch list nothing).
        """
        turn = self._turn ^ 1
        why = self.refusal(live, padded_bs)
        if why is None and self.guard is not None:
            why = self.guard.prepare(live, turn)  # the guarded rows' lists (written where it takes them)
        if why is not None:
            self.refusals[why] = self.refusals.get(why, 0) + 1
            return why
        ps, pages = self.page_size, self.capacity.pages
        self._turn = turn
        stage = self._stages[turn]
        stage.zero_()
        for b, (req, row) in enumerate(zip(live, rows)):
            length = req.slots.numel()
            num_pages = -(-length // ps)
            listed = req.planned if req.tracked is not None else torch.arange(num_pages)
            tokens = (length - listed * ps).clamp(0, ps)
            n = listed.numel()
            stage[b, 0] = row
            stage[b, 1 : 1 + n] = listed
            stage[b, 1 + pages : 1 + pages + n] = tokens
            if req.bounds_unread:
                ids = req.tracked.ranges[:num_pages]
                stage[b, 1 + 2 * pages : 1 + 2 * pages + ids.numel()] = ids
        self._plan.copy_(stage, non_blocking=True)
        self._live = list(live)
        return None

    def clear(self) -> None:
        """Every row lists nothing (a graph's capture: padding rows only)."""
        self._plan.zero_()
        self._live = []
        if self.guard is not None:
            self.guard.clear()

    # -- inside the step (what a graph records) -----------------------------------

    def prologue(self, bs: int, req_to_token: torch.Tensor, pool_pages: int) -> None:
        """Each row's physical pages and valid tokens; the tally zeroed.

        Args:
            bs: the batch size (the captured one: padding rows list nothing).
            req_to_token: SGLang's table of each request's slots (read by row).
            pool_pages: pages of the device KV pool (the kernel's addressable ids).
        """
        ps = self.page_size
        rows, logical = self.rows[:bs], self.logical[:bs]
        firsts = req_to_token[rows[:, None], logical * ps].to(torch.int64)
        torch.floor_divide(firsts, ps, out=self.table[:bs])
        # A column on SGLang's padding page (released, or padding) reads nothing.
        torch.mul(self.tokens[:bs], self.table[:bs] > 0, out=self.listed_tokens[:bs])
        valid = (self._offsets[None, None, :] < self.listed_tokens[:bs, :, None]).reshape(bs, -1)
        self.bias[:bs].zero_().masked_fill_(~valid, float("-inf"))
        torch.any(valid, dim=1, out=self.live[:bs])
        self.tally.zero_()
        self.tally[BOUND].fill_(float("-inf"))
        # The listed pages' slots: what the kernel walks and the page importance table files by.
        plan = self.plan(bs)
        self._slots = page_list_slots(plan, pool_pages, self.device, staged=False)
        if self.exact is not None:
            self.exact.keep_slots(plan, pool_pages, self.device, self._slots)
        if self.guard_mode:
            self.guard.prologue(bs, req_to_token, rows)

    def plan(self, bs: int) -> PagedDecodePlan:
        """The first ``bs`` rows as the exact reader takes them (views of the buffers)."""
        plan = self._plans.get(bs)
        if plan is None:
            table, tokens = self.table[:bs], self.listed_tokens[:bs]
            pages = self.capacity.pages
            indptr = torch.arange(bs + 1, device=self.device) * pages
            plan = PagedDecodePlan(
                self.page_size, table, tokens, self.bias[:bs], self.live[:bs], indptr, table.view(-1), tokens.view(-1)
            )
            self._plans[bs] = plan
        return plan

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        out: torch.Tensor,
        *,
        sm_scale: float,
        logit_cap: float = 0.0,
        sinks: Optional[torch.Tensor] = None,
    ) -> DecodeImportanceOutput:
        """One layer over the listed pages, into ``out`` ``[bs, q_heads, Dv]``; tallied.

        Args:
            q: ``[bs, q_heads, D]``; k_pages, v_pages: the layer's pool as pages.
        """
        bs = q.shape[0]
        plan = self.plan(bs)
        run = dict(sm_scale=sm_scale, logit_cap=logit_cap, sinks=sinks)
        direct = self.exact is not None and not self.guard_mode  # the kernel writes ``out``
        if self.exact is not None:
            result = self.exact(q, k_pages, v_pages, plan, out=out if direct else None, **run)
        else:
            result = decode_importance_paged(
                q, k_pages, v_pages, plan, native=False, chunk_pages=0, workspace=self._workspace, **run
            )
        if self.guard_mode:  # part 2 (graph_guard.py) writes ``out``; part 1's masses as shares of it
            result = self.guard.attend(
                layer_id, q, k_pages, v_pages, result, out, sm_scale=sm_scale, logit_cap=logit_cap
            )
        elif not direct:
            out.copy_(result.output)
        # The pages' masses, and each full page's key bound against the layer's denominator
        # (the next step's promotions): one launch (a Triton kernel with the Triton reader).
        ranges = self.ranges
        tally_pages(
            result.importance_per_kv_head,
            q,
            result.lse,
            ranges.key_min[layer_id],
            ranges.key_max[layer_id],
            self.range_ids[:bs],
            self.tally,
            sm_scale=sm_scale,
            logit_cap=logit_cap,
            page_size=self.page_size,
            use_triton=self.exact is not None,
        )
        return result

    def slot_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The listed pages' slots (``kv_indptr``, ``kv_indices``) as the page importance
        table takes them with a layer's ``importance`` (built by the prologue)."""
        if self._slots is None:
            raise RuntimeError("slot_lists before the step's prologue")
        return self._slots.kv_indptr, self._slots.kv_indices

    # -- after the step (host) ---------------------------------------------------------

    def read_back(self) -> "Replayed":
        """After the replay, on its stream: the step's one read back, the tallies to the host
        (asynchronous on CUDA, into pinned memory: the guard's too in a guarded step), and what
        ``fold`` needs of the step. Outside the graph, so a step's copy can be folded while the
        next step's lands in the other turn's buffer (``--hot-set-plan-ahead``)."""
        host = self._tally_hosts[self._turn]
        host.copy_(self.tally, non_blocking=True)
        guard = self.guard.read_back(self._turn) if self.guard_mode else None
        done = torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" else None
        live, self._live = self._live, []
        return Replayed(live, host, guard, done)

    def fold(self, step: "Replayed") -> list[LiveRequest]:
        """A replayed step's tally into its requests (waiting for its copies); returns them."""
        if step.done is not None:
            step.done.synchronize()
        for b, req in enumerate(step.live):
            if req.tracked is not None:
                fold_pages(req, step.tally[:, b], req.planned, self.num_layers, self.num_layers)
        if step.guard is not None:
            self.guard.fold(step.live, step.guard)
        return step.live


class Replayed(NamedTuple):
    """A replayed step as ``GraphStep.read_back`` leaves it for ``GraphStep.fold``."""

    live: list[LiveRequest]  # its requests, in batch order
    tally: torch.Tensor  # the host copy of its tally (landed once ``done`` has)
    guard: Optional[GuardReadBack]  # the guard's, in a guarded step
    done: Optional[Any]  # a CUDA event after the copies (None where copies run in line)
