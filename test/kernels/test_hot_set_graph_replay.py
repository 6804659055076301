"""The captured hot-set step on the GPU's code path, replayed: the Triton reader and tally
(under the interpreter on a CPU) recorded once per batch size with the step's aten calls
(``support/graph_replay.py``), replayed without the step's Python after the host has
rewritten the buffers, against the eager decoder on the same pool (``support/graph_twin.py``).
The torch reader's proof is ``test/unit/test_hot_set_graph_step.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")

from support.graph_replay import first_difference, record, signature  # noqa: E402
from support.graph_twin import Twin, assert_decodes_alike, params  # noqa: E402


def test_the_triton_step_replayed_decodes_as_the_eager_step():
    twin = Twin(params(), triton=True)
    twin.join("long", 41)
    twin.join("short", 5)
    for step in range(8):
        if step == 3:
            twin.join("long-b", 30)
        if step == 6:
            twin.leave("short")
        assert_decodes_alike(twin, step, atol=2e-5)
    assert sorted(twin.graphs) == [(2, False), (3, False)] and not twin.refused
    kernels = {str(op[0]) for op in twin.graphs[2, False].ops if str(op[0]).startswith("triton.")}
    assert {"triton._decode_importance_stage1", "triton._tally_pages_kernel"} <= kernels, kernels


def test_the_triton_steps_launches_and_buffers_are_the_same_every_step():
    twin = Twin(params(), replay=False, triton=True)
    twin.join("a", 30)
    twin.join("b", 9)
    traces = []
    for _ in range(5):
        for rid in list(twin.rows):
            twin._write(rid)
        live = twin.graphed.plan_step(list(twin.rows), twin.slots())
        assert twin.step.prepare(live, [twin.rows[r] for r in twin.rows]) is None
        traces.append(signature(record(lambda: twin.region(2), triton=True)))
        twin.step.fold(twin.step.read_back())
        twin.graphed.end_step()
    for i in range(2, len(traces)):
        assert traces[i] == traces[1], first_difference(traces[1], traces[i])


@pytest.mark.slow  # ~30 s under the interpreter: in `make test`, out of the inner loop
def test_the_guarded_triton_step_replayed_decodes_as_the_eager_guarded_step(monkeypatch):
    """The hot_guard graph on the Triton reader: the guard's layer recorded and replayed with the
    rest (both decoders on the torch key-code pass: the graph cannot record the C kernels)."""
    from sgl_kernel_ext import native

    monkeypatch.setattr(native, "library", lambda: None)
    twin = Twin(params(policy="window", guard_threshold=0.1, budget=0.3), triton=True)
    twin.join("g", 60)
    twin.join("short", 5)
    for step in range(6):
        assert_decodes_alike(twin, step, atol=2e-5)
    assert twin.refused == ["warmup"] and (2, True) in twin.graphs
    assert twin.graphed.totals.guard_checks == twin.eager.totals.guard_checks > 0
