"""The hot set with the Triton kernel as its exact reader decodes as with the torch path.

Two identical worlds (pools, requests, queries) run the same decode steps, one with
``HotSetDecoder``'s default exact reader (``decode_importance_paged``), one with
``TritonPageListDecode``: every layer must attend the same pages and give the same
output and importance within float32 rounding, and the steps' counts (pages read,
estimated, guarded, promoted, released, read from the host) must be equal. With the
guard off and on; with pages released to a host pool too small a device for all of
them, so some planned pages are staged and read from their host copies.

Runs under TRITON_INTERPRET=1 on a CPU (conftest.py), small shapes. The seeds are
fixed: a guard decision near its threshold could flip on the last bit, and the test is
about the same decisions being taken from the same numbers.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")

from sgl_importance.hot_set import HotSetDecoder, HotSetParams, KeyRanges  # noqa: E402
from sgl_importance.hot_set.residency import Residency  # noqa: E402
from sgl_kernel_ext import TritonPageListDecode  # noqa: E402
from support.array_pools import ArrayPools  # noqa: E402
from support.kernel_device import DEVICE, EMPTY_PAGES_WARN  # noqa: E402

pytestmark = [
    EMPTY_PAGES_WARN,
    # This world keeps its pool and rows on the host; on a GPU the same decoder runs on the
    # device in test_hot_set_backends.py (torch and Triton backends compared step by step).
    pytest.mark.skipif(DEVICE == "cuda", reason="host-tensor world; the GPU runs test_hot_set_backends.py"),
]

PAGE = 4
KV_HEADS, GROUP, DIM = 2, 2, 16
LAYERS = 2
SCALE = DIM**-0.5
OUT_ATOL = 2e-5
IMP_ATOL = 2e-6


class World:
    """A decoder over a pool, fed requests token by token (the same in every world)."""

    def __init__(self, params: HotSetParams, *, device_pages, host_pages, release, promotions=True, exact=None):
        self.tiers = ArrayPools(
            layers=LAYERS, kv_heads=KV_HEADS, dim=DIM, page_size=PAGE,
            device_pages=device_pages, host_pages=host_pages, promotions=promotions,
            # The Triton reader reads no host copy (a released page it wants is a miss): the
            # torch world's host reads are off too, to compare like with like.
            host_views=False,
        )  # fmt: skip
        self.residency = Residency()
        if release:
            self.residency.enable(self.tiers, threshold=8)
        num_pages = self.tiers.k.shape[1] // PAGE
        ranges = KeyRanges(LAYERS, KV_HEADS, DIM, capacity_pages=4 * num_pages)
        self.decoder = HotSetDecoder(
            params, ranges, pool_pages=num_pages, page_size=PAGE, threshold=8, residency=self.residency, exact=exact
        )
        self.rows: dict[str, torch.Tensor] = {}
        self.written: dict[str, int] = {}

    def place(self, rid: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the request's tokens not yet in the pool (``k``/``v``: ``[LAYERS, n, KV, D]``)."""
        if rid not in self.rows:
            self.rows[rid] = torch.zeros(64 * PAGE, dtype=torch.int32)
            self.residency.admit(rid, self.rows[rid], first_owned_page=0, page_size=PAGE)
        row = self.rows[rid]
        for pos in range(self.written.get(rid, 0), k.shape[1]):
            if pos % PAGE == 0:
                row[pos : pos + PAGE] = self.tiers.alloc_device(1, for_tokens=True).to(torch.int32)
            slot = int(row[pos])
            self.tiers.k[:, slot], self.tiers.v[:, slot] = k[:, pos], v[:, pos]
        self.written[rid] = k.shape[1]

    def step(self, queries: torch.Tensor):
        rids = list(self.rows)
        slots = [self.rows[r][: self.written[r]].to(torch.int64) for r in rids]
        rows = [self.rows[r] for r in rids] if self.residency.enabled else None
        with self.tiers.forward():
            self.decoder.begin_step(rids, slots, rows)
            outs = [
                self.decoder.attend(layer, queries[layer], self.tiers.k[layer], self.tiers.v[layer], sm_scale=SCALE)
                for layer in range(LAYERS)
            ]
        # After the forward, as the scheduler does after a batch: the step ends, its moves are made.
        counts, moves = self.decoder.end_step()
        self.residency.apply(moves)
        counts.add(self.residency.take_counts())
        return outs, counts


def run_both(params: HotSetParams, *, steps: int, lengths: list[int], **world):
    """Decode ``steps`` steps in both worlds, comparing every layer; returns the summed counts."""
    worlds = [World(params, **world), World(params, **world, exact=TritonPageListDecode())]
    g = torch.Generator().manual_seed(11)
    kv = {
        f"r{i}": [torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) * s for s in (1.5, 1.0)]
        for i, n in enumerate(lengths)
    }
    totals = []
    for step in range(steps):
        for rid, (k, v) in kv.items():
            for world in worlds:
                world.place(rid, k, v)
        q = torch.randn(LAYERS, len(kv), KV_HEADS * GROUP, DIM, generator=g) * 2
        (want, want_counts), (got, got_counts) = (world.step(q) for world in worlds)
        for layer, (a, b) in enumerate(zip(want, got)):
            where = f"step {step} layer {layer}"
            assert torch.equal(a.kv_indptr, b.kv_indptr) and torch.equal(a.kv_indices, b.kv_indices), where
            assert torch.allclose(b.output, a.output, atol=OUT_ATOL, rtol=0), where
            assert torch.allclose(b.importance, a.importance, atol=IMP_ATOL, rtol=0), where
        assert got_counts.as_dict() == want_counts.as_dict(), f"step {step}"
        totals.append(got_counts.as_dict())
        for rid, (k, v) in kv.items():  # every request decodes one more token
            kv[rid] = [torch.cat((t, torch.randn(LAYERS, 1, KV_HEADS, DIM, generator=g)), dim=1) for t in (k, v)]
    return {key: sum(t[key] for t in totals) for key in totals[0]}


@pytest.mark.parametrize("guard", [1.0, 0.05])
def test_the_triton_reader_attends_the_same_pages_as_the_torch_path(guard):
    # A short request (dense) beside two long ones; the device holds everything.
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=guard)
    totals = run_both(params, steps=4, lengths=[5, 30, 41], device_pages=64, host_pages=0, release=False)
    assert totals["steps"] == 8 and totals["warmups"] == 2
    if guard < 1.0:
        # No room for a page sample in a 3-page hot set: the guard reads what it cannot vouch for.
        assert totals["guard_checks"] > 0 and totals["guard_reads"] > 0


def test_the_triton_reader_follows_quests_per_layer_lists():
    params = HotSetParams(policy="quest", budget=3, window=1, sinks=1, guard_threshold=1.0)
    run_both(params, steps=3, lengths=[29, 37], device_pages=64, host_pages=0, release=False)


@pytest.mark.parametrize("guard,promotions", [(1.0, False), (0.05, True)])
def test_pages_read_from_the_host_pool_are_merged_into_the_same_softmax(guard, promotions):
    # Pages outside each request's 3-page hot set go to the host pool. Planned pages the
    # device has no room for (promotions=False) are staged from their host copies: the
    # kernel's part and the torch part merge. Guarded, released pages a layer wants are
    # misses (the Triton reader reads no host copy inside a layer), promoted for later steps.
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=guard)
    totals = run_both(
        params, steps=5, lengths=[33, 30, 40], device_pages=40, host_pages=64, release=True, promotions=promotions
    )
    assert totals["pages_released"] > 0
    assert totals["pages_read_from_host"] > 0 if guard == 1.0 else totals["pages_missed"] > 0
    if not promotions:
        assert totals["promotions_refused"] > 0
