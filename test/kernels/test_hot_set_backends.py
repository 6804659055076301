"""importance_triton runs the hot set as importance_torch does, through the backends' own code.

Two worlds with the same pool, requests and queries: one drives
``ImportanceTorchAttnBackend``, the other ``ImportanceTritonAttnBackend``, through their
``init_forward_metadata`` and ``forward_decode`` (KV write, hot-set
attend, the step's end on the last layer). Each layer's output must agree within
float32 rounding, the page importance tables must file the same importance, and the hot-set
counts (pages attended, estimated, guarded, promoted, released, read from the host)
must be equal, with the guard off and on and with pages released to a host pool.

The worlds (``support/hot_set_world.py``) stand in only for the SGLang parents'
metadata and the KV pool; the backends' own code runs.

Runs under TRITON_INTERPRET=1 on a CPU (conftest.py), small shapes.
"""

from __future__ import annotations

import contextlib
from functools import partial
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")
pytest.importorskip("sglang", reason="the backends subclass SGLang's")

from sgl_importance.attention.hot_set_graphs import eager_with_hot_set_requests  # noqa: E402
from sgl_importance.hot_set import HotSetParams  # noqa: E402
from sgl_importance.importance import page_importance  # noqa: E402
from sgl_kernel_ext import scatter_page_importance  # noqa: E402
from support.host_syncs import HostSyncCounter  # noqa: E402
from support.hot_set_world import DIM, KV_HEADS, LAYERS, Q_HEADS, THRESHOLD, World, parents_metadata  # noqa: E402
from support.kernel_device import DEVICE, EMPTY_PAGES_WARN  # noqa: E402

pytestmark = [EMPTY_PAGES_WARN]

OUT_ATOL = 2e-5
IMP_ATOL = 2e-6


@pytest.fixture(autouse=True)
def _parents_metadata():
    with parents_metadata():
        yield


def run_both(params: HotSetParams, *, steps: int, lengths: list[int], **world) -> dict[str, int]:
    """Decode ``steps`` steps in both backends, comparing every layer; returns the summed counts."""
    # The Triton backend reads no host copy in a guarded layer (a released page it wants is a
    # miss); the torch one does where the host pool has page views: off here, like with like.
    worlds = [World("torch", params, **world, host_views=False), World("triton", params, **world)]
    g = torch.Generator().manual_seed(5)
    prompts = {
        f"r{i}": [torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) * s for s in (1.5, 1.0)]
        for i, n in enumerate(lengths)
    }
    for rid, (k, v) in prompts.items():
        for w in worlds:
            w.place(rid, k, v)
    bs = len(lengths)
    for step in range(steps):
        k_new, v_new = (torch.randn(LAYERS, bs, KV_HEADS, DIM, generator=g) for _ in range(2))
        q = torch.randn(LAYERS, bs, Q_HEADS, DIM, generator=g) * 2
        want, got = (w.step(k_new, v_new, q) for w in worlds)
        for layer, (a, b) in enumerate(zip(want, got)):
            assert torch.allclose(b, a, atol=OUT_ATOL, rtol=0), f"step {step} layer {layer}"
        tables = [w.page_importance for w in worlds]
        assert bool((tables[0].last > 0).any()), "the attended pages' masses are filed"
        assert torch.allclose(tables[1].last, tables[0].last, atol=IMP_ATOL, rtol=0), f"step {step}"
        assert not worlds[1].backend.hot_set.in_step, "the batch's end ends the step"
    totals = [w.backend.hot_set.decoder.totals.as_dict() for w in worlds]
    assert totals[1] == totals[0]
    # Both backends rewrote their request rows the same way (releases and promotions).
    assert torch.equal(worlds[0].req_to_token, worlds[1].req_to_token)
    return totals[1]


@pytest.mark.parametrize("guard", [1.0, 0.05])
def test_triton_backend_decodes_the_hot_set_as_the_torch_backend(guard):
    # A short request (dense) beside two long ones; the device holds everything.
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=guard)
    totals = run_both(params, steps=3, lengths=[5, 30, 41], device_pages=64, host_pages=0, release=False)
    assert totals["steps"] == 6 and totals["pages_attended"] <= totals["pages_dense"]
    if guard < 1.0:
        # A 3-page budget leaves no room for a page sample: the guard reads what the
        # bound cannot vouch for, from the same pages in both backends.
        assert totals["guard_checks"] > 0 and totals["guard_reads"] > 0
    else:
        assert totals["pages_attended"] < totals["pages_dense"]


@pytest.mark.parametrize("guard,promotions", [(1.0, False), (0.05, True), (1.0, True)])
def test_triton_backend_releases_and_promotes_pages_as_the_torch_backend(guard, promotions):
    # Pages outside each request's 3-page hot set go to the host pool and come back when
    # planned; with no device page for a promotion they are read from the host copy.
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=guard)
    totals = run_both(
        params, steps=4, lengths=[33, 30], device_pages=40, host_pages=64, release=True, promotions=promotions
    )
    assert totals["pages_released"] > 0
    if promotions and guard == 1.0:
        assert totals["pages_copied_in"] > 0
    elif promotions:
        assert totals["guard_reads"] > 0
    else:
        assert totals["promotions_refused"] > 0 and totals["pages_read_from_host"] > 0


def _replays(world: World, config: SimpleNamespace) -> bool:
    """Whether SGLang would replay a captured graph for the world's next step (its own check
    passing), with the plugin's hook around that check."""
    lengths = torch.tensor([world.written[rid] + 1 for rid in world.rows])
    runner = SimpleNamespace(require_mlp_sync=False)
    return eager_with_hot_set_requests(config, lambda r, b: True, runner, SimpleNamespace(seq_lens_cpu=lengths))


def _refused(*args, **kwargs):
    raise AssertionError("a CUDA graph's step called the hot set's decoder")


def test_short_batches_replay_graphs_that_read_every_page_without_the_decoder(monkeypatch):
    # A long request beside a short one decodes eagerly through the hot set; once it has
    # finished, the short one's steps are graph steps: the captured dense decode gives what
    # importance_torch's eager hot-set steps give (outputs, importance, key ranges),
    # the decoder is never called, and its state of the finished request is dropped. A new
    # long request runs eagerly again.
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=0.05)
    pools = dict(device_pages=64, host_pages=0, release=False)
    eager, graphed = World("torch", params, **pools), World("triton", params, **pools)
    # Start-up: the graphs' state is built with the hot set on (it used to refuse here).
    graphed.backend.init_cuda_graph_state(4, 4)
    assert graphed.backend.graph_wrapper is not None
    config = SimpleNamespace(hot_set_policy="importance", hot_set_threshold=THRESHOLD)
    decoder = graphed.backend.hot_set.decoder
    g = torch.Generator().manual_seed(9)

    def place(rid: str, n: int) -> None:
        k, v = (torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) for _ in range(2))
        for w in (eager, graphed):
            w.place(rid, k, v)

    def step(graph: bool, counter=None) -> None:
        bs = len(graphed.rows)
        k_new, v_new = (torch.randn(LAYERS, bs, KV_HEADS, DIM, generator=g) for _ in range(2))
        q = torch.randn(LAYERS, bs, Q_HEADS, DIM, generator=g) * 2
        want, got = eager.step(k_new, v_new, q), graphed.step(k_new, v_new, q, graph=graph, counter=counter)
        for layer, (a, b) in enumerate(zip(want, got)):
            assert torch.allclose(b, a, atol=OUT_ATOL, rtol=0), f"layer {layer}"
        assert torch.allclose(graphed.page_importance.last, eager.page_importance.last, atol=IMP_ATOL, rtol=0)
        kept = []  # each world's key ranges of the long request's summarised pages, every layer
        for w in (eager, graphed):
            d = w.backend.hot_set.decoder
            ids = d.tracked["long"].ranges if "long" in d.tracked else torch.zeros(0, dtype=torch.long)
            kept.append([d.ranges.gather(layer, ids) for layer in range(LAYERS)])
        for (low_e, high_e), (low_g, high_g) in zip(*kept):
            assert torch.equal(low_g, low_e) and torch.equal(high_g, high_e)

    place("long", 30)
    place("short", 2)
    for _ in range(2):
        assert not _replays(graphed, config)
        step(graph=False)
    assert set(decoder.tracked) == {"long"} and decoder.guard.pages_in_use > 0
    for w in (eager, graphed):
        w.finish("long")
    counter = HostSyncCounter()
    with monkeypatch.context() as m:
        for name in ("begin_step", "attend", "end_step"):
            m.setattr(decoder, name, _refused)
        # The table scatters with its GPU kernel, as it does on a device.
        m.setattr(page_importance, "scatter_page_importance", partial(scatter_page_importance, use_triton=True))
        for _ in range(3):
            assert _replays(graphed, config)
            step(graph=True, counter=counter)
    assert decoder.tracked == {} and decoder.guard.pages_in_use == 0
    # What a captured graph holds (the layers: KV write, decode, importance,
    # the step's close) never hands a device value to the host.
    assert sum(counter.total(where=layer) for layer in range(LAYERS)) == 0, counter.by("site")
    assert counter.total(where="host") > 0  # it was counting: the stand-in parent plans with .tolist()
    assert eager.backend.hot_set.decoder.tracked == {}
    place("late", 20)
    assert not _replays(graphed, config)
    step(graph=False)
    assert set(decoder.tracked) == {"late"}


class _OnFakeCuda:
    """The Triton kernel run outside ``FakeCuda`` (the interpreter reads tensors on the
    host), its results tagged as the device tensors they are on a GPU."""

    def __init__(self, mode, reader) -> None:
        self.mode, self.reader = mode, reader

    def __call__(self, *args, **kwargs):
        with torch._C.DisableTorchFunction():
            result = self.reader(*args, **kwargs)
        return self.mode.tag(tuple(result)) and result


@pytest.mark.parametrize(
    "policy,guard,release,promotions",
    [("importance", 1.0, False, True), ("importance", 0.05, True, True), ("importance", 1.0, True, False),
     ("quest", 0.05, False, True)],
)  # fmt: skip
def test_triton_backend_hot_set_keeps_host_and_device_tensors_apart(policy, guard, release, promotions):
    # Everything SGLang keeps on the GPU (pool, req_to_token, page table, the batch, q/k/v)
    # is on a stand-in CUDA device; no op may mix it with host tensors, as CUDA refuses to.
    # Planning stays on the host; the layers' arithmetic and the step's tally on the device.
    from support.fake_cuda import FakeCuda

    params = HotSetParams(policy=policy, budget=3, window=1, sinks=1, guard_threshold=guard)
    pages = dict(device_pages=40, host_pages=64) if release else dict(device_pages=64, host_pages=0)
    g = torch.Generator().manual_seed(5)
    lengths = [5, 30, 41]
    prompts = [[torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) for _ in range(2)] for n in lengths]
    # A real GPU refuses mixed devices itself; elsewhere a stand-in device checks every op.
    real = DEVICE == "cuda"
    with contextlib.nullcontext() if real else FakeCuda() as mode:
        world = World("triton", params, release=release, promotions=promotions, device="cuda", **pages)
        decoder = world.backend.hot_set.decoder
        if not real:
            decoder.exact = _OnFakeCuda(mode, decoder.exact)
        for i, (k, v) in enumerate(prompts):
            world.place(f"r{i}", k, v)
        for _ in range(3):
            shapes = [(LAYERS, len(lengths), KV_HEADS, DIM)] * 2 + [(LAYERS, len(lengths), Q_HEADS, DIM)]
            world.step(*(torch.randn(*shape, generator=g) for shape in shapes))
    assert decoder.totals.steps > 0 and (not release or decoder.totals.pages_released > 0)
    if real:
        return
    if not promotions:
        assert decoder.totals.pages_read_from_host > 0  # staged from the host pool
    assert not mode.violations, "\n".join(f"{where}: {why}" for where, why in mode.violations.items())
