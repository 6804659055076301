"""``--hot-set-plan-ahead``: each hot-set step ended one step late, captured or eager alike.

With the flag a step's host work (its tally folded, the step after the next planned, the page
moves that plan wants) runs after the next step has been issued: on a GPU beside the replay
instead of before it. The decisions are the same however a step runs: the captured step
(``support/graph_runner.py``, the Triton reader under the interpreter) decodes as the eager
``importance_torch`` step with the flag on the same pool, requests and queries, through
releases and promotions and requests leaving, and every page a step plans is on the device
when it runs (the moves were made between the steps).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")
pytest.importorskip("sglang", reason="the backends subclass SGLang's")

from sgl_importance.hot_set import HotSetParams  # noqa: E402
from support.graph_runner import GraphRunner  # noqa: E402
from support.hot_set_world import DIM, KV_HEADS, LAYERS, PAGE, Q_HEADS, THRESHOLD, World, parents_metadata  # noqa: E402
from support.kernel_device import EMPTY_PAGES_WARN  # noqa: E402

pytestmark = [EMPTY_PAGES_WARN]

OUT_ATOL = 2e-5
IMP_ATOL = 2e-6


@pytest.fixture(autouse=True)
def _parents_metadata():
    with parents_metadata():
        yield


def _draws(g: torch.Generator, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_new, v_new = (torch.randn(LAYERS, bs, KV_HEADS, DIM, generator=g) for _ in range(2))
    return k_new, v_new, torch.randn(LAYERS, bs, Q_HEADS, DIM, generator=g) * 2


def _twins(params: HotSetParams, requests: list, seed: int, **pools) -> tuple[World, GraphRunner, torch.Generator]:
    """The eager ``importance_torch`` world and the graph runner over an ``importance_triton``
    one, both with the flag, holding ``requests`` (rid, tokens) with the same keys and values."""
    eager = World("torch", params, **pools, plan_ahead=True)
    runner = GraphRunner(World("triton", params, **pools, plan_ahead=True), params)
    g = torch.Generator().manual_seed(seed)
    for rid, n in requests:
        _place((eager, runner.world), g, rid, n)
    return eager, runner, g


def _place(worlds: tuple[World, ...], g: torch.Generator, rid: str, n: int) -> None:
    k, v = (torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) for _ in range(2))
    for w in worlds:
        w.place(rid, k, v)


def _step_both(eager: World, runner: GraphRunner, g: torch.Generator) -> None:
    """One step both ways: the same outputs and page importance."""
    graphed = runner.world
    k_new, v_new, q = _draws(g, len(graphed.rows))
    for layer, (a, b) in enumerate(zip(eager.step(k_new, v_new, q), runner.step(k_new, v_new, q))):
        assert torch.allclose(b, a, atol=OUT_ATOL, rtol=0), f"layer {layer}"
    assert torch.allclose(graphed.page_importance.last, eager.page_importance.last, atol=IMP_ATOL, rtol=0)


def test_captured_steps_ended_a_step_late_decode_as_eager_ones_through_releases_and_leaves():
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=1.0)
    requests = [("long", 33), ("long-2", 30), ("short", 5)]
    eager, runner, g = _twins(params, requests, 5, device_pages=48, host_pages=64, release=True)
    graphed = runner.world

    def step() -> None:
        _step_both(eager, runner, g)
        # Both rewrote the requests' rows alike (releases and promotions, between the steps).
        assert torch.equal(graphed.req_to_token, eager.req_to_token)

    hot_sets = [w.backend.hot_set for w in (eager, graphed)]
    step()
    # A request's first step ends at once (its plan is the dense warm-up's); the rest waits.
    assert all(h.decoder.totals.steps == 2 and h.late.pending is not None for h in hot_sets)
    for _ in range(7):
        step()
    decoder = hot_sets[1].decoder
    # Ended one step late: the plan waiting for the next step was made a step before it ran.
    # Steps 1-7 ended (the 8th pending): the long requests' and the short one's past the threshold
    # (its first such step, the 4th, at once).
    assert decoder.totals.steps == 2 * 7 + sum(5 + k > THRESHOLD for k in range(1, 8))
    length = graphed.written["long"]
    assert decoder.tracked["long"].next_plan[0] == -(-(length + 1) // PAGE)
    for w in (eager, graphed):
        for rid in ("long", "long-2", "short"):
            w.finish(rid)
    _place((eager, graphed), g, "tiny", 3)
    step()  # a short request alone: a dense graph (the pending step's requests have left)
    for h in hot_sets:
        h.end_pending()
    totals = [h.decoder.totals.as_dict() for h in hot_sets]
    graph_steps, graph_eager = totals[1].pop("graph_steps"), totals[1].pop("graph_eager")
    assert {k: v for k, v in totals[0].items() if not k.startswith("graph_")} == totals[1]
    assert graph_steps == 8 and graph_eager == 0, runner.variants_run
    assert runner.variants_run == ["hot"] * 8 + ["dense"]
    # Pages left and came back between steps; every planned page was on the device when its
    # step ran (a captured step refuses one that is not: "staged").
    assert totals[1]["pages_released"] > 0 and totals[1]["pages_copied_in"] > 0
    assert totals[1]["pages_read_from_host"] == 0 and hot_sets[1].graph.refusals == {}
    assert not decoder.tracked


def test_a_step_ended_late_plans_the_step_after_the_next():
    """The eager step's rhythm alone (``importance_torch``): a request's first step ends at
    once, a later one only once the next step has run, and the plan made then is for the step
    after that (at length 12, ending the step of length 11 plans 13 tokens: 4 pages, where
    planning the next step of 11 would say 3); ``end_pending`` ends the last."""
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=1.0)
    world = World("torch", params, device_pages=48, host_pages=0, release=False, plan_ahead=True)
    g = torch.Generator().manual_seed(2)
    _place((world,), g, "r", 2 * PAGE + 1)
    hot_set = world.backend.hot_set
    decoder = hot_set.decoder
    for steps in range(1, 4):  # lengths 10, 11, 12
        world.step(*_draws(g, 1))
        assert decoder.totals.steps == max(1, steps - 1)
        ahead = decoder.tracked["r"].next_plan
        if steps == 2:  # the plan step 1's end made was taken by step 2, which waits to end
            assert ahead is None
        else:
            assert ahead[0] == -(-(world.written["r"] + 1) // PAGE)
    hot_set.end_pending()
    assert decoder.totals.steps == 3 and hot_set.late.pending is None


@pytest.mark.slow  # ~30 s under the interpreter: in `make test`, out of the inner loop
def test_guarded_captured_steps_ended_a_step_late_decode_as_eager_ones():
    """The guard's tally read back with the step's (``GraphGuard.read_back``) and folded a step
    later, from the lists that step was planned with, while the next step's are written."""
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=0.05)
    eager, runner, g = _twins(params, [("a", 20), ("b", 23)], 7, device_pages=96, host_pages=0, release=False)
    for _ in range(3):
        _step_both(eager, runner, g)
    hot_sets = [w.backend.hot_set for w in (eager, runner.world)]
    for h in hot_sets:
        h.end_pending()
    totals = [h.decoder.totals.as_dict() for h in hot_sets]
    graph_steps, graph_eager = totals[1].pop("graph_steps"), totals[1].pop("graph_eager")
    assert {k: v for k, v in totals[0].items() if not k.startswith("graph_")} == totals[1]
    # The dense warm-up (eager) ends at once: the next step is planned from it and replayed.
    assert runner.variants_run == [None, "hot_guard", "hot_guard"]
    assert graph_steps == 2 and graph_eager == 1 and totals[1]["guard_checks"] > 0
