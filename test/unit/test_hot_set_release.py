"""Hot-set pages leave the device and come back: the host copy is exact, freed device
pages are re-used by other requests, and requests whose KV together exceeds the
device pool decode exactly as they do with every page on the device."""

from __future__ import annotations

import pytest
import torch

from sgl_importance.hot_set import HotSetDecoder, HotSetParams, PageSummaries
from sgl_importance.hot_set.key_codes import quantise
from sgl_importance.hot_set.residency import RELEASED_SLOT, ReleaseCounts, Released, RequestPages, subtract_pages
from support.array_pools import ArrayPools

PAGE = 4
KV_HEADS, GROUP, DIM = 2, 2, 8
LAYERS = 2


def array_pools(device_pages: int, host_pages: int) -> ArrayPools:
    return ArrayPools(
        layers=LAYERS, kv_heads=KV_HEADS, dim=DIM, page_size=PAGE, device_pages=device_pages, host_pages=host_pages
    )


def test_subtract_pages_leaves_out_exactly_the_released_positions():
    assert subtract_pages([(0, 40)], [2, 3, 7], 4) == [(0, 8), (16, 28), (32, 40)]
    assert subtract_pages([(10, 14), (20, 30)], [3], 4) == [(10, 12), (20, 30)]
    assert subtract_pages([(8, 12)], [2], 4) == []
    assert subtract_pages([(0, 8)], [], 4) == [(0, 8)]


def filled_request(tiers: ArrayPools, num_pages: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    slots = tiers.alloc_device(num_pages)
    tiers.k[:, slots] = torch.randn(LAYERS, slots.numel(), KV_HEADS, DIM, generator=g)
    tiers.v[:, slots] = torch.randn(LAYERS, slots.numel(), KV_HEADS, DIM, generator=g)
    row = torch.zeros(64 * PAGE, dtype=torch.int32)
    row[: slots.numel()] = slots.to(torch.int32)
    return row, slots


def test_a_released_page_comes_back_with_the_same_kv_in_another_device_page():
    tiers = array_pools(device_pages=8, host_pages=8)
    row, slots = filled_request(tiers, 5)
    before_k, before_v = tiers.k[:, slots].clone(), tiers.v[:, slots].clone()
    pages, counts = RequestPages(row, first_owned_page=1, page_size=PAGE), ReleaseCounts()
    pages.release(torch.tensor([0, 2, 3]), tiers, counts)
    # Page 0 belongs to the tree (before first_owned_page): it stays.
    assert pages.released_pages().tolist() == [2, 3]
    assert (row[2 * PAGE : 4 * PAGE] == RELEASED_SLOT).all()
    assert counts.pages_released == 2 and counts.pages_copied_out == 2
    # Another request takes the freed device pages and overwrites them.
    other = tiers.alloc_device(5)
    tiers.k[:, other] = -1.0
    tiers.free_device(other[: 3 * PAGE])  # it keeps two pages
    pages.restore(torch.tensor([2, 3]), tiers, counts)
    assert pages.released_pages().numel() == 0 and counts.pages_copied_in == 2
    now = row[: 5 * PAGE].to(torch.int64)
    assert torch.equal(tiers.k[:, now], before_k) and torch.equal(tiers.v[:, now], before_v)
    # Released again, a page is not copied out twice: the host copy stands.
    pages.release(torch.tensor([2]), tiers, counts)
    assert counts.pages_copied_out == 2 and counts.pages_released == 3
    free_before = len(tiers.free_host_pages)
    pages.drop(tiers)
    assert len(tiers.free_host_pages) == free_before + 2


def test_no_free_page_is_counted_and_nothing_moves():
    tiers = array_pools(device_pages=6, host_pages=1)
    row, _ = filled_request(tiers, 4)
    pages, counts = RequestPages(row, first_owned_page=0, page_size=PAGE), ReleaseCounts()
    pages.release(torch.tensor([1, 2]), tiers, counts)  # two pages, one host page
    assert counts.releases_refused == 2 and pages.released_pages().numel() == 0
    pages.release(torch.tensor([1]), tiers, counts)
    tiers.alloc_device(len(tiers.free_device_pages))  # the device fills up
    still = pages.restore(torch.tensor([1]), tiers, counts)
    assert still.tolist() == [1] and counts.promotions_refused == 1
    assert (row[PAGE : 2 * PAGE] == RELEASED_SLOT).all()


class Request:
    """One request's KV by position (the truth), placed in a decoder's pools."""

    def __init__(self, rid: str, pages: int, seed: int) -> None:
        self.rid = rid
        self.g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(LAYERS, pages * PAGE, KV_HEADS, DIM, generator=self.g)
        self.v = torch.randn(LAYERS, pages * PAGE, KV_HEADS, DIM, generator=self.g)
        self.row = torch.zeros(256 * PAGE, dtype=torch.int32)

    @property
    def length(self) -> int:
        return self.k.shape[1]

    def grow(self) -> None:
        extra = (LAYERS, 1, KV_HEADS, DIM)
        self.k = torch.cat((self.k, torch.randn(extra, generator=self.g)), dim=1)
        self.v = torch.cat((self.v, torch.randn(extra, generator=self.g)), dim=1)


class Placed:
    """A decoder over a pool; ``place`` writes a request's new tokens into it."""

    def __init__(self, tiers: ArrayPools, released: Released, guard: float) -> None:
        self.tiers = tiers
        self.summaries = PageSummaries(LAYERS, tiers.k.shape[1] // PAGE, KV_HEADS, DIM, page_size=PAGE)
        params = HotSetParams(policy="importance", budget=4, window=1, sinks=1, guard_threshold=guard)
        self.decoder = HotSetDecoder(params, self.summaries, page_size=PAGE, threshold=8, released=released)
        self.requests: dict[str, Request] = {}
        self.written: dict[str, int] = {}

    def place(self, req: Request) -> None:
        done = self.written.get(req.rid, 0)
        for pos in range(done, req.length):
            if pos % PAGE == 0:
                req.row[pos : pos + PAGE] = self.tiers.alloc_device(1).to(torch.int32)
            slot = int(req.row[pos])
            self.tiers.k[:, slot], self.tiers.v[:, slot] = req.k[:, pos], req.v[:, pos]
            for layer in range(LAYERS):
                self.summaries.update(layer, torch.tensor([slot]), req.k[layer, pos : pos + 1])
        self.written[req.rid] = req.length
        self.requests[req.rid] = req

    def step(self, queries: torch.Tensor):
        reqs = list(self.requests.values())
        rows = [r.row for r in reqs]
        self.decoder.begin_step([r.rid for r in reqs], [r.row[: r.length].to(torch.int64) for r in reqs], rows)
        outs = [
            self.decoder.attend(layer, queries[layer], self.tiers.k[layer], self.tiers.v[layer], sm_scale=0.4)
            for layer in range(LAYERS)
        ]
        return outs, self.decoder.end_step()


@pytest.mark.parametrize("guard", [1.0, 0.05])
def test_requests_whose_kv_exceeds_the_device_pool_decode_as_with_every_page_on_the_device(guard):
    # Three requests of 20 pages (60 pages with what they generate) on a 32-page
    # device: each is prefilled after the previous ones released what their hot
    # sets (4 pages) leave out. The reference keeps everything on a large device.
    reference = Placed(array_pools(device_pages=200, host_pages=0), Released(), guard)
    released = Released()
    small = array_pools(device_pages=32, host_pages=100)
    released.enable(small, threshold=8)
    physical = Placed(small, released, guard)
    g = torch.Generator().manual_seed(7)
    truth = [Request(f"r{i}", 20, seed=i) for i in range(3)]
    copies = [Request(f"r{i}", 20, seed=i) for i in range(3)]
    totals = None
    for step in range(12):
        if step % 4 == 0 and step // 4 < 3:  # a new request joins every fourth step
            i = step // 4
            reference.place(truth[i])
            released.admit(copies[i].rid, first_owned_page=0)
            physical.place(copies[i])
        q = torch.randn(LAYERS, len(reference.requests), KV_HEADS * GROUP, DIM, generator=g)
        want, _ = reference.step(q)
        got, totals = physical.step(q)
        for a, b in zip(want, got):
            assert torch.equal(a.output, b.output)
            assert torch.equal(a.importance, b.importance)
        for group in (truth, copies):
            for req in group[: step // 4 + 1]:
                req.grow()
        for placed, group in ((reference, truth), (physical, copies)):
            for req in group[: step // 4 + 1]:
                placed.place(req)
    total_kv_pages = sum(-(-r.length // PAGE) for r in copies)
    assert total_kv_pages > small.device_pages
    assert small.peak_used <= small.device_pages
    moved = physical.decoder.totals
    assert moved.pages_released > 0 and moved.pages_copied_out > 0
    assert moved.pages_copied_in > 0  # promotions happened, on pages others had used
    if guard < 1.0:
        # The guard added released pages the device had no room for: read from the host.
        assert moved.late_arrivals > 0 and moved.pages_read_from_host > 0
    # Leaving frees every host copy.
    for req in copies:
        released.forget(req.rid)
    assert len(small.free_host_pages) == 100


def test_key_codes_land_under_their_own_page_when_two_requests_fill_and_release_pages_in_one_step():
    released = Released()
    pools = array_pools(device_pages=120, host_pages=120)
    released.enable(pools, threshold=8)
    placed = Placed(pools, released, guard=0.1)
    # Two guarded requests; the second is one token short of filling its last page, so
    # the step that fills it also releases it (outside a 4-page hot set).
    first, second = Request("a", 12, seed=1), Request("b", 10, seed=2)
    for req in (first, second):
        placed.place(req)
        released.admit(req.rid, first_owned_page=0)
    g = torch.Generator().manual_seed(3)
    for _ in range(PAGE + 1):
        for req in (first, second):
            req.grow()
            placed.place(req)
        placed.step(torch.randn(LAYERS, 2, KV_HEADS * 2, 8, generator=g))
    decoder = placed.decoder
    assert decoder.totals.pages_released > 0
    for req in (first, second):
        tracked = decoder.tracked[req.rid]
        codes = tracked.codes
        assert codes.numel() >= (req.length - 1) // PAGE  # every page full before this step is coded
        for layer in range(LAYERS):
            pages = req.k[layer, : codes.numel() * PAGE].view(codes.numel(), PAGE, *req.k.shape[2:])
            want = quantise(pages, pages.amin(dim=1), pages.amax(dim=1))
            got, _ = decoder.guard.gather(layer, codes)
            assert torch.equal(got, want)
