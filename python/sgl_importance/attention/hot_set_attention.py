"""The per-request hot set as both importance backends run it.

``importance_torch`` and ``importance_triton`` differ in how they read pages exactly
(``decode_importance_paged`` on the CPU, ``TritonPageListDecode`` on a GPU) and in
where their decode metadata comes from; the rest of the hot set is the same and lives
here:

- a decode step begins with the batch's requests and their slots, with their
  ``req_to_token`` rows where pages may be released (``begin_step``), attends layer by
  layer (``attend``, which files the attended pages' exact masses in the page importance table)
  and is ended by the scheduler once the batch's forward is done (``end_batch``, after
  ``Scheduler.run_batch``: the step's counts, into the ``sgl_importance:hot_set_*`` series with
  ``--enable-metrics``, and the page moves the next step wants, returned to the residency owner,
  which makes them before the next step; nothing is handed over from inside the forward);
- page copies run on the residency's ``PageCopies`` (a side stream on CUDA), fenced before
  any forward reads (``fence``);
- a decode batch that holds no request longer than ``--hot-set-threshold`` may be
  replayed from SGLang's CUDA graph (``hot_set_graphs.eager_with_hot_set_requests``, around the graph
  runner's check, decides from the host's copy of the lengths); such a step attends
  every page densely, as the decoder would for those requests, without the decoder:
  its host side only fences and drops what the decoder tracked (``graph_step``);
- with ``--hot-set-graph-rows``, a batch that holds one replays the ``hot`` (or ``hot_guard``) graph variant
  (``HotSetGraphVariants``): the decoder plans it in that same hook and the plan goes into
  the fixed-shape step's buffers (``hot_set/graph/step.py``, ``plan_graph_step``), the layers
  run it (``attend``), and after the batch the step is folded and ended
  (``finish_graph_step``, from ``end_batch``); a batch the buffers refuse runs eagerly from the same plan;
- with ``--hot-set-plan-ahead`` a step is ended one step late: after step N runs (its tally's
  copy queued, not waited for), step N-1 is folded and ended, planning N+1 and the page moves
  it wants, while N runs on the device (``hot_set/graph/late_ends.py``; a request's first step ends
  at once); eager steps keep the same rhythm, so a batch decides the same pages however it runs.

The key ranges and, guarded, key codes of a tracked request's full pages are written by the
decoder itself, from the pool, at the end of the step that filled a page (``hot_set/coding.py``),
into rows of KV pages borrowed from SGLang's allocator (``hot_set/pages/rows.py``; lent before the
batch by ``scheduler/hot_set_rows.py``): nothing is set aside at start-up but the page
importance table (``reserve_table``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from sgl_importance.attention.hot_set_graphs import GUARD_VARIANT, HOT_VARIANT
from sgl_importance.attention.step_phase import StepPhase, advance
from sgl_importance.hot_set.decode import StepResult
from sgl_importance.hot_set.graph.late_ends import LateEnds
from sgl_importance.hot_set.guard.estimate import on_device
from sgl_importance.hot_set.pages.state import PageMoves
from sgl_importance.hot_set.plan.selection import HotSetCounts
from sgl_importance.hot_set.table_budget import KVShape, describe, plan_table
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.runtime import Runtime

if TYPE_CHECKING:
    from sgl_importance.config import ImportanceConfig
    from sgl_importance.hot_set.decode import HotSetDecoder
    from sgl_importance.hot_set.graph.step import GraphStep, Replayed
    from sgl_importance.hot_set.plan.page_lists import ExactAttention
    from sgl_importance.hot_set.plan.request_state import LiveRequest
    from sgl_importance.metrics import HotSetMetrics
    from sgl_importance.sglang_types.model import AttentionLayer, ModelRunner
    from sgl_kernel_ext.page_list import TritonPageListDecode

logger = logging.getLogger(__name__)


class HotSetAttention:
    """A backend's hot set: the decoder, the page importance table it files into, its metrics.

    Args:
        decoder: ``hot_set.HotSetDecoder`` for this model runner's pool.
        page_importance: the process's page importance table.
        metrics: ``metrics.HotSetMetrics`` or None (``--enable-metrics`` off).
        graph_rows: most requests a captured hot-set step holds (``--hot-set-graph-rows``;
            0: a batch holding a hot-set request always runs eagerly).
        stream_prefill: a long prompt's full pages leave the device as it prefills
            (``--hot-set-prefill stream`` on a backend whose extend reads them back;
            ``scheduler/streamed_prefill.py``).
        plan_ahead: end each step one step late (``--hot-set-plan-ahead``).
    """

    def __init__(
        self,
        decoder: HotSetDecoder,
        page_importance: PageImportanceTable,
        metrics: Optional[HotSetMetrics] = None,
        graph_rows: int = 0,
        stream_prefill: bool = False,
        plan_ahead: bool = False,
    ) -> None:
        self.decoder = decoder
        self.stream_prefill = stream_prefill
        self.plan_ahead = plan_ahead
        self.late = LateEnds()  # with plan_ahead: the step run and not yet ended
        self.graph_rows = graph_rows
        self.guarded = True  # the server's settings guard (a guarded graph variant is captured)
        self.page_importance = page_importance
        self.metrics = metrics
        # Where the batch's step stands (attention/step_phase.py): begun, planned for the
        # captured step, replayed, ... until end_batch ends it after the forward.
        self.phase = StepPhase.IDLE
        # The last decode batch's request ids and their req_to_token rows (host ints).
        self._batch: Optional[tuple[str, ...]] = None
        self._rows: list[int] = []
        # The captured hot-set step (enable_graphs) and whether the forward runs its layers
        # (graph_mode: a replay, or SGLang capturing it); a batch planned for it and refused,
        # for the eager step (_planned: its ids and lengths).
        self.graph: Optional[GraphStep] = None
        self.graph_mode = False
        # The variant SGLang's runner picked for the batch it replays next (HotSetGraphVariants.select):
        # SGLang names a variant to the backend while capturing only, not in a replay's prep.
        self.replay_variant: Optional[str] = None
        # CUDA: the model runner's forward stream, which a prefill chunk's summary and release
        # wait for (under the overlap scheduler the chunk's forward may still run); None on the CPU.
        self.forward_stream: Optional[torch.cuda.Stream] = None
        self._planned: Optional[tuple] = None
        self._graph_counts = HotSetCounts()

    @property
    def in_step(self) -> bool:
        """An eager step is begun and not yet ended (its layers read the hot sets)."""
        return self.phase is StepPhase.EAGER

    @property
    def runs_layers(self) -> bool:
        """The forward's decode layers are the hot set's (``attend``): an eager step, or a
        captured hot-set step replayed or captured (``graph_mode``)."""
        return self.graph_mode or self.in_step

    def _to(self, phase: StepPhase) -> None:
        self.phase = advance(self.phase, phase)

    def begin_step(
        self,
        rids: Optional[Sequence[str]],
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        req_to_token: torch.Tensor,
    ) -> None:
        """Plan a decode step for the batch.

        Args:
            rids: the requests' ids (``ForwardBatch.rids``); None names them by row.
            req_pool_indices: the requests' ``req_to_token`` rows (on the device).
            seq_lens_cpu: their lengths, on the host (``ForwardBatch.seq_lens_cpu``).
            req_to_token: SGLang's table: request ``i`` holds
                ``req_to_token[req_pool_indices[i], :seq_lens[i]]``; releases and
                promotions rewrite its rows.

        The requests' slots are views of their rows, never read back; the rows' indices
        are read back only where the batch changed (a request joined or left, or an
        extend ran since: a retracted request comes back in another row).

        The backend has fenced the last step's promotions already (``fence`` at the top of
        its ``init_forward_metadata``, for every forward), so this does not fence again.
        """
        planned, self._planned = self._planned, None
        if planned is not None and planned == self._key(rids, seq_lens_cpu):
            self.decoder.plan_lists()  # planned for a graph the buffers refused: its lists
        else:
            self.decoder.begin_step(*self._batch_slots(rids, req_pool_indices, seq_lens_cpu, req_to_token)[:3])
        self._to(StepPhase.EAGER)  # a plan the buffers took and no replay came is dropped

    def _batch_slots(self, rids, req_pool_indices, seq_lens_cpu, req_to_token) -> tuple:
        """The batch's request ids, slots, rows (where pages may be released) and row indices."""
        key = tuple(rids) if rids is not None else None
        if key is None or key != self._batch:
            self._rows = req_pool_indices.tolist()  # the one read back, where the batch changed
            self._batch = key
        rows_idx = self._rows
        if rids is None:
            rids = [f"row-{r}" for r in rows_idx]
        # Views of the requests' rows: releases and promotions rewrite them, and SGLang
        # reads them for the next step's slots.
        rows = [req_to_token[r] for r in rows_idx]
        slots = [row[:n] for row, n in zip(rows, seq_lens_cpu.tolist())]
        return list(rids), slots, rows if self.decoder.residency.enabled else None, rows_idx

    @staticmethod
    def _key(rids: Optional[Sequence[str]], seq_lens_cpu: torch.Tensor) -> tuple:
        return (tuple(rids) if rids is not None else None, tuple(seq_lens_cpu.tolist()))

    # -- a step replayed from a captured graph (hot_set/graph/step.py) -----------------

    def enable_graphs(self, max_bs: int, max_pages: int, exact: Optional[TritonPageListDecode] = None) -> None:
        """Buffers for a captured hot-set step of ``min(max_bs, --hot-set-graph-rows)``
        requests of at most ``max_pages`` pages, made where SGLang makes its own graph
        buffers (``init_cuda_graph_state``); a no-op with ``--hot-set-graph-rows 0``."""
        if not self.graph_rows:
            return
        from sgl_importance.hot_set.graph.step import GraphCapacity, GraphStep

        d = self.decoder
        self.graph = GraphStep(
            GraphCapacity(min(max_bs, self.graph_rows), max_pages),
            num_layers=d.ranges.num_layers,
            page_size=d.page_size,
            ranges=d.ranges,
            device=d.ranges.device,
            exact=exact,
            guard_pool=d.guard if self.guarded else None,  # the server's guard off: no guarded variant
        )

    def plan_graph_step(self, rids, req_pool_indices, seq_lens_cpu, req_to_token, padded_bs: int) -> bool:
        """Before SGLang picks graph or eager for a decode batch holding a hot-set request:
        plan the step and write it into the graph's buffers (``padded_bs``: the captured
        size the batch replays at). False where they cannot take it (counted): the plan is
        kept for the eager step's ``begin_step``."""
        rids, slots, rows, rows_idx = self._batch_slots(rids, req_pool_indices, seq_lens_cpu, req_to_token)
        live = self.decoder.plan_step(rids, slots, rows)
        why = self.graph.prepare(live, rows_idx, padded_bs) if self.graph is not None else "off"
        if why is None:
            self._to(StepPhase.PLANNED)
            return True
        self._to(StepPhase.REFUSED)
        self._planned = self._key(rids, seq_lens_cpu)
        self._graph_counts.graph_eager += 1
        return False

    def graph_prologue(self, bs: int, req_to_token: torch.Tensor) -> None:
        """In the graph, before the layers (``init_forward_metadata_in_graph``)."""
        if self.graph_mode:
            self.graph.prologue(bs, req_to_token, self.decoder.pool_pages)

    def graph_metadata(self, variant: Optional[str], in_capture: bool, bs: int) -> None:
        """Before a captured decode step of ``bs`` rows (``init_forward_metadata_out_graph``),
        of graph ``variant`` (``HotSetGraphVariants``); capturing, the buffers list nothing
        (padding rows). A hot variant of a batch size past the buffers' rows is captured dense,
        a guarded one without a guard pool as the unguarded one (neither is ever replayed:
        ``prepare`` refuses such batches)."""
        graph = self.graph
        self.graph_mode = variant in (HOT_VARIANT, GUARD_VARIANT) and graph is not None and bs <= graph.capacity.rows
        if self.graph_mode:
            graph.guard_mode = variant == GUARD_VARIANT and graph.guard is not None
        if in_capture:
            if self.graph_mode:
                graph.clear()
            return
        if self.graph_mode and self.phase is not StepPhase.PLANNED:
            raise RuntimeError("a hot-set graph step was replayed without its plan (plan_graph_step)")
        if self.graph_mode and graph.guard_mode != graph.guarded:
            raise RuntimeError(f"the {variant} graph was picked for a plan whose guarded is {graph.guarded}")
        if not self.graph_mode:
            self.graph_step()
        else:
            self._to(StepPhase.REPLAYED)
            self.fence()

    def end_batch(self) -> Optional[PageMoves]:
        """After a batch's forward (the scheduler's ``Scheduler.run_batch`` hook, never the
        forward): end the step it ran, eager or replayed (with ``--hot-set-plan-ahead`` the
        step before it), or, after a dense replay, the late step whose requests left. Returns
        the page moves the next step wants (None: no step ended), for ``Residency.apply``."""
        phase = self.phase
        if phase is StepPhase.REPLAYED:
            ended = self.finish_graph_step()
        elif phase is StepPhase.EAGER:
            ended = self.end_step()
        elif phase is StepPhase.DENSE_REPLAYED:
            ended = self.end_pending()
        else:  # idle, or planned and no forward came: nothing ran to end
            ended = None
        self.graph_mode = False
        self._to(StepPhase.IDLE)
        return ended.moves if ended is not None else None

    def finish_graph_step(self) -> Optional[StepResult]:
        """After a replayed hot-set step (``end_batch``): its tally read back, folded into the
        requests, then the step ended as an eager one ends (``end_step``; with
        ``--hot-set-plan-ahead`` the step before it, the tally's copy not waited for). Returns
        the counts and moves of the step ended, None if none was."""
        self._graph_counts.graph_steps += 1
        replayed = self.graph.read_back()
        if self.plan_ahead:
            # The moves ended here may free pages this step still reads: copies wait for it.
            self.decoder.residency.copies.after(replayed.done)
            return self._end(*self.late.ran(replayed, self._fold))
        return self._end(self._fold(replayed))

    def end_pending(self) -> Optional[StepResult]:
        """End the step ``--hot-set-plan-ahead`` holds back, if any (its requests are leaving:
        a batch without them, or the end of a run); returns its counts and moves."""
        return self._end(self.late.drain(self._fold))

    def _fold(self, replayed: Replayed) -> list[LiveRequest]:  # a replayed step's read back (only where a graph ran)
        return self.graph.fold(replayed)

    def batch_changed(self) -> None:
        """An extend ran: the next decode reads its requests' rows again."""
        self._batch = None

    def attend(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        out: torch.Tensor,
        *,
        logit_cap: float,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One layer over the batch's hot sets, into ``out``; files the attended pages' masses.

        Args:
            layer: the ``RadixAttention`` layer (``layer_id``, ``scaling``).
            q: ``[bs, q_heads, D]``; k_buffer, v_buffer: the layer's KV pool, this step's
                token already written.
            out: ``[bs, q_heads, Dv]`` (a view of the layer's output), written in place.
            logit_cap: the layer's soft cap, 0.0 for none.

        Returns:
            ``out``.
        """
        if self.graph_mode:  # a captured step's layer (hot_set/graph/step.py): fixed shapes
            k_pages, v_pages = self.decoder.pool_as_pages(layer.layer_id, k_buffer, v_buffer)
            run = dict(sm_scale=layer.scaling, logit_cap=logit_cap, sinks=sinks)
            result = self.graph.attend(layer.layer_id, q, k_pages, v_pages, out, **run)
            self.page_importance.add_layer(result.importance, *self.graph.slot_lists())
            return out
        result = self.decoder.attend(
            layer.layer_id, q, k_buffer, v_buffer, sm_scale=layer.scaling, logit_cap=logit_cap, sinks=sinks
        )
        out.copy_(result.output)
        # Exact masses of the attended pages only: a page outside the hot set was not
        # read this step (its estimate ranks it for promotion, never as importance).
        device = self.page_importance.device
        self.page_importance.add_layer(
            on_device(result.importance.float(), device),
            on_device(result.kv_indptr, device),
            on_device(result.kv_indices, device),
        )
        return out

    def end_step(self) -> Optional[StepResult]:
        """After an eager step's forward (``end_batch``): fold it, plan the next one. Returns
        the step's counts and the moves the next one wants, or None outside an eager step."""
        if self.phase is not StepPhase.EAGER:
            return None
        self._to(StepPhase.IDLE)
        live = self.decoder.fold_step()
        return self._end(*self.late.ran(live, self._fold)) if self.plan_ahead else self._end(live)

    def _end(self, live: list, ahead: Sequence[int] | int = 1) -> Optional[StepResult]:
        """End a folded step (``live``: its requests; none: nothing to end, None returned),
        planning the one ``ahead`` steps on."""
        if not live:
            return None
        counts, moves = self.decoder.end_step(live, ahead)
        # The batch's graph counts (replayed, or refused) with the step's, in the totals too.
        counts.add(self._graph_counts)
        self.decoder.totals.add(self._graph_counts)
        self._graph_counts = HotSetCounts()
        if self.metrics is not None:
            self.metrics.add(counts.as_dict())
            self.after_step()
        return StepResult(counts, moves)

    def after_step(self) -> None:
        """The gauges of what the rows and the running requests hold (after a step, or a leave)."""
        d = self.decoder
        borrowed = d.ranges.rows.pages + d.guard.rows.pages
        self.metrics.after_step(d.guard.pages_in_use, d.ranges.pages_in_use, borrowed, d.held_bytes, len(d.tracked))

    def fence(self) -> None:
        """Make the current stream wait for page copies still in flight (a no-op without any)."""
        self.decoder.residency.copies.fence()

    def graph_step(self) -> None:
        """The host side of a decode step replayed from a CUDA graph, in place of ``begin_step``.

        The batch holds no request longer than the threshold, so none the decoder tracks: their
        state is dropped, as ``begin_step`` drops requests absent from its batch (they finished or
        were retracted). Promotions in flight are fenced first, as before any forward."""
        self.fence()
        self.decoder.drop_absent(())
        self._to(StepPhase.DENSE_REPLAYED)  # a step held back ends after it (end_batch): its requests left
        self.decoder.held_bytes = 0
        if self.metrics is not None:
            self.after_step()


def build_hot_set(
    runtime: Runtime,
    model_runner: ModelRunner,
    last_layer_id: int,
    page_importance: PageImportanceTable,
    *,
    exact: Optional[ExactAttention] = None,
    prefill_reads_host: bool = False,
    extend_seeds: bool = False,
) -> Optional[HotSetAttention]:
    """The backend's hot set when ``--hot-set-policy`` is on, else None.

    Args:
        runtime: the scheduler process's state: the config and the hot set's
            parameters, the guard's budget, the release registry and the requests'
            own hot-set parameters.
        model_runner: SGLang's model runner (its server args, KV pool, page size).
        last_layer_id: the last attention layer; the pools cover layers up to it.
        page_importance: where attended pages' masses are filed.
        exact: the decoder's exact page reader (default: ``decode_importance_paged``).
        prefill_reads_host: the backend's extend reads a request's released pages from the
            host pool (what ``--hot-set-prefill stream`` needs).
        extend_seeds: the backend's extend reports what a prompt's last token attended
            (what ``--hot-set-first-step seeded`` needs).
    """
    config = runtime.config
    params = runtime.hot_set_params
    if params is None:
        return None
    from sgl_importance.hot_set import GuardPool, HotSetDecoder, KeyRanges
    from sgl_importance.hot_set.pages.rows import BorrowedPages

    pool = model_runner.token_to_kv_pool
    layers = last_layer_id + 1
    k_buffers = [pool.get_key_buffer(layer) for layer in range(layers)]
    v_buffers = [pool.get_value_buffer(layer) for layer in range(layers)]
    keys, page_size = k_buffers[-1], model_runner.page_size
    budget = runtime.table_budget
    if budget is None:
        # Built without SGLang's pool sizing (reserve_table never ran): the table beside the pool.
        shape = KVShape(layers, keys.shape[1], keys.shape[2], v_buffers[-1].shape[2], keys.element_size(), page_size)
        total = model_runner.max_total_num_tokens
        budget = replace(plan_table(total, shape), kv_tokens=total, sized_by="the table NOT taken out of the KV pool")
    # Rows live in KV pages lent to the stores between steps (scheduler/hot_set_rows.py).
    runtime.row_pages = BorrowedPages(page_size)
    ranges = KeyRanges.over_pool(k_buffers, v_buffers, page_size, runtime.row_pages)
    guard = GuardPool.over_pool(k_buffers, v_buffers, page_size, runtime.row_pages)
    logger.info(describe(budget))
    decoder = HotSetDecoder(
        params,
        ranges,
        pool_pages=-(-keys.shape[0] // page_size),
        page_size=page_size,
        threshold=config.hot_set_threshold,
        exact=exact,
        residency=runtime.residency,
        request_params=runtime.request_params,
        guard=guard,
    )
    metrics = _build_metrics(runtime)
    stream = config.hot_set_prefill == "stream" and prefill_reads_host
    if config.hot_set_prefill == "stream" and not stream:
        logger.info("hot set: prompts are prefilled dense (this backend's extend cannot read the host pool)")
    # The first decode step seeded from the prefill (its pages summarised before it is planned):
    # importance_torch's extend reports the masses, on the CPU (not yet ordered for a GPU's streams).
    decoder.seed_first_step = config.hot_set_first_step == "seeded" and extend_seeds and keys.device.type == "cpu"
    if config.hot_set_first_step == "seeded" and not decoder.seed_first_step:
        logger.info("hot set: first decode steps read every page (a seeded one needs importance_torch on the CPU)")
    for layer in range(layers) if stream or decoder.seed_first_step else ():
        # A prefill chunk's pages are summarised from these before any decode step made them.
        decoder.pool_as_pages(layer, pool.get_key_buffer(layer), pool.get_value_buffer(layer))
    attention = HotSetAttention(
        decoder,
        page_importance,
        metrics,
        graph_rows=config.hot_set_graph_rows,
        stream_prefill=stream,
        plan_ahead=config.hot_set_plan_ahead == "on",
    )
    attention.guarded = guard_wanted(config)
    if keys.device.type == "cuda":
        attention.forward_stream = model_runner.forward_stream
    runtime.hot_set_attention, runtime.hot_set_decoder = attention, decoder
    return attention


def _build_metrics(runtime: Runtime) -> Optional[HotSetMetrics]:
    if not runtime.enable_metrics:
        return None
    from sglang.srt.runtime_context import get_parallel

    from sgl_importance.metrics import HotSetMetrics

    # SGLang keeps a process's ranks in its runtime context, not on the model runner.
    return HotSetMetrics({"tp_rank": get_parallel().tp_rank})


def guard_wanted(config: ImportanceConfig) -> bool:
    """Whether the server's settings use the guard: a hot set that is not dense, with a
    guard threshold below 1 (a request may still ask for one itself)."""
    return config.hot_set_policy not in ("off", "dense") and config.hot_set_guard_threshold < 1.0
