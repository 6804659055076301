"""A guarded hot-set layer never waits on the host when its pages are on the device, and
its CUDA branch (the masked-pages kernel) reads what its CPU branch reads.

Issue 34: on a GPU every read of a device value by the host (``.item()``, ``bool(t)``,
``.cpu()``, ``nonzero``, boolean-mask indexing...) stalls the step. A hot-set world
(``support/hot_set_world.py``: a short request beside long ones, pages kept on the
device) decodes guarded steps through a backend's ``forward_decode`` under
``HostSyncCounter``, which counts every such call the plugin makes on any tensor (on
a CPU an upper bound). Each layer's ``HotSetDecoder.attend`` is filed under its own
label, and the step's planning, done once where it begins (the host builds the
step's lists there), under the default one: every layer's attend, the guard
included, must count 0. The guard must have had work to do: pages read exactly,
some estimated, bounds both under and over the threshold.

Runs on a CPU (the torch backend's paths; the Triton backend's kernels under
TRITON_INTERPRET=1, conftest.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang", reason="the backends subclass SGLang's")

from sgl_importance.hot_set import HotSetParams  # noqa: E402
from support.host_syncs import STEP, SYNC_KINDS, HostSyncCounter  # noqa: E402
from support.hot_set_world import DIM, KV_HEADS, PAGE, Q_HEADS, World, parents_metadata  # noqa: E402
from support.kernel_device import DEVICE, EMPTY_PAGES_WARN  # noqa: E402

# Slow (10-12 s a case under the interpreter): make test runs it, make test-fast does not.
pytestmark = [EMPTY_PAGES_WARN, pytest.mark.slow]

LAYERS = 3
LENGTHS = [5, 120, 180, 150]


def guarded_world(kind: str, threshold: float) -> World:
    params = HotSetParams(policy="importance", budget=0.2, window=1, sinks=1, guard_threshold=threshold)
    pages = sum(-(-(n + 8) // PAGE) for n in LENGTHS) + 4
    return World(kind, params, release=False, device=DEVICE, layers=LAYERS, device_pages=pages, host_pages=0)


def label_attend(world: World, counter: HostSyncCounter) -> None:
    """File each layer's ``HotSetDecoder.attend`` under ``attend <layer>``."""
    decoder = world.backend.hot_set.decoder
    attend = decoder.attend

    def labelled_attend(layer_id, *args, **kwargs):
        with counter.where(f"attend {layer_id}"):
            return attend(layer_id, *args, **kwargs)

    decoder.attend = labelled_attend


@pytest.mark.parametrize("kind", ["torch", "triton"])
@pytest.mark.parametrize("threshold", [0.1, 0.5])
def test_every_guarded_layers_attend_makes_no_host_round_trip(kind, threshold):
    if kind == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    world = guarded_world(kind, threshold)
    counter = HostSyncCounter()
    label_attend(world, counter)
    g = torch.Generator().manual_seed(0)
    with parents_metadata():
        for i, n in enumerate(LENGTHS):
            keys = torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g)
            keys[:, ::7] *= 4  # pages the guard finds heavy
            world.place(f"r{i}", keys, torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g))
        bs = len(LENGTHS)
        for step in range(4):
            kv = [torch.randn(LAYERS, bs, KV_HEADS, DIM, generator=g) for _ in range(2)]
            q = torch.randn(LAYERS, bs, Q_HEADS, DIM, generator=g) * 2
            if step < 2:  # the requests' first steps start their hot sets and codes
                world.step(*kv, q)
                continue
            with counter:
                counter.begin_step()
                world.step(*kv, q)
    totals = world.backend.hot_set.decoder.totals
    assert totals.guard_checks > 0 and totals.pages_guard_read > 0 and totals.pages_estimated > 0
    assert totals.guard_flagged < totals.guard_checks  # some layers were vouched for
    for layer in range(LAYERS):
        sites = {
            e.site: n for e, n in counter.counted().items() if e.where == f"attend {layer}" and e.kind in SYNC_KINDS
        }
        assert not sites, f"layer {layer}: {sites}"
    assert counter.total(where=STEP) > 0  # the step's lists are planned on the host, where it begins


@pytest.mark.parametrize("release", [False, True])
def test_the_guards_kernel_path_gives_what_its_torch_path_gives(monkeypatch, release):
    """The decoder's Triton branch (a captured step's guarded layer run eagerly, ``read_rest``
    and ``weigh_bounds_triton``: the key codes read by range id, the sample from the pool, the
    masked-pages read, the layer's end in one kernel), run here under the interpreter,
    against its CPU branch (torch, the exact reader over the fixed table); with released
    rest pages neither reads them (misses: the CPU branch's host reads are off here, as
    where the host pool has no page views)."""
    pytest.importorskip("triton", reason="triton is not installed")
    import sgl_importance.hot_set.decode as decode
    import sgl_importance.hot_set.guard.layer as layer
    import sgl_importance.hot_set.guard_reads as guard_reads

    def run(kernel: bool):
        if kernel:
            for module in (guard_reads, decode):
                monkeypatch.setattr(module, "reads_with_kernel", lambda decoder: True)
        monkeypatch.setattr(decode, "host_pages", lambda *args: None)
        params = HotSetParams(policy="importance", budget=0.2, window=1, sinks=1, guard_threshold=0.2)
        lengths = [5, 90, 120]
        pages = sum(-(-(n + 8) // PAGE) for n in lengths) + 4
        world = World(
            "torch", params, release=release, device=DEVICE, layers=2,
            device_pages=pages, host_pages=pages if release else 0,
        )  # fmt: skip
        reads, finished = [], []
        read_rest, finish = layer.read_rest, getattr(layer, "guard_finish_triton", None)

        def recorded(*args, **kwargs):
            reads.append(read_rest(*args, **kwargs))
            return reads[-1]

        def counted_finish(*args, **kwargs):
            finished.append(1)
            return finish(*args, **kwargs)

        for module in (layer, decode):  # guard_layer's, and the decoder's Triton branch's
            monkeypatch.setattr(module, "read_rest", recorded)
        monkeypatch.setattr(layer, "guard_finish_triton", counted_finish, raising=False)
        g = torch.Generator().manual_seed(4)
        outs = []
        with parents_metadata():
            for i, n in enumerate(lengths):
                keys = torch.randn(2, n, KV_HEADS, DIM, generator=g)
                keys[:, ::5] *= 4
                world.place(f"r{i}", keys, torch.randn(2, n, KV_HEADS, DIM, generator=g))
            for _ in range(4):
                kv = [torch.randn(2, len(lengths), KV_HEADS, DIM, generator=g) for _ in range(2)]
                q = torch.randn(2, len(lengths), Q_HEADS, DIM, generator=g) * 2
                outs += world.step(*kv, q)
        monkeypatch.undo()
        return outs, reads, len(finished), world.backend.hot_set.decoder.totals, world.page_importance.accumulated

    want_outs, want, want_finished, want_totals, want_importance = run(kernel=False)
    got_outs, got, got_finished, got_totals, got_importance = run(kernel=True)
    assert want and len(got) == len(want)
    assert want_finished == 0 and got_finished == len(got)  # each of its layers ended in the one kernel
    for a, b in zip(want, got):
        assert torch.equal(a.read, b.read) and torch.equal(a.wanted, b.wanted) and torch.equal(a.missed, b.missed)
        assert torch.allclose(a.out.float(), b.out.float(), atol=2e-5)
    for a, b in zip(want_outs, got_outs):
        assert torch.allclose(a, b, atol=2e-5)
    assert want_totals == got_totals
    assert torch.allclose(want_importance, got_importance, atol=1e-6)
    assert want_totals.pages_guard_read > 0 and want_totals.guard_flagged > 0
    if release:
        assert want_totals.pages_missed > 0  # released pages wanted: counted, never read in the layer
