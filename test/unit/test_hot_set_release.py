"""Hot-set pages leave the device and come back (in decode, and chunk by chunk while a long prompt
prefills: streamed prefill): the host copy is exact, freed device
pages are re-used by other requests, and requests whose KV together exceeds the
device pool decode exactly as they do with every page on the device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_importance.hot_set import HotSetDecoder, HotSetParams, KeyRanges
from sgl_importance.hot_set.guard.key_codes import quantise
from sgl_importance.hot_set.pages.prefix_hold import PrefixHold
from sgl_importance.hot_set.pages.state import RELEASED_SLOT, TRANSITIONS, PageState
from sgl_importance.hot_set.plan.request_state import TrackedRequest
from sgl_importance.hot_set.prefill import summarise_prefill
from sgl_importance.hot_set.request_params import RequestParams
from sgl_importance.hot_set.residency import Residency, subtract_pages
from sgl_importance.scheduler.hot_set_release import (
    admit_grown,
    checkpoint_unless_released,
    free_row_around_released,
    release_with_pages,
)
from support.array_pools import ArrayPools
from support.moves import promote, release

PAGE = 4
KV_HEADS, GROUP, DIM = 2, 2, 8
LAYERS = 2


def array_pools(device_pages: int, host_pages: int, host_views: bool = True) -> ArrayPools:
    return ArrayPools(
        layers=LAYERS, kv_heads=KV_HEADS, dim=DIM, page_size=PAGE, device_pages=device_pages, host_pages=host_pages,
        host_views=host_views,
    )  # fmt: skip


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


def residency_over(tiers: ArrayPools, threshold: int = 8) -> Residency:
    residency = Residency()
    residency.enable(tiers, threshold=threshold)
    return residency


def test_every_move_is_in_the_transition_table_and_any_other_raises():
    tiers = array_pools(device_pages=8, host_pages=8)
    residency = residency_over(tiers)
    row, _ = filled_request(tiers, 3)
    pages = residency.admit("r", row, first_owned_page=1, page_size=PAGE)
    assert pages.states(torch.arange(3)).tolist() == [PageState.TREE, PageState.RESIDENT, PageState.RESIDENT]
    # Each move names the states it leaves from; nothing else is allowed.
    assert set(TRANSITIONS["promote"]) == {PageState.RELEASED, PageState.LENT_RELEASED}
    with pytest.raises(RuntimeError, match="no move 'promote' from RESIDENT"):
        pages._move("promote", torch.tensor([1]))
    with pytest.raises(RuntimeError, match="no move 'lend' from RESIDENT"):
        pages._move("lend", torch.tensor([2]))
    assert pages.state.tolist() == [PageState.TREE, PageState.RESIDENT, PageState.RESIDENT]


def test_a_released_page_comes_back_with_the_same_kv_in_another_device_page():
    tiers = array_pools(device_pages=8, host_pages=8)
    residency = residency_over(tiers)
    row, slots = filled_request(tiers, 5)
    before_k, before_v = tiers.k[:, slots].clone(), tiers.v[:, slots].clone()
    pages, counts = residency.admit("r", row, first_owned_page=1, page_size=PAGE), residency.counts
    release(residency, [(pages, torch.tensor([0, 2, 3]))])
    # Page 0 belongs to the tree (before first_owned_page): it stays.
    assert pages.released_pages().tolist() == [2, 3]
    assert (row[2 * PAGE : 4 * PAGE] == RELEASED_SLOT).all()
    assert counts.pages_released == 2 and counts.pages_copied_out == 2 and counts.copies_out == 1
    # Another request takes the freed device pages and overwrites them.
    other = tiers.alloc_device(5)
    tiers.k[:, other] = -1.0
    tiers.free_device(other[: 3 * PAGE])  # it keeps two pages
    promote(residency, [(pages, torch.tensor([2, 3]))])
    assert pages.released_pages().numel() == 0 and counts.pages_copied_in == 2 and counts.copies_in == 1
    now = row[: 5 * PAGE].to(torch.int64)
    assert torch.equal(tiers.k[:, now], before_k) and torch.equal(tiers.v[:, now], before_v)
    # Released again, a page is not copied out twice: the host copy stands.
    release(residency, [(pages, torch.tensor([2]))])
    assert counts.pages_copied_out == 2 and counts.pages_released == 3
    free_before = len(tiers.free_host_pages)
    residency.forget("r")
    assert len(tiers.free_host_pages) == free_before + 2


def test_one_copy_each_way_moves_every_requests_pages_of_a_step():
    tiers = array_pools(device_pages=24, host_pages=24)
    residency = residency_over(tiers)
    records = []
    for rid in ("a", "b", "c"):
        row, _ = filled_request(tiers, 4)
        records.append(residency.admit(rid, row, first_owned_page=0, page_size=PAGE))
    release(residency, [(pages, torch.tensor([1, 2])) for pages in records])
    promote(residency, [(pages, torch.tensor([2])) for pages in records])
    counts = residency.counts
    assert (counts.pages_copied_out, counts.copies_out) == (6, 1)
    assert (counts.pages_copied_in, counts.copies_in) == (3, 1)


def test_no_free_page_is_counted_and_nothing_moves():
    tiers = array_pools(device_pages=6, host_pages=1)
    residency = residency_over(tiers)
    row, _ = filled_request(tiers, 4)
    pages, counts = residency.admit("r", row, first_owned_page=0, page_size=PAGE), residency.counts
    release(residency, [(pages, torch.tensor([1, 2]))])  # two pages, one host page
    assert counts.releases_refused == 2 and pages.released_pages().numel() == 0
    release(residency, [(pages, torch.tensor([1]))])
    tiers.alloc_device(len(tiers.free_device_pages))  # the device fills up
    promote(residency, [(pages, torch.tensor([1]))])
    assert pages.released_pages().tolist() == [1] and counts.promotions_refused == 1
    assert (row[PAGE : 2 * PAGE] == RELEASED_SLOT).all()


def lent_request(tiers: ArrayPools, num_pages: int, prefix_pages: int):
    """A request of ``num_pages`` whose first ``prefix_pages`` are the tree's (device
    pages and write-through host copies), lent to it: (row, slots, pages, residency)."""
    residency = residency_over(tiers)
    row, slots = filled_request(tiers, num_pages)
    tree_host = tiers.alloc_host(prefix_pages).to(torch.int64)
    tiers.to_host(slots[: prefix_pages * PAGE], tree_host)
    pages = residency.admit("r", row, first_owned_page=prefix_pages, page_size=PAGE)
    residency.lend_prefix(pages, tree_host)
    return row, slots, pages, residency


def test_a_lent_prefix_reads_the_tree_copies_and_frees_only_the_requests_own_pages():
    tiers = array_pools(device_pages=12, host_pages=12)
    # Pages 0-2: the tree's (a matched prefix); 3-4: the request's own.
    row, slots, pages, residency = lent_request(tiers, 5, 3)
    counts = residency.counts
    truth_k, truth_v = tiers.k[:, slots].clone(), tiers.v[:, slots].clone()
    tree_device = slots[: 3 * PAGE].clone()
    assert counts.prefix_pages_lent == 3 and pages.first_owned_page == 0
    assert (pages.state[:3] == PageState.LENT).all()
    free_device, free_host = len(tiers.free_device_pages), len(tiers.free_host_pages)
    release(residency, [(pages, torch.tensor([0, 2, 3]))])
    # The tree's pages 0 and 2 stop being read from the device, but their device pages are
    # the tree's: only page 3, the request's own, goes back (copied out once).
    assert len(tiers.free_device_pages) == free_device + 1 and len(tiers.free_host_pages) == free_host - 1
    assert counts.prefix_pages_released == 2 and counts.pages_released == 1 and counts.pages_copied_out == 1
    assert (row[:PAGE] == RELEASED_SLOT).all() and (row[2 * PAGE : 4 * PAGE] == RELEASED_SLOT).all()
    # Page 1, still planned, is copied into a device page of the request's own.
    assert residency.own_tree_pages(pages) and not (pages.state == PageState.LENT).any()
    assert counts.prefix_pages_owned == 1
    assert not set(row[PAGE : 2 * PAGE].tolist()) & set(tree_device.tolist())
    promote(residency, [(pages, torch.tensor([0, 2, 3]))])
    now = row[: 5 * PAGE].to(torch.int64)
    assert not set(now.tolist()) & set(tree_device.tolist())
    assert torch.equal(tiers.k[:, now], truth_k) and torch.equal(tiers.v[:, now], truth_v)
    # Leaving: the tree's host copies stay (only page 3's is freed), and where the tree
    # still has the prefix on the device the row points back at it, its copies freed.
    free_device = len(tiers.free_device_pages)
    residency.return_prefix(pages, tree_device)
    assert torch.equal(row[: 3 * PAGE].to(torch.int64), tree_device)
    assert len(tiers.free_device_pages) == free_device + 3
    free_host = len(tiers.free_host_pages)
    residency.forget("r")
    assert len(tiers.free_host_pages) == free_host + 1


def test_a_lent_prefix_without_device_room_keeps_the_tree_pages():
    tiers = array_pools(device_pages=4, host_pages=4)
    row, slots, pages, residency = lent_request(tiers, 4, 2)
    assert not residency.own_tree_pages(pages)  # the device is full: nothing moves
    assert (pages.state[:2] == PageState.LENT).all() and residency.counts.prefix_pages_owned == 0
    assert torch.equal(row[: 2 * PAGE].to(torch.int64), slots[: 2 * PAGE])


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

    def __init__(self, tiers: ArrayPools, residency: Residency, guard: float, threshold: int = 8) -> None:
        self.tiers, self.residency = tiers, residency
        pool_pages = tiers.k.shape[1] // PAGE
        ranges = KeyRanges(LAYERS, KV_HEADS, DIM, capacity_pages=4 * pool_pages)
        params = HotSetParams(policy="importance", budget=4, window=1, sinks=1, guard_threshold=guard)
        self.decoder = HotSetDecoder(
            params, ranges, pool_pages=pool_pages, page_size=PAGE, threshold=threshold, residency=residency
        )
        self.requests: dict[str, Request] = {}
        self.written: dict[str, int] = {}

    def place(self, req: Request) -> None:
        done = self.written.get(req.rid, 0)
        for pos in range(done, req.length):
            if pos % PAGE == 0:
                req.row[pos : pos + PAGE] = self._page().to(torch.int32)
            slot = int(req.row[pos])
            self.tiers.k[:, slot], self.tiers.v[:, slot] = req.k[:, pos], req.v[:, pos]
        self.written[req.rid] = req.length
        self.requests[req.rid] = req

    def _page(self) -> torch.Tensor:
        """A free device page; where none is, what the server's decode check does first
        (grown hot sets back to their budget) before SGLang would retract."""
        from sgl_importance.scheduler.decode_room import fits_after_releases

        runtime = SimpleNamespace(residency=self.residency, hot_set_decoder=self.decoder)
        if fits_after_releases(runtime, lambda batch: bool(self.tiers.free_device_pages), None):
            return self.tiers.alloc_device(1)
        raise AssertionError("the device is full even with every hot set at its budget")

    def step(self, queries: torch.Tensor):
        reqs = list(self.requests.values())
        rows = [r.row for r in reqs]
        with self.tiers.forward():  # no page moves inside the forward
            self.decoder.begin_step([r.rid for r in reqs], [r.row[: r.length].to(torch.int64) for r in reqs], rows)
            outs = [
                self.decoder.attend(layer, queries[layer], self.tiers.k[layer], self.tiers.v[layer], sm_scale=0.4)
                for layer in range(LAYERS)
            ]
        counts, moves = self.decoder.end_step()  # after the forward, as the scheduler ends a batch
        self.residency.apply(moves)
        return outs, counts


@pytest.mark.parametrize("guard, host_views", [(1.0, True), (0.05, True), (0.05, False)])
def test_requests_whose_kv_exceeds_the_device_pool_decode_as_with_every_page_on_the_device(guard, host_views):
    """Guard off, the outputs equal the reference's. Guarded, the selection wants released
    pages the reference has on its device: misses, promoted for later steps (the hot set
    growing by them). Where the host pool has page views the layer reads them from their
    host copies in the same step, so the outputs equal the reference's too; without views
    they are left unread, the outputs differ there and only the moves are checked. Where
    the device runs short, grown hot sets go back to their budget before a page is refused
    (the server's decode check, ``Placed.place``)."""
    # Three requests of 20 pages (60 pages with what they generate) on a 32-page
    # device: each is prefilled after the previous ones released what their hot
    # sets (4 pages) leave out. The reference keeps everything on a large device.
    reference = Placed(array_pools(device_pages=200, host_pages=0), Residency(), guard)
    small = array_pools(device_pages=32, host_pages=100, host_views=host_views)
    released = residency_over(small)
    physical = Placed(small, released, guard)
    g = torch.Generator().manual_seed(7)
    truth = [Request(f"r{i}", 20, seed=i) for i in range(3)]
    copies = [Request(f"r{i}", 20, seed=i) for i in range(3)]
    totals = None
    for step in range(12):
        if step % 4 == 0 and step // 4 < 3:  # a new request joins every fourth step
            i = step // 4
            reference.place(truth[i])
            released.admit(copies[i].rid, copies[i].row, first_owned_page=0, page_size=PAGE)
            physical.place(copies[i])
        q = torch.randn(LAYERS, len(reference.requests), KV_HEADS * GROUP, DIM, generator=g)
        want, _ = reference.step(q)
        got, totals = physical.step(q)
        for a, b in zip(want, got):
            if guard == 1.0 or host_views:
                assert torch.equal(a.output, b.output)
                assert torch.equal(a.importance, b.importance)
            assert bool(torch.isfinite(b.output).all())
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
    moved.add(released.take_counts())  # the last step's moves, made after it
    assert moved.pages_released > 0 and moved.pages_copied_out > 0
    assert moved.pages_copied_in > 0  # promotions happened, on pages others had used
    staged = reference.decoder.totals.pages_read_from_host  # part 1's staged pages: none there
    if guard < 1.0 and host_views:
        # The selection chose released pages and read them from their host copies: no miss.
        assert moved.late_arrivals > 0 and moved.pages_missed == 0 and staged == 0
        assert moved.pages_guard_from_host > 0 and moved.pages_guard_read == reference.decoder.totals.pages_guard_read
    elif guard < 1.0:
        # The selection wanted released pages: misses, counted per layer, promoted later.
        assert moved.late_arrivals > 0 and moved.pages_missed > 0
        # The misses grew hot sets past the 4-page budget, the device ran short, and the grown
        # ones went back to their budget for good.
        assert moved.hot_sets_shrunk > 0
        assert any(not physical.decoder.tracked[r.rid].grows for r in copies)
        assert reference.decoder.totals.pages_missed == 0  # every page on its device
    else:
        assert moved.pages_missed == 0 and moved.guard_checks == 0
    # Leaving frees every host copy.
    for req in copies:
        released.forget(req.rid)
    assert len(small.free_host_pages) == 100


def test_a_guarded_hot_set_grows_by_what_its_selection_missed_and_goes_back_to_its_budget_for_good():
    # A host pool without page views (SGLang's own, a CUDA platform's): released pages wanted are misses.
    tiers = array_pools(device_pages=200, host_pages=100, host_views=False)
    residency = residency_over(tiers)
    placed = Placed(tiers, residency, guard=0.05)
    req = Request("r", 24, seed=3)
    placed.place(req)
    residency.admit(req.rid, req.row, first_owned_page=0, page_size=PAGE)
    g = torch.Generator().manual_seed(11)

    def on_device() -> int:
        return int((~residency.peek("r").off_device(torch.arange(-(-req.length // PAGE)))).sum())

    held, misses = [], []
    for _ in range(6):
        req.grow()
        placed.place(req)
        _, counts = placed.step(torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, generator=g))
        held.append(on_device())
        misses.append(counts.late_arrivals)
    # The first guarded step released all but the 4-page budget (and the sample and the
    # page being written); its selections wanted released pages in flagged layers, so the
    # hot set grew by them and they came back, and the misses fell.
    tracked = placed.decoder.tracked
    assert tracked["r"].kept is not None and tracked["r"].grows
    assert max(held[2:]) > held[1] and placed.decoder.totals.pages_copied_in > 0
    assert sum(misses[2:]) < misses[1]
    # A decode check short of room puts it back to its budget and releases the rest, for good.
    residency.apply(placed.decoder.shrink())
    residency.copies.collect(wait=True)
    back = on_device()
    assert back < held[-1] and tracked["r"].kept is None and not tracked["r"].grows
    for _ in range(3):
        req.grow()
        placed.place(req)
        placed.step(torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, generator=g))
        assert tracked["r"].kept is None and on_device() <= back + 1
    assert placed.decoder.shrink().requests == []  # nothing grown: nothing to give back


def test_a_hot_set_grows_by_flagged_misses_holds_while_flagged_and_gives_back_a_tenth_once_certified():
    from sgl_importance.hot_set.plan.request_state import TrackedRequest
    from sgl_importance.hot_set.plan.selection import RequestHotSet

    tracked = TrackedRequest(RequestHotSet(HotSetParams(policy="importance", budget=0.2)))
    flagged, certified, wanted = torch.tensor([True, False]), torch.tensor([False, False]), torch.tensor([9, 9])
    steps = [  # (flags, missed) -> pages its hot set may hold of 100 (the budget: 20)
        ((flagged, 30), 50),  # grown by the misses of a flagged step
        ((flagged, 0), 50),  # still flagged: held
        ((certified, 0), 47),  # every layer certified: a tenth of the 30 given back
        ((certified, 5), 44),  # misses without a flag do not grow it (a tenth of 27, rounded up, back)
        ((flagged, 80), 100),  # up to every page
    ]
    for (flags, missed), pages in steps:
        tracked.follow_flags(flags, wanted, 100, missed=missed)
        assert tracked.kept_pages(100) == pages
    tracked.kept, tracked.grows = None, False  # put back to its budget for want of room
    tracked.follow_flags(flagged, wanted, 100, missed=30)
    assert tracked.kept is None and tracked.kept_pages(100) == 20


def test_only_what_a_flagged_layer_missed_counts_as_missed():
    from sgl_importance.hot_set.plan.request_state import LiveRequest, TrackedRequest
    from sgl_importance.hot_set.plan.selection import RequestHotSet

    tiers = array_pools(device_pages=8, host_pages=8)
    residency = residency_over(tiers)
    row, _ = filled_request(tiers, 5)
    pages = residency.admit("r", row, first_owned_page=0, page_size=PAGE)
    release(residency, [(pages, torch.tensor([2, 3]))])
    tracked = TrackedRequest(RequestHotSet(HotSetParams(policy="importance", budget=0.2)))
    live = LiveRequest(row[: 5 * PAGE], tracked, pages=pages, guarded=torch.zeros(5, dtype=torch.bool))
    live.outside_mass = torch.zeros(5, dtype=torch.float64)
    rest = torch.tensor([1, 2, 3, 4])
    wanted = torch.tensor([True, True, True, False])  # page 1 read; 2 and 3 wanted while released
    needed = torch.tensor([False, True, False, False])  # 2 by a flagged layer; 3 only by certified ones
    flags = torch.tensor([True, False])
    counts = dict(reads=1, pages_read=1, pages_estimated=3, pages_sampled=0, pages_missed=2)
    live.take_guard(
        rest, torch.zeros(4, dtype=torch.float64), wanted, flags, torch.tensor([3, 2]), needed, layers=2, **counts
    )
    assert live.guarded.tolist() == [False, True, True, True, False]
    # A layer whose bound held did without page 3: the hot set grows by page 2 alone.
    assert live.missed() == 1
    promote(residency, [(pages, torch.tensor([2]))])
    assert live.missed() == 0  # back on the device


def test_key_codes_land_under_their_own_page_when_two_requests_fill_and_release_pages_in_one_step():
    pools = array_pools(device_pages=120, host_pages=120)
    released = residency_over(pools)
    placed = Placed(pools, released, guard=0.1)
    # Two guarded requests; the second is one token short of filling its last page, so
    # the step that fills it also releases it (outside a 4-page hot set).
    first, second = Request("a", 12, seed=1), Request("b", 10, seed=2)
    for req in (first, second):
        placed.place(req)
        released.admit(req.rid, req.row, first_owned_page=0, page_size=PAGE)
    g = torch.Generator().manual_seed(3)
    for _ in range(PAGE + 1):
        for req in (first, second):
            req.grow()
            placed.place(req)
        placed.step(torch.randn(LAYERS, 2, KV_HEADS * 2, 8, generator=g))
    decoder = placed.decoder
    assert decoder.totals.pages_released + released.counts.pages_released > 0
    for req in (first, second):
        tracked = decoder.tracked[req.rid]
        codes = tracked.codes
        assert codes.numel() >= (req.length - 1) // PAGE  # every page full before this step is coded
        for layer in range(LAYERS):
            pages = req.k[layer, : codes.numel() * PAGE].view(codes.numel(), PAGE, *req.k.shape[2:])
            # Against the page's range as stored (rounded outward), which the reader reads.
            low, high = decoder.ranges.gather(layer, tracked.ranges[: codes.numel()])
            want = quantise(pages, low, high)
            got, _ = decoder.guard.gather(layer, codes)
            assert torch.equal(got, want)


# -- a short prompt that grows past the threshold while decoding ----------------------

GROWN_THRESHOLD = 24  # tokens: 6 pages
PROMPT = 18  # tokens: SGLang's checkpoint after prefill puts its 4 full pages in the tree
TREE_PAGES = PROMPT // PAGE


class ScheduledReq:
    """SGLang's ``Req`` where the release hooks read it, after the prompt's checkpoint."""

    ROW = 3  # its req_to_token row

    def __init__(self, rid: str, length: int) -> None:
        self.rid = rid
        self.kv = SimpleNamespace(req_pool_idx=self.ROW, cache_protected_len=TREE_PAGES * PAGE, kv_committed_len=length)
        self.full_untruncated_fill_ids = list(range(length))
        self.extend_end = length
        self.prefix_len = 0
        self.skip_radix_cache_insert = False
        self.done = False

    def finished(self) -> bool:
        return self.done


def tree_cache_of(tiers: ArrayPools, row: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(page_size=PAGE, available_size=lambda: 1 << 30),
        req_to_token_pool=SimpleNamespace(req_to_token={ScheduledReq.ROW: row}),
    )


def decode_batch(req: "ScheduledReq", row: torch.Tensor) -> SimpleNamespace:
    """What ``admit_grown`` reads of a ``ScheduleBatch``: its requests and their rows."""
    return SimpleNamespace(reqs=[req], req_to_token_pool=SimpleNamespace(req_to_token={ScheduledReq.ROW: row}))


class SGLangRelease:
    """What SGLang's ``release_kv_cache`` does with a request's row: a checkpoint inserts
    ``[0, kv_committed_len)`` (noted here), else ``free_kv_row`` (which the plugin wraps)
    frees the positions past the tree's; the fake pools fail on a padding or double free."""

    def __init__(self, tiers: ArrayPools, released: Residency, row: torch.Tensor) -> None:
        self.tiers, self.released, self.row = tiers, released, row
        self.inserted: list[torch.Tensor] = []

    def free_kv_row(self, cache, kv, ranges) -> None:
        for start, end in ranges:
            self.tiers.free_device(self.row[start:end].to(torch.int64))

    def __call__(self, req: ScheduledReq, tree_cache, *, checkpoint: bool) -> None:
        if checkpoint and not req.skip_radix_cache_insert:
            self.inserted.append(self.row[: req.kv.kv_committed_len].to(torch.int64).clone())
            return
        ranges = [(req.kv.cache_protected_len, req.kv.kv_committed_len)]
        free_row_around_released(self.released, self.free_kv_row, None, req.kv, ranges)


def grow_past_threshold(steps: int):
    """A short prompt decoded ``steps`` steps with ``admit_grown`` run as SGLang runs it
    (after each ``prepare_for_decode``), beside a reference that keeps every page."""
    reference = Placed(array_pools(device_pages=200, host_pages=0), Residency(), 1.0, GROWN_THRESHOLD)
    tiers = array_pools(device_pages=64, host_pages=64)
    released = residency_over(tiers, threshold=GROWN_THRESHOLD)
    physical = Placed(tiers, released, 1.0, GROWN_THRESHOLD)
    truth, copy = Request("r", 5, seed=3), Request("r", 5, seed=3)
    for req in (truth, copy):
        req.k, req.v = req.k[:, :PROMPT], req.v[:, :PROMPT]
    reference.place(truth)
    physical.place(copy)
    tree_slots = copy.row[: TREE_PAGES * PAGE].clone()
    scheduled = ScheduledReq("r", copy.length)
    g = torch.Generator().manual_seed(11)
    admitted_at = None
    for _ in range(steps):
        for req in (truth, copy):
            req.grow()
        reference.place(truth)
        physical.place(copy)
        scheduled.kv.kv_committed_len = copy.length  # this step's token included
        admit_grown(released, decode_batch(scheduled, copy.row))
        if released.admitted("r") and admitted_at is None:
            admitted_at = copy.length
        q = torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, generator=g)
        want, _ = reference.step(q)
        got, _ = physical.step(q)
        for a, b in zip(want, got):
            assert torch.equal(a.output, b.output)
        # The prompt's tree pages never leave: their slots are the tree's.
        assert torch.equal(copy.row[: TREE_PAGES * PAGE], tree_slots)
    return SimpleNamespace(
        tiers=tiers, released=released, physical=physical, copy=copy, scheduled=scheduled, admitted_at=admitted_at
    )


def test_a_request_grown_past_the_threshold_while_decoding_releases_only_pages_past_its_prompt_in_the_tree():
    grown = grow_past_threshold(steps=30)
    # Admitted on the step the decoder starts planning it, not before.
    assert grown.admitted_at == GROWN_THRESHOLD + 1
    record = grown.released.peek("r")
    assert record.first_owned_page == TREE_PAGES
    moved = grown.physical.decoder.totals
    moved.add(grown.released.counts)
    assert moved.pages_released > 0 and moved.pages_copied_out > 0
    assert record.released_pages().numel() > 0
    assert int(record.released_pages().min()) >= TREE_PAGES
    # Finished: every released page comes back, and the whole sequence is what the
    # tree is given, each position holding its own K and V.
    tiers, copy, scheduled = grown.tiers, grown.copy, grown.scheduled
    release = SGLangRelease(tiers, grown.released, copy.row)
    scheduled.done = True
    tree_cache = tree_cache_of(tiers, copy.row)
    release_with_pages(grown.released, RequestParams(), release, scheduled, tree_cache, checkpoint=True)
    (inserted,) = release.inserted
    assert (inserted != RELEASED_SLOT).all()
    assert torch.equal(tiers.k[:, inserted], copy.k) and torch.equal(tiers.v[:, inserted], copy.v)
    assert grown.released.counts.finished_reinserted == 1
    assert not grown.released.admitted("r") and len(tiers.free_host_pages) == 64


def test_a_grown_request_retracted_frees_only_what_it_holds_and_is_admitted_again_at_its_prefill():
    grown = grow_past_threshold(steps=20)
    tiers, released, scheduled = grown.tiers, grown.released, grown.scheduled
    assert released.peek("r").released_pages().numel() > 0
    release = SGLangRelease(tiers, released, grown.copy.row)
    tree_cache = tree_cache_of(tiers, grown.copy.row)
    release_with_pages(released, RequestParams(), release, scheduled, tree_cache, checkpoint=False)
    # Everything but the tree's pages is back in the allocator (freed once each: the
    # pools fail on the released positions, which point at the padding page).
    assert len(tiers.free_device_pages) == tiers.device_pages - TREE_PAGES
    assert len(tiers.free_host_pages) == 64 and not released.admitted("r")
    # Its prefill again (prompt and what it had generated, past the threshold) keeps it
    # out of the tree, admitted past the prompt the tree matched.
    assert not scheduled.skip_radix_cache_insert
    scheduled.full_untruncated_fill_ids = list(range(grown.copy.length))  # SGLang's refresh_fill_ids
    scheduled.extend_end = grown.copy.length
    checkpointed = []
    checkpoint_unless_released(
        released, None, None, None, lambda req, cache: checkpointed.append(req), scheduled, tree_cache
    )
    assert checkpointed == [] and released.admitted("r")
    assert released.peek("r").first_owned_page == TREE_PAGES
    assert scheduled.prefix_len == scheduled.extend_end


def test_only_running_requests_past_the_threshold_that_may_enter_the_tree_are_admitted_in_decode():
    released = Residency()
    tiers = array_pools(device_pages=8, host_pages=8)
    reqs = {name: ScheduledReq(name, GROWN_THRESHOLD + 1) for name in ("grown", "barred", "leaving", "short")}
    batch = SimpleNamespace(
        reqs=list(reqs.values()), req_to_token_pool=SimpleNamespace(req_to_token={ScheduledReq.ROW: torch.zeros(64)})
    )
    reqs["barred"].skip_radix_cache_insert = True  # e.g. a beam row, whose pages are shared
    reqs["leaving"].done = True
    reqs["short"].kv.kv_committed_len = GROWN_THRESHOLD
    admit_grown(released, batch)
    assert not any(released.admitted(name) for name in reqs)  # release is off
    released.enable(tiers, threshold=GROWN_THRESHOLD)
    admit_grown(released, batch)
    assert [name for name in reqs if released.admitted(name)] == ["grown"]
    # A short prompt still enters the tree at prefill; an admitted request never does,
    # whatever its length.
    checkpointed = []
    reqs["grown"].full_untruncated_fill_ids = list(range(PROMPT))
    short = ScheduledReq("prompt", GROWN_THRESHOLD)
    for req in (short, reqs["grown"]):
        tree_cache = tree_cache_of(tiers, torch.zeros(64))
        checkpoint_unless_released(
            released, None, None, None, lambda req, cache: checkpointed.append(req.rid), req, tree_cache
        )
    assert checkpointed == ["prompt"] and not released.admitted("prompt")


# -- streamed prefill (--hot-set-prefill stream) ----------------------------------------------

CHUNK_PAGES = 3
PROMPT_PAGES = 13  # the last page partial: 50 tokens
PROMPT = PROMPT_PAGES * PAGE - 2


class Streaming:
    """The backend's hot set as the checkpoint hook sees it: streaming; the decoder's pool
    views made for every layer (as the backend makes them at start-up)."""

    def __init__(self, placed: Placed) -> None:
        self.stream_prefill = True
        self.forward_stream = None  # the CPU: no model runner's stream to wait for
        for layer in range(LAYERS):
            placed.decoder.pool_as_pages(layer, placed.tiers.k[layer], placed.tiers.v[layer])


class Chunked:
    """SGLang's ``Req`` where the checkpoint hook reads it, prefilled chunk by chunk."""

    ROW = 3

    def __init__(self, rid: str, prompt: int) -> None:
        self.rid = rid
        self.kv = SimpleNamespace(req_pool_idx=self.ROW, cache_protected_len=0)
        self.full_untruncated_fill_ids = list(range(prompt))
        self.extend_end = self.prefix_len = 0
        self.skip_radix_cache_insert = False

    def finished(self) -> bool:
        return False


def assert_same_but_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal within float32 rounding. The C kernel reads a request's adjacent device pages
    as one run and a page staged from its host copy as a run of its own; on some CPUs
    (``-march=native`` vectorising a run's value sums with more than one accumulator) the
    order of those sums follows the runs. Bitwise equal on the development VM, not on CI's;
    a wrong page, token or weight is orders of magnitude past this."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def placed_world(guard: float, host_views: bool = True) -> tuple[ArrayPools, Residency, Placed]:
    """40 device and 40 host pages, release past 8 tokens, a decoder over them."""
    tiers = array_pools(device_pages=40, host_pages=40, host_views=host_views)
    residency = residency_over(tiers, threshold=8)
    return tiers, residency, Placed(tiers, residency, guard)


def decode_steps(placed: Placed, req: Request, seed: int, steps: int = 6) -> list:
    """``steps`` decode steps of ``req`` (growing it a token each): each step's outputs and counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        q = torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, generator=g)
        got, counts = placed.step(q)
        out.append(([r.output for r in got], counts))
        req.grow()
        placed.place(req)
    return out


def prefill_in_chunks(placed: Placed, req: Request, hot_set, residency: Residency):
    """Place ``req``'s prompt chunk by chunk, with the checkpoint hook after each; returns
    the device pages its row held after each chunk's checkpoint."""
    full_k, full_v = req.k, req.v
    scheduled = Chunked(req.rid, PROMPT)
    tree_cache = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(page_size=PAGE),
        req_to_token_pool=SimpleNamespace(req_to_token={Chunked.ROW: req.row}),
    )
    held = []
    for end in range(CHUNK_PAGES * PAGE, PROMPT + CHUNK_PAGES * PAGE, CHUNK_PAGES * PAGE):
        end = min(end, PROMPT)
        req.k, req.v = full_k[:, :end], full_v[:, :end]
        placed.place(req)
        scheduled.extend_end = end
        checkpoint_unless_released(
            residency, hot_set, placed.decoder, None, lambda *a: pytest.fail("checkpointed"), scheduled, tree_cache
        )
        pages = residency.peek(req.rid)
        held.append(-(-end // PAGE) - int(pages.off_device(torch.arange(-(-end // PAGE))).sum()))
    return held


@pytest.mark.parametrize("guard", [1.0, 0.05])
def test_a_prompt_streamed_in_chunks_decodes_as_the_one_whose_pages_stayed(guard):
    """Between chunks the device holds the sinks and the window;
    every released page was summarised before it left (its key range the one a dense
    prefill's first step writes) and its host copy is exact; the decode that follows (its
    first step reads the released pages from the host) equals the same request's prefilled
    with every page kept until its first step, on the same pools."""
    outputs = {}
    for streamed in (False, True):
        tiers, residency, placed = placed_world(guard)
        hot_set = Streaming(placed) if streamed else None
        req = Request("r", PROMPT_PAGES, seed=5)
        truth_k, truth_v = req.k.clone(), req.v.clone()
        held = prefill_in_chunks(placed, req, hot_set, residency)
        pages = residency.peek("r")
        params = placed.decoder.params
        if streamed:
            keep = params.sinks + params.window
            # After each middle chunk (they end on a page): the sinks and the window; the last
            # chunk's pages stay for the first decode step's plan.
            assert held == [keep] * (len(held) - 1) + [keep + PROMPT_PAGES - 4 * CHUNK_PAGES]
            released = pages.released_pages()
            assert released.tolist() == list(range(params.sinks, 4 * CHUNK_PAGES - params.window))
            host = pages.host_slots(released)
            positions = (released[:, None] * PAGE + torch.arange(PAGE)).flatten()
            assert torch.equal(tiers.hk[:, host], truth_k[:, positions])
            assert torch.equal(tiers.hv[:, host], truth_v[:, positions])
            tracked = placed.decoder.tracked["r"]
            assert tracked.ranges.numel() == 4 * CHUNK_PAGES  # every full page of the middle chunks
            assert residency.counts.prefill_chunks_released == 4
        else:
            assert pages.released_pages().numel() == 0 and held[-1] == PROMPT_PAGES
        outputs[streamed] = decode_steps(placed, req, seed=9)
        ids = placed.decoder.tracked["r"].ranges[: PROMPT_PAGES - 1]
        key_min = torch.stack([table[ids] for table in placed.decoder.ranges.key_min])
        outputs[streamed, "ranges"] = key_min
    for (dense, _), (streamed, _) in zip(outputs[False], outputs[True]):
        for a, b in zip(dense, streamed):
            assert_same_but_rounding(a, b)
    assert torch.equal(outputs[False, "ranges"], outputs[True, "ranges"])
    # The first step read the released pages from their host copies (every layer).
    assert outputs[True][0][1].pages_read_from_host >= 4 * CHUNK_PAGES - 2
    assert outputs[False][0][1].pages_read_from_host == 0


def test_a_streaming_request_is_tracked_until_it_leaves_and_a_dense_one_is_not_streamed():
    tiers = array_pools(device_pages=40, host_pages=40)
    residency = residency_over(tiers, threshold=8)
    placed = Placed(tiers, residency, 1.0)
    decoder = placed.decoder
    decoder.request_params = RequestParams()
    Streaming(placed)  # the pool's views
    req = Request("r", PROMPT_PAGES, seed=1)
    full_k, full_v = req.k, req.v
    req.k, req.v = full_k[:, : 2 * CHUNK_PAGES * PAGE], full_v[:, : 2 * CHUNK_PAGES * PAGE]
    placed.place(req)
    residency.admit("r", req.row, 0, PAGE)
    assert summarise_prefill(decoder, "r", req.row[: req.length], 2 * CHUNK_PAGES)
    # Another request's decode steps leave it tracked while it prefills...
    decoder.drop_absent(["other"])
    assert "r" in decoder.tracked and decoder.residency.record("r").prefilling
    # ... and drop it (its pool rows back) once it left (aborted mid-prefill).
    rows_in_use = decoder.ranges.pages_in_use
    residency.forget("r")
    decoder.drop_absent(["other"])
    assert "r" not in decoder.tracked and decoder.ranges.pages_in_use == rows_in_use - 2 * CHUNK_PAGES
    # A request decoding dense reads every page: its prompt is not streamed.
    decoder.request_params.note("d", HotSetParams(policy="dense"))
    residency.admit("d", req.row, 0, PAGE)
    assert not summarise_prefill(decoder, "d", req.row[: req.length], 2 * CHUNK_PAGES)
    assert "d" not in decoder.tracked


# -- a returning turn's history read from the host pool (scheduler/returning.py) -------------

HISTORY_PAGES = 10  # the match: 2 pages still on the device, 8 only in the host pool
ON_DEVICE = 2


@pytest.mark.parametrize("guard", [1.0, 0.05])
def test_a_history_lent_from_host_copies_decodes_as_the_one_loaded_back(guard):
    """A returning turn whose match is mostly host-only: its record lends the whole match,
    the host part released from the start (its row shows the released slot), so its first
    decode step reads those pages from the tree's host copies and summarises them there
    (their key ranges the ones the device's KV gives). The decode equals the same turn's
    after HiCache loaded the history back whole, on the same pools; the tree's host copies
    are borrowed, never freed by the request."""
    outputs = {}
    for on_host in (False, True):
        tiers, residency, placed = placed_world(guard)
        req = Request("r", PROMPT_PAGES, seed=7)
        placed.place(req)  # loaded back (on_host False) or written for the tree's host copies
        slots = req.row[: req.length].to(torch.int64)
        tree_host = tiers.alloc_host(HISTORY_PAGES).to(torch.int64)
        tiers.to_host(slots[: HISTORY_PAGES * PAGE], tree_host)
        pages = residency.admit("r", req.row, first_owned_page=HISTORY_PAGES, page_size=PAGE)
        if on_host:
            # What the device never held in this turn: the host part's pages go back and its
            # row positions show the released slot (as prefix_with_history writes them).
            host_part = slots[ON_DEVICE * PAGE : HISTORY_PAGES * PAGE]
            tiers.free_device(host_part)
            req.row[ON_DEVICE * PAGE : HISTORY_PAGES * PAGE] = RELEASED_SLOT
            residency.lend_prefix(pages, tree_host, on_device=ON_DEVICE)
            assert (pages.state[:ON_DEVICE] == PageState.LENT).all()
            assert (pages.state[ON_DEVICE:HISTORY_PAGES] == PageState.LENT_RELEASED).all()
            assert residency.counts.history_pages_on_host == HISTORY_PAGES - ON_DEVICE
        else:
            residency.lend_prefix(pages, tree_host)
            assert residency.counts.history_pages_on_host == 0
        free_host = len(tiers.free_host_pages)
        outputs[on_host] = decode_steps(placed, req, seed=11)
        tracked = placed.decoder.tracked["r"]
        assert not tracked.ranges_refused
        ids = tracked.ranges[:HISTORY_PAGES]
        outputs[on_host, "ranges"] = torch.stack([table[ids] for table in placed.decoder.ranges.key_min])
        # The tree's host copies stay the tree's: the request borrowed them.
        assert len(tiers.free_host_pages) <= free_host
        residency.forget("r")
        assert all(int(s) // PAGE not in tiers.free_host_pages for s in tree_host[::PAGE])
    for (loaded, _), (read, _) in zip(outputs[False], outputs[True]):
        for a, b in zip(loaded, read):
            assert_same_but_rounding(a, b)
    assert torch.equal(outputs[False, "ranges"], outputs[True, "ranges"])
    # The first step read the host part from the tree's host copies.
    assert outputs[True][0][1].pages_read_from_host >= HISTORY_PAGES - ON_DEVICE
    assert outputs[False][0][1].pages_read_from_host == 0


def test_a_returning_turn_finishing_before_its_hold_is_not_inserted_and_frees_only_its_own_pages():
    """Finished before its decode steps took its device prefix over (the hold still locked):
    its row shows no device page for the history, so it is not inserted; the device part
    points back at the tree's pages, its own pages (the new turn's) are freed, the tree's
    host copies are never freed, and the host lock goes back."""
    tiers = array_pools(device_pages=40, host_pages=40)
    residency = residency_over(tiers, threshold=8)
    req = Request("r", PROMPT_PAGES, seed=7)
    Placed(tiers, residency, 1.0).place(req)
    slots = req.row[: req.length].to(torch.int64)
    tree_host = tiers.alloc_host(HISTORY_PAGES).to(torch.int64)
    tiers.to_host(slots[: HISTORY_PAGES * PAGE], tree_host)
    tiers.free_device(slots[ON_DEVICE * PAGE : HISTORY_PAGES * PAGE])
    req.row[ON_DEVICE * PAGE : HISTORY_PAGES * PAGE] = RELEASED_SLOT
    pages = residency.admit("r", req.row, first_owned_page=HISTORY_PAGES, page_size=PAGE)
    residency.lend_prefix(pages, tree_host, on_device=ON_DEVICE)
    host_locks = []
    pages.hold = PrefixHold("history-node", "receipt", history=True)
    tree_device = slots[: ON_DEVICE * PAGE].clone()
    scheduled = ScheduledReq("r", req.length)
    scheduled.kv.cache_protected_len = HISTORY_PAGES * PAGE  # the tree's, as after a load-back
    scheduled.lock = SimpleNamespace(node="device-node")
    scheduled.done = True
    tree_cache = tree_cache_of(tiers, req.row)
    tree_cache.path_device_indices = lambda node: tree_device if node == "device-node" else pytest.fail(node)
    tree_cache.dec_host_lock_ref = lambda node, receipt: host_locks.append((node, receipt))
    release = SGLangRelease(tiers, residency, req.row)
    free_device = len(tiers.free_device_pages)
    release_with_pages(residency, RequestParams(), release, scheduled, tree_cache, checkpoint=True)
    assert release.inserted == [] and scheduled.skip_radix_cache_insert
    assert torch.equal(req.row[: ON_DEVICE * PAGE].to(torch.int64), tree_device)
    assert len(tiers.free_device_pages) == free_device + PROMPT_PAGES - HISTORY_PAGES
    assert host_locks == [("history-node", "receipt")] and not residency.admitted("r")
    assert all(int(s) // PAGE not in tiers.free_host_pages for s in tree_host[::PAGE])


def _top_p_pages(masses: torch.Tensor, top_p: float) -> int:
    """Pages some KV head of ``masses [kv, pages]`` needs, largest first, to reach ``top_p``
    of its mass (the union over heads), one head at a time."""
    union = set()
    for head in masses.double():
        share = head.clamp_min(0) / head.clamp_min(0).sum()
        order = torch.argsort(share, descending=True).tolist()
        total = 0.0
        for page in order:
            if total >= top_p or share[page] <= 0:
                break
            union.add(page)
            total += float(share[page])
    return len(union)


def seed_from_last_query(decoder, req: Request, g: torch.Generator, sharpness: float = 1.0) -> list[int]:
    """Seed ``req``'s first step as its extend would, from a random last query (scaled by
    ``sharpness``: the larger, the fewer pages its top-p wants); returns each layer's top-p pages."""
    from sgl_importance.attention.torch_backend import _last_token_masses
    from sgl_importance.hot_set.prefill import seed_layer

    decoder.seed_first_step = True
    last_q = sharpness * torch.randn(LAYERS, KV_HEADS * GROUP, DIM, generator=g)
    wanted = []
    for layer in range(LAYERS):
        masses = _last_token_masses(last_q[layer], req.k[layer].transpose(0, 1), 0.4, PAGE)
        seed_layer(decoder, req.rid, layer, masses)
        wanted.append(_top_p_pages(masses, decoder.params.top_p))
    return wanted


def test_a_seeded_guarded_first_step_starts_its_read_caps_where_the_seeds_top_p_needed_them(monkeypatch):
    """Without a warm-up, the caps start as the warm-up would have set them: each layer's
    top-p pages of the prefill's last token over the request's pages, never below read_cap
    (else a selection that wants more is flagged, step after step, until they rise)."""
    tiers, residency, placed = placed_world(0.05)
    req = Request("r", PROMPT_PAGES, seed=5)
    prefill_in_chunks(placed, req, Streaming(placed), residency)
    decoder = placed.decoder
    wanted = seed_from_last_query(decoder, req, torch.Generator().manual_seed(3), sharpness=4.0)
    caps = []

    def recorded(tracked, num_pages, planner=TrackedRequest.take_plan):
        caps.append(tracked.caps.clone())
        return planner(tracked, num_pages)

    monkeypatch.setattr(TrackedRequest, "take_plan", recorded)
    placed.step(torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(9)))
    share = torch.tensor(wanted, dtype=torch.float64) / PROMPT_PAGES
    expected = share.clamp(min=decoder.params.read_cap, max=1.0)
    assert torch.allclose(caps[0], expected)
    assert bool(((expected > decoder.params.read_cap) & (expected < 1.0)).any())  # a cap the seed moved


@pytest.mark.parametrize("guard", [1.0, 0.05])
def test_a_first_step_seeded_by_the_prefill_reads_its_hot_set_not_every_released_page(guard, monkeypatch):
    """``--hot-set-first-step seeded``: after a streamed prefill the first decode step is
    planned from the prefill's last token (its masses per page, ``prefill.seed_layer``): no
    dense warm-up; it reads the seeded hot set, the sinks and the window exactly (host copies
    where released, counted) instead of every released page; guarded, every full page has its
    key codes first, so part 1 is that hot set and the pages the device still holds."""
    firsts, take_plan = {}, TrackedRequest.take_plan
    for seeded in (False, True):
        tiers, residency, placed = placed_world(guard)
        req = Request("r", PROMPT_PAGES, seed=5)
        prefill_in_chunks(placed, req, Streaming(placed), residency)
        released = residency.peek("r").released_pages().numel()
        decoder = placed.decoder
        g = torch.Generator().manual_seed(3)
        if seeded:
            decoder.seed_first_step = True
            seed_from_last_query(decoder, req, g)
            seed = decoder.residency.record("r").seed.mass
        plans = []

        def recorded(tracked, num_pages, planner=take_plan, plans=plans):
            plans.append(planner(tracked, num_pages))
            return plans[-1]

        monkeypatch.setattr(TrackedRequest, "take_plan", recorded)
        q = torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(9))
        _, counts = placed.step(q)
        firsts[seeded] = counts
        if seeded:
            assert decoder.residency.record("r").seed is None and not decoder.tracked["r"].seeded
            # The step's hot set: the sinks, the window and the seed's heaviest pages between.
            params, kept = decoder.params, plans[0][0].keep
            fixed = list(range(params.sinks)) + list(range(kept.max() + 1 - params.window, kept.max() + 1))
            middle = torch.tensor([p for p in range(PROMPT_PAGES) if p not in fixed])
            heaviest = middle[torch.argsort(seed[middle], descending=True)][: kept.numel() - len(fixed)]
            assert sorted(kept.tolist()) == sorted(fixed + heaviest.tolist())
    assert firsts[False].warmups == 1 and firsts[True].warmups == 0
    # Unseeded, the warm-up read every released page from its host copy, in every layer.
    assert firsts[False].pages_read_from_host == LAYERS * released
    # Seeded, only its hot set's released pages (guarded at this budget the sample's reserve
    # leaves it the sinks and the window: nothing off the device).
    assert firsts[True].pages_read_from_host < LAYERS * released
    assert (firsts[True].pages_read_from_host > 0) == (guard == 1.0)
