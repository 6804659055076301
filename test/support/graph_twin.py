"""Two hot-set decoders over one pool, one stepping eagerly, one through a ``GraphStep``.

Shared by ``test/unit/test_hot_set_graph_step.py`` (the torch reader) and
``test/kernels/test_hot_set_graph_replay.py`` (the Triton reader under the interpreter).
The captured step runs in SGLang's order: each batch size and variant (``hot``, ``hot_guard``)
is captured with the buffers listing nothing (SGLang captures at start-up, before any
request: here when first needed, the step's plan put aside meanwhile), after one warm-up run
on the same empty buffers, and recorded (``graph_replay.py``); every step, its own included,
then replays the recording without the step's Python after the host has rewritten the buffers.
With ``replay=False`` the step's Python runs every step instead, recorded, so its op trace and
buffers can be held to the capture's (``traces``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from sgl_importance.hot_set import HotSetDecoder, HotSetParams, KeyRanges
from sgl_importance.hot_set.graph.step import GraphCapacity, GraphStep
from support.graph_replay import Recording, first_difference, outside_tensors, record, signature
from support.kernel_device import DEVICE

PAGE = 4
KV_HEADS, GROUP, DIM = 2, 2, 8
Q_HEADS = KV_HEADS * GROUP
LAYERS = 2
POOL_PAGES = 80
ROW_PAGES = 24
SCALE = DIM**-0.5
THRESHOLD = 12
CAPACITY = GraphCapacity(4, ROW_PAGES)
DEV = torch.device(DEVICE)  # a device object: the host round-trip counter reads it as the server's device


def params(**kw) -> HotSetParams:
    base = dict(policy="importance", budget=0.4, window=1, sinks=1, guard_threshold=1.0)
    return HotSetParams(**{**base, **kw})


class Twin:
    """Two decoders over one pool, fed the same tokens: one steps eagerly, one through a
    ``GraphStep`` captured on empty buffers per batch size and variant and replayed
    (``replay=False``: run its Python every step, recorded into ``traces``, as an eager run of
    the fixed-shape step; ``triton``: its reader and tally the Triton kernels)."""

    def __init__(self, hot: HotSetParams, *, capacity=CAPACITY, seed=0, replay=True, triton=False) -> None:
        self.g = torch.Generator().manual_seed(seed)
        rows = POOL_PAGES * PAGE
        self.k = [torch.randn(rows, KV_HEADS, DIM, generator=self.g).to(DEV) for _ in range(LAYERS)]
        self.v = [torch.randn(rows, KV_HEADS, DIM, generator=self.g).to(DEV) for _ in range(LAYERS)]
        self.req_to_token = torch.zeros(8, ROW_PAGES * PAGE, dtype=torch.int32, device=DEV)
        self.free = list(range(POOL_PAGES - 1, 0, -1))
        self.rows: dict[str, int] = {}
        self.length: dict[str, int] = {}
        self.eager = self._decoder(hot)
        self.graphed = self._decoder(hot)
        exact = None
        if triton:  # the GPU's reader (under the interpreter on a CPU), its launches recorded too
            from sgl_kernel_ext import TritonPageListDecode

            exact = TritonPageListDecode()
        self.triton = triton
        self.step = GraphStep(
            capacity, num_layers=LAYERS, page_size=PAGE, ranges=self.graphed.ranges, device=DEV, exact=exact,
            guard_pool=self.graphed.guard,
        )  # fmt: skip
        self.q = torch.zeros(LAYERS, capacity.rows, Q_HEADS, DIM, device=DEV)  # the graph's static input
        self.out = torch.zeros(LAYERS, capacity.rows, Q_HEADS, DIM, device=DEV)  # and output
        self.replay = replay
        self.graphs: dict[tuple[int, bool], Recording] = {}  # per batch size and guard
        self.refused: list[str] = []
        # Per step run through its Python (replay=False): (variant, op trace, outside buffers).
        self.traces: list[tuple[tuple[int, bool], list, dict]] = []

    @staticmethod
    def _decoder(hot: HotSetParams) -> HotSetDecoder:
        ranges = KeyRanges(LAYERS, KV_HEADS, DIM, capacity_pages=POOL_PAGES, device=DEV)
        return HotSetDecoder(hot, ranges, pool_pages=POOL_PAGES, page_size=PAGE, threshold=THRESHOLD)

    def join(self, rid: str, length: int) -> None:
        self.rows[rid] = min(set(range(1, 8)) - set(self.rows.values()))
        self.length[rid] = 0
        for _ in range(length):
            self._write(rid)

    def leave(self, rid: str) -> None:
        row = self.req_to_token[self.rows.pop(rid)]
        self.free.extend(int(s) // PAGE for s in row[: self.length.pop(rid) : PAGE])

    def _write(self, rid: str) -> None:
        pos, row = self.length[rid], self.req_to_token[self.rows[rid]]
        if pos % PAGE == 0:
            row[pos : pos + PAGE] = self.free.pop() * PAGE + torch.arange(PAGE, dtype=torch.int32, device=DEV)
        slot = int(row[pos])
        for layer in range(LAYERS):
            self.k[layer][slot] = torch.randn(KV_HEADS, DIM, generator=self.g) * 2
            self.v[layer][slot] = torch.randn(KV_HEADS, DIM, generator=self.g)
        self.length[rid] += 1

    def slots(self) -> list[torch.Tensor]:
        return [self.req_to_token[self.rows[r], : self.length[r]] for r in self.rows]

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request, both ways; returns (eager, graph) outputs ``[L, bs, Hq, D]``."""
        for rid in list(self.rows):
            self._write(rid)
        rids, bs = list(self.rows), len(self.rows)
        q = torch.randn(LAYERS, bs, Q_HEADS, DIM, generator=self.g).to(DEV)
        self.eager.begin_step(rids, self.slots())
        eager = torch.stack(
            [self.eager.attend(i, q[i], self.k[i], self.v[i], sm_scale=SCALE).output for i in range(LAYERS)]
        )
        self.eager.end_step()
        live = self.graphed.plan_step(rids, self.slots())
        why = self.step.prepare(live, [self.rows[r] for r in rids])
        if why is not None:
            self.refused.append(why)
            self.graphed.plan_lists()  # the eager step from the same plan (HotSetAttention.begin_step's rule)
            graph = torch.stack(
                [self.graphed.attend(i, q[i], self.k[i], self.v[i], sm_scale=SCALE).output for i in range(LAYERS)]
            )
            self.graphed.end_step()
            return eager, graph
        self.q[:, :bs].copy_(q)  # as SGLang fills a graph's static inputs before replay
        key = (bs, self.step.guarded)  # the graph variant: hot or hot with the guard
        self.step.guard_mode = key[1]
        if key not in self.graphs:
            self.graphs[key] = self.capture(bs)
        if self.replay:
            self.graphs[key].replay()
        else:
            rec = record(lambda: self.region(bs), triton=self.triton)
            self.traces.append((key, signature(rec), outside_tensors(rec)))
        self.step.fold(self.step.read_back())
        self.graphed.end_step()
        return eager, self.out[:, :bs].clone()

    def capture(self, bs: int) -> Recording:
        """The step's variant (``step.guard_mode``) at ``bs`` rows, captured as SGLang captures
        it: a warm-up run (where traces are compared), then the recorded one, on buffers listing
        nothing."""
        with plan_put_aside(self.step):
            if not self.replay:
                # SGLang's warm-up run before capture, where traces are compared: the views and
                # workspaces a first run makes are then made outside the capture, as on a GPU.
                # (A replay re-makes them inside either way; the warm-up only costs time there.)
                self.region(bs)
            return record(lambda: self.region(bs), triton=self.triton)

    def region(self, bs: int) -> None:
        """What a graph records: the step's prologue, its layers."""
        self.step.prologue(bs, self.req_to_token, POOL_PAGES)
        for i in range(LAYERS):
            k_pages, v_pages = self.graphed.pool_as_pages(i, self.k[i], self.v[i])
            self.step.attend(i, self.q[i, :bs], k_pages, v_pages, self.out[i, :bs], sm_scale=SCALE)


def assert_same_states(twin: Twin) -> None:
    eager = {rid: t.state for rid, t in twin.eager.tracked.items()}
    graphed = {rid: t.state for rid, t in twin.graphed.tracked.items()}
    assert eager.keys() == graphed.keys()
    for rid in eager:
        assert torch.allclose(eager[rid].importance(), graphed[rid].importance(), atol=1e-6), rid
        assert torch.equal(eager[rid].resident, graphed[rid].resident), rid


def assert_decodes_alike(twin: Twin, step: int, atol: float) -> None:
    """One step both ways: the outputs within ``atol``, the requests' states the same."""
    eager, graph = twin.decode()
    assert torch.allclose(eager, graph, atol=atol), step
    assert_same_states(twin)


def assert_every_step_is_its_capture(twin: Twin) -> None:
    """Each step run through its Python (``replay=False``) made the ops, shapes, scalars and
    buffer addresses its variant's capture on empty buffers recorded: the graph it would replay."""
    for key, trace, buffers in twin.traces:
        captured = twin.graphs[key]
        assert trace == signature(captured), (key, first_difference(signature(captured), trace))
        assert buffers == outside_tensors(captured), key


@contextmanager
def plan_put_aside(step: GraphStep) -> Iterator[None]:
    """The step's buffers list nothing inside (a capture, which SGLang runs before any request);
    the plan the host wrote for the coming step is put back after."""
    guard = step.guard
    plan, live = step._plan.clone(), list(step._live)
    guarded = (guard._lists.clone(), guard._params.clone(), list(guard._guarded)) if guard is not None else None
    step.clear()
    try:
        yield
    finally:
        step._plan.copy_(plan)
        step._live = live
        if guarded is not None:
            guard._lists.copy_(guarded[0])
            guard._params.copy_(guarded[1])
            guard._guarded = guarded[2]
