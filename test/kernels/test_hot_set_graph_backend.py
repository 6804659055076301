"""importance_triton's captured hot-set step, driven as SGLang's decode graph runner drives it.

The runner (``support/graph_runner.py``) plans each batch in the plugin's hook around
``can_run_graph``, captures each batch size's variant, and runs the step as a replay runs it
(prep, prologue, every layer's ``forward_decode``: KV write, fixed-shape decode, importance
filed; the read back and the fold after ``execute``). Against ``importance_torch``'s eager hot set on the same pool,
requests and queries: the same outputs, page importance and counts, with short requests
beside long ones, requests joining and leaving, and a guarded request (refused: eager).

Here the layers' Python runs at every "replay"; that replaying the step without its
Python gives the same is ``test_hot_set_graph_replay.py``'s proof (the Triton reader) and
``test/unit/test_hot_set_graph_step.py``'s (the torch reader).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")
pytest.importorskip("sglang", reason="the backends subclass SGLang's")

from sgl_importance.hot_set import HotSetParams  # noqa: E402
from support.counted_world import triton_launches_counted  # noqa: E402
from support.graph_runner import GraphRunner  # noqa: E402
from support.host_syncs import LAUNCH, STEP, SYNC_KINDS, HostSyncCounter  # noqa: E402
from support.hot_set_world import DIM, KV_HEADS, LAYERS, Q_HEADS, World, parents_metadata  # noqa: E402
from support.kernel_device import EMPTY_PAGES_WARN  # noqa: E402

pytestmark = [EMPTY_PAGES_WARN]

OUT_ATOL = 2e-5
IMP_ATOL = 2e-6
# The plugin's launches in a captured layer on the Triton backend, torch calls and Triton kernels
# as the CPU counts them (host_syncs.LAUNCH), SGLang's KV write aside (1 kernel, 2 ops on
# torch_cuda). Guard off: the decode's two kernels (writing SGLang's output), the page tally
# (masses and key bounds in one kernel), the importance scatter (issue 47's target: at most 6 a
# layer with the KV write). Guard on (hot_guard): those 4 and the guard's 12 (hot_set/graph/guard.py;
# its end of layer one program a row until 2026-12-04, three launches across heads and pages since).
GRAPH_LAYER_LAUNCHES = 4
GUARD_LAYER_LAUNCHES = 16
KV_WRITE = "sgl_importance/attention/triton_backend.py"  # the backend's _store_kv (SGLang's write)


@pytest.fixture(autouse=True)
def _parents_metadata():
    with parents_metadata():
        yield


@pytest.mark.slow  # ~50 s interpreted: a third of make test-fast's budget; make test and CI run it
def test_a_captured_hot_set_step_decodes_as_the_eager_hot_set_with_joins_leaves_and_a_guarded_request():
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=1.0)
    pools = dict(device_pages=96, host_pages=0, release=False)
    eager = World("torch", params, **pools)
    counter = HostSyncCounter()
    with counter, counter.paused():  # the counter sees where the graph's buffers were made
        runner = GraphRunner(World("triton", params, **pools), params)
    graphed = runner.world
    g = torch.Generator().manual_seed(11)

    def place(rid: str, n: int) -> None:
        k, v = (torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) for _ in range(2))
        for w in (eager, graphed):
            w.place(rid, k, v)

    def step() -> None:
        bs = len(graphed.rows)
        k_new, v_new = (torch.randn(LAYERS, bs, KV_HEADS, DIM, generator=g) for _ in range(2))
        q = torch.randn(LAYERS, bs, Q_HEADS, DIM, generator=g) * 2
        want = eager.step(k_new, v_new, q)
        counter.begin_step()
        with counter, triton_launches_counted(counter):
            got = runner.step(k_new, v_new, q, counter=counter)
        for layer, (a, b) in enumerate(zip(want, got)):
            assert torch.allclose(b, a, atol=OUT_ATOL, rtol=0), f"layer {layer}"
        assert torch.allclose(graphed.page_importance.last, eager.page_importance.last, atol=IMP_ATOL, rtol=0)

    place("long", 30)
    place("short", 3)
    for i in range(6):
        if i == 2:
            place("long-2", 21)
        step()
    for w in (eager, graphed):
        w.finish("short")
    step()
    # A request whose guard is on: its first (dense warm-up) step runs eagerly, then the batch
    # replays the guarded graph (hot_guard).
    guarded = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=0.05)
    for w in (eager, graphed):
        w.backend.hot_set.decoder.request_params.note("guarded", guarded)
    place("guarded", 26)
    step()
    step()
    decoder = graphed.backend.hot_set.decoder
    totals = decoder.totals.as_dict()
    want_totals = eager.backend.hot_set.decoder.totals.as_dict()
    graph_steps, graph_eager = totals.pop("graph_steps"), totals.pop("graph_eager")
    assert {k: v for k, v in want_totals.items() if not k.startswith("graph_")} == totals
    assert graph_steps == runner.replayed == 8 and graph_eager == 1
    assert {(2, "hot"), (3, "hot"), (3, "hot_guard")} <= runner.captured
    assert runner.variants_run.count("hot_guard") == 1 and totals["guard_checks"] > 0
    assert graphed.backend.hot_set.graph.refusals == {"warmup": 1}
    # What a graph holds (prologue, layers) hands no device value to the host and uploads nothing.
    # The tallies come back after the replay (the step's, and the guard's in a guarded step: copies
    # into pinned memory on a GPU, what the host reads when it folds the step), one copy each.
    for where in ("prologue", *range(LAYERS)):
        assert counter.total(kinds=("upload",), where=where, device_only=True) == 0
        syncs = counter.by("site", where=where, device_only=True)
        assert not syncs, (where, syncs)
    read_back = {
        site.split(":")[0]: n
        for site, n in counter.by("site", kinds=SYNC_KINDS, where=STEP, device_only=True).items()
        if "/hot_set/graph/" in site
    }
    # one guarded step of 8 replayed
    assert read_back == {"sgl_importance/hot_set/graph/guard.py": 1, "sgl_importance/hot_set/graph/step.py": 8}
    # The launches a layer of the hot graph replays: the same every step, whatever the batch
    # (7 steps, 2 sizes).
    hot = [step for step, variant in enumerate(runner.variants_run) if variant == "hot"]
    per_step = []
    for step in hot:
        sites = counter.by("site", kinds=(LAUNCH,), where=0, step=step, device_only=True)
        # SGLang's KV write (the backend's _store_kv, through the world's stand-in pool) aside.
        per_step.append(sum(n for site, n in sites.items() if not site.startswith(KV_WRITE)))
    assert len(hot) == 7 and per_step == [GRAPH_LAYER_LAUNCHES] * 7, per_step
    # And of the guarded graph (a layer but the last, which also files the step's importance).
    (guarded,) = [step for step, variant in enumerate(runner.variants_run) if variant == "hot_guard"]
    sites = counter.by("site", kinds=(LAUNCH,), where=0, step=guarded, device_only=True)
    assert sum(n for site, n in sites.items() if not site.startswith(KV_WRITE)) == GUARD_LAYER_LAUNCHES, sites


def test_a_batch_past_the_buffers_rows_runs_eagerly_counted():
    params = HotSetParams(policy="window", budget=2, window=1, sinks=1, guard_threshold=1.0)
    pools = dict(device_pages=96, host_pages=0, release=False)
    eager = World("torch", params, **pools)
    runner = GraphRunner(World("triton", params, **pools), params)
    graphed = runner.world
    g = torch.Generator().manual_seed(3)
    for rid, n in (("a", 20), ("b", 22), ("c", 17), ("d", 19)):  # 4 long requests, 3 rows
        k, v = (torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) for _ in range(2))
        for w in (eager, graphed):
            w.place(rid, k, v)
    for _ in range(2):
        k_new, v_new = (torch.randn(LAYERS, 4, KV_HEADS, DIM, generator=g) for _ in range(2))
        q = torch.randn(LAYERS, 4, Q_HEADS, DIM, generator=g)
        for a, b in zip(eager.step(k_new, v_new, q), runner.step(k_new, v_new, q)):
            assert torch.allclose(b, a, atol=OUT_ATOL, rtol=0)
    hot_set = graphed.backend.hot_set
    assert runner.replayed == 0 and hot_set.graph.refusals == {"rows": 2}
    assert hot_set.decoder.totals.graph_eager == 2
    # Three requests fit three rows, but SGLang would pad the batch to a size it captured (4).
    for w in (eager, graphed):
        w.finish("d")
    runner.capture_bs = [1, 2, 4]
    k_new, v_new = (torch.randn(LAYERS, 3, KV_HEADS, DIM, generator=g) for _ in range(2))
    q = torch.randn(LAYERS, 3, Q_HEADS, DIM, generator=g)
    for a, b in zip(eager.step(k_new, v_new, q), runner.step(k_new, v_new, q)):
        assert torch.allclose(b, a, atol=OUT_ATOL, rtol=0)
    assert runner.replayed == 0 and hot_set.graph.refusals == {"rows": 3}
