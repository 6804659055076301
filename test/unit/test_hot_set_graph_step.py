"""The hot-set step in fixed shapes (``hot_set/graph/step.py``) can be captured: the CPU's proof.

A world of long and short requests decodes token by token, twice over the same pools:
by the eager decoder (``begin_step``/``attend``/``end_step``) and by a ``GraphStep``
whose layers run as a CUDA graph would run them: recorded once per batch size
(``support/graph_replay.py``), then replayed without their Python, after the host has
rewritten the step's buffers. The replayed step must decode as the eager one; its ops,
shapes and buffers must be the same every step; it must make no host read, upload or
data-sized op. A region that freezes a plan value at capture must fail the same check.
"""

from __future__ import annotations

import pytest
import torch

from sgl_importance.hot_set.graph.step import GraphCapacity, GraphStep
from support.graph_twin import (
    LAYERS,
    PAGE,
    POOL_PAGES,
    ROW_PAGES,
    SCALE,
    Twin,
    assert_decodes_alike,
    assert_every_step_is_its_capture,
    params,
)
from support.host_syncs import SYNC_KINDS, UPLOAD, HostSyncCounter


@pytest.mark.parametrize("policy,reduce", [("importance", "mean"), ("importance", "max"), ("window", "mean")])
def test_a_replayed_step_decodes_as_the_eager_step_through_joins_leaves_and_new_pages(policy, reduce):
    twin = Twin(params(policy=policy, reduce=reduce))
    twin.join("long-a", 41)
    twin.join("short", 5)
    for step in range(16):
        if step == 4:
            twin.join("long-b", 30)
        if step == 9:
            twin.leave("short")
        if step == 12:
            twin.join("short-2", 3)
        assert_decodes_alike(twin, step, atol=1e-5)
    assert not twin.refused
    assert sorted(twin.graphs) == [(2, False), (3, False)]  # one graph per batch size, each replayed
    assert twin.graphed.totals.steps == twin.eager.totals.steps > 0
    assert twin.graphed.totals.pages_attended == twin.eager.totals.pages_attended


def test_the_steps_ops_shapes_and_buffers_are_those_captured_on_empty_buffers():
    twin = Twin(params(), replay=False)
    twin.join("a", 30)
    twin.join("b", 13)
    twin.join("c", 6)
    for _ in range(9):  # across page boundaries, budget growth and a request passing the threshold
        twin.decode()
    assert_every_step_is_its_capture(twin)
    assert [key for key, _, _ in twin.traces] == [(3, False)] * 9
    assert len(twin.traces[0][1]) > 50 and len(twin.graphed.tracked) == 3  # "c" passed the threshold on the way


@pytest.mark.slow  # ~8 s: make test-fast stands near its 3 minutes
def test_the_guarded_steps_ops_shapes_and_buffers_are_those_captured_on_empty_buffers(monkeypatch):
    """The hot_guard variant as the hot one: its capture lists no guarded row, every later step
    lists one or two (torch paths: the graph cannot record the C kernels)."""
    from sgl_kernel_ext import native

    monkeypatch.setattr(native, "library", lambda: None)
    twin = Twin(params(policy="window", guard_threshold=0.1, budget=0.3), replay=False)
    twin.join("g", 60)
    twin.join("short", 5)
    for step in range(4):
        if step == 2:
            twin.join("g2", 45)  # its first step a dense warm-up: eager
        twin.decode()
    assert_every_step_is_its_capture(twin)
    assert [key for key, _, _ in twin.traces] == [(2, True), (3, True)]
    assert twin.graphed.totals.guard_checks > 0


def test_a_step_whose_ops_follow_its_plan_differs_from_its_capture():
    """The trace check can fail: a layer that reads only the pages the host listed (a slice
    to the widest list, a Python int) records other shapes than its capture on empty buffers."""
    twin = Twin(params(budget=1.0, policy="dense"), replay=False)
    twin.join("a", 14)
    frozen = GraphStep.plan

    def plan(self, bs):
        got = frozen(self, bs)
        width = max(1, int((self.listed_tokens[:bs] > 0).sum(dim=1).max()))
        got.bias[:, : width * PAGE].add_(0.0)
        return got

    GraphStep.plan = plan
    try:
        twin.decode()
    finally:
        GraphStep.plan = frozen
    with pytest.raises(AssertionError):
        assert_every_step_is_its_capture(twin)


def test_the_step_reads_nothing_back_uploads_nothing_and_makes_no_data_sized_op():
    counter = HostSyncCounter()
    with counter:
        twin = Twin(params(), replay=False)
        twin.join("a", 30)
        twin.join("b", 9)
        for _ in range(6):
            with counter.paused():
                for rid in list(twin.rows):
                    twin._write(rid)
                live = twin.graphed.plan_step(list(twin.rows), twin.slots())
                twin.step.prepare(live, [twin.rows[r] for r in twin.rows])
            with counter.where("layers"):
                twin.step.prologue(2, twin.req_to_token, POOL_PAGES)
                for i in range(LAYERS):
                    k_pages, v_pages = twin.graphed.pool_as_pages(i, twin.k[i], twin.v[i])
                    twin.step.attend(i, twin.q[i, :2], k_pages, v_pages, twin.out[i, :2], sm_scale=SCALE)
            with counter.where("read back"):
                replayed = twin.step.read_back()
            with counter.paused():
                twin.step.fold(replayed)
                twin.graphed.end_step()
    # The device-aware view: the server's device tensors told from host ones (on a CPU
    # both are the host; a .to() onto the device it is already on counts in the other view).
    layers = dict(where="layers", device_only=True)
    assert counter.total(**layers) == 0, counter.by("site", **layers)
    assert counter.total(kinds=(UPLOAD,), **layers) == 0
    read_back = dict(where="read back", device_only=True)
    assert counter.by("kind", kinds=(*SYNC_KINDS, UPLOAD, "alloc"), **read_back) == {"cpu": 6}  # one copy a step


def test_a_region_that_freezes_a_plan_value_at_capture_is_caught_by_the_replay():
    """The check can fail: a layer that slices to the longest list the host planned (a
    Python int) replays the captured width once the lists grow."""
    twin = Twin(params(budget=1.0, policy="dense"))
    twin.join("a", 14)
    frozen = GraphStep.plan

    def plan(self, bs):
        got = frozen(self, bs)
        width = int((self.listed_tokens[:bs] > 0).sum(dim=1).max())  # read at capture, frozen
        got.bias[:, width * PAGE :] = float("-inf")
        return got

    GraphStep.plan = plan
    try:
        parted = False
        for _ in range(10):
            eager, graph = twin.decode()
            parted |= not torch.allclose(eager, graph, atol=1e-5)
    finally:
        GraphStep.plan = frozen
    assert parted


def test_a_guarded_region_that_freezes_a_plan_value_at_capture_is_caught_by_the_replay(monkeypatch):
    """The same for the hot_guard variant: a prologue that scales the read caps by a Python
    value read from the buffers (1 once a row is listed: run through its Python it decodes as
    the eager step; 0 on the capture's empty buffers) parts from the eager step replayed. With
    the graph recorded on a step's live plan, as this harness did before, it passed."""
    from sgl_importance.hot_set.graph.guard import GraphGuard
    from sgl_kernel_ext import native

    monkeypatch.setattr(native, "library", lambda: None)
    prologue = GraphGuard.prologue

    def frozen(self, bs, req_to_token, rows):
        prologue(self, bs, req_to_token, rows)
        listed = int(self._params[:bs].abs().sum() > 0)  # read at capture, frozen
        self.caps[:bs].mul_(listed)

    monkeypatch.setattr(GraphGuard, "prologue", frozen)
    twin = Twin(params(policy="window", guard_threshold=0.1, budget=0.3))
    twin.join("g", 60)
    parted = False
    for _ in range(3):  # a dense warm-up, then the guarded graph captured and replayed twice
        eager, graph = twin.decode()
        parted |= not torch.allclose(eager, graph, atol=1e-5)
    assert (1, True) in twin.graphs
    assert parted or twin.eager.totals.pages_guard_read != twin.graphed.totals.pages_guard_read


def test_batches_the_buffers_cannot_take_are_refused_and_say_why():
    twin = Twin(params(), capacity=GraphCapacity(2, ROW_PAGES))
    for i in range(3):
        twin.join(f"r{i}", 20)
    twin.decode()
    twin.leave("r2")
    twin.decode()
    assert twin.refused == ["rows"]
    long = Twin(params(), capacity=GraphCapacity(2, 4))
    long.join("r", 20)
    long.decode()
    assert long.refused == ["pages"]


@pytest.mark.parametrize(
    "policy,threshold,read_cap",
    [("window", 0.1, 0.2), ("window", 1e-6, 0.2), ("lru", 0.5, 0.5), ("importance", 0.1, 0.2)],
)
def test_a_replayed_guarded_step_decodes_as_the_eager_guarded_step(monkeypatch, policy, threshold, read_cap):
    """The guard inside the graph (hot_set/graph/guard.py): the selection, the sample, the bound and
    the flags as the eager layer has them, beside a short request; a guarded request's first
    (dense warm-up) step runs eagerly. Both decoders read with the torch paths (the graph
    cannot record the C kernels, whose key-code pass rounds differently). A batch the buffers
    refuse runs eagerly from the plan already made (planning it twice moved the ``importance``
    policy's hot set a second time: the plans parted at step 7, taken then for a near tie)."""
    from sgl_kernel_ext import native

    monkeypatch.setattr(native, "library", lambda: None)
    twin = Twin(params(policy=policy, guard_threshold=threshold, read_cap=read_cap, budget=0.3))
    twin.join("g", 60)
    twin.join("short", 5)
    for step in range(12):
        if step == 3:
            twin.join("g2", 45)
        assert_decodes_alike(twin, step, atol=1e-5)
        for rid, tracked in twin.eager.tracked.items():
            other = twin.graphed.tracked[rid]
            assert (tracked.caps is None) == (other.caps is None)
            if tracked.caps is not None:
                assert torch.allclose(tracked.caps, other.caps), rid
    # Each request's first tracked step: "g", "g2" and, over 12 steps, "short" past the threshold.
    assert set(twin.refused) == {"warmup"} and len(twin.refused) == len(twin.eager.tracked)
    assert any(guard for _, guard in twin.graphs), twin.graphs
    e, g = twin.eager.totals.as_dict(), twin.graphed.totals.as_dict()
    for key in ("guard_checks", "guard_reads", "guard_flagged", "pages_guard_read", "pages_estimated",
                "pages_sampled", "pages_missed", "pages_attended", "late_arrivals", "steps"):  # fmt: skip
        assert e[key] == g[key], (key, e[key], g[key])
    assert e["guard_checks"] > 0 and e["pages_estimated"] > 0
