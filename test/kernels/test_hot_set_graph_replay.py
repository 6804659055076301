"""The captured hot-set step on the GPU's code path, replayed: the Triton reader and tally
(under the interpreter on a CPU) recorded once per batch size with the step's aten calls
(``support/graph_replay.py``), replayed without the step's Python after the host has
rewritten the buffers, against the eager decoder on the same pool (``support/graph_twin.py``);
each captured, as SGLang captures, on buffers listing nothing. Run through its Python, every step
launches what its capture recorded, on the same buffers, guard on and off.
The torch reader's proof is ``test/unit/test_hot_set_graph_step.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")

from support.graph_twin import Twin, assert_decodes_alike, assert_every_step_is_its_capture, params  # noqa: E402


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


def test_the_triton_steps_launches_and_buffers_are_those_captured_on_empty_buffers():
    twin = Twin(params(), replay=False, triton=True)
    twin.join("a", 30)
    twin.join("b", 9)
    for _ in range(3):
        twin.decode()
    assert_every_step_is_its_capture(twin)
    assert len(twin.traces) == 3


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


@pytest.mark.slow  # ~60 s under the interpreter
def test_the_guarded_triton_steps_launches_and_buffers_are_those_captured_on_empty_buffers(monkeypatch):
    from sgl_kernel_ext import native

    monkeypatch.setattr(native, "library", lambda: None)
    twin = Twin(params(policy="window", guard_threshold=0.1, budget=0.3), replay=False, triton=True)
    twin.join("g", 60)
    twin.join("short", 5)
    for _ in range(2):  # the first a dense warm-up (eager), the second captured and run through its Python
        twin.decode()
    assert_every_step_is_its_capture(twin)
    assert [key for key, _, _ in twin.traces] == [(2, True)]
