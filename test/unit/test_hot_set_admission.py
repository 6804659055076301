"""Admission by footprint: the arithmetic (``hot_set.pages.footprint.footprint``) and one round's
book (``scheduler.admission.FootprintBook``) against hand-worked cases; the adder itself
runs inside the server (``test/e2e/test_hot_set_admission.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_importance.hot_set import HotSetParams
from sgl_importance.hot_set.pages.footprint import footprint
from sgl_importance.hot_set.pages.state import MoveReason, PageMoves, PageState, RequestMoves
from sgl_importance.hot_set.residency import Residency
from sgl_importance.scheduler.admission import FootprintBook

PS = 16
THRESHOLD = 512
PARAMS = HotSetParams(policy="importance", budget=0.2, window=4, sinks=1)


def test_a_long_generation_keeps_its_hot_set_its_prompt_and_the_threshold_at_its_peak():
    # 256 prompt tokens (16 pages, the tree's) + 640 new: 56 pages at the end; the hot set
    # ceil(0.2 * 56) = 12 pages, +1 being filled, +16 of prompt = 29 pages; dense until the
    # threshold: 512 / 16 + 1 = 33 pages.
    f = footprint(256, 896, PARAMS, threshold=THRESHOLD, page_size=PS)
    assert (f.dense, f.kept, f.released, f.ranged) == (33 * PS, 29 * PS, 56 - 29, 55)
    assert f.peak == 33 * PS


def test_a_long_prompt_is_held_whole_before_it_releases():
    # 4,000 prompt tokens (250 pages) + 100 new: 257 pages; the prompt is past the
    # threshold (no tree pages of its own kept): 52 hot + 1; dense: 250 + 1 pages.
    f = footprint(4000, 4100, PARAMS, threshold=THRESHOLD, page_size=PS)
    assert (f.dense, f.kept, f.released) == (251 * PS, 53 * PS, 257 - 53)
    assert f.peak == 251 * PS


def test_a_streamed_prompt_is_held_a_chunk_at_a_time():
    # The 4,000-token prompt above streamed in 512-token chunks: while it prefills the device
    # holds a chunk (32 pages), its sinks (1) and window (4), the previous chunk's partial page
    # and the first decode step's: 39 pages, not 251; once released it keeps 53.
    f = footprint(4000, 4100, PARAMS, threshold=THRESHOLD, page_size=PS, chunk=512)
    assert (f.dense, f.kept, f.released) == (39 * PS, 53 * PS, 257 - 53)
    assert f.peak == 53 * PS
    # A short prompt growing past the threshold is not streamed (its prompt is the tree's).
    assert footprint(256, 896, PARAMS, threshold=THRESHOLD, page_size=PS, chunk=64).dense == 33 * PS
    book = FootprintBook(
        lambda rid: PARAMS, lambda rid: None, _residency(), _never_refused, 10_000, clip=4096, chunk=512
    )
    f, growth = book.new(_req("a", 4000, 0, 100))
    # Charged its peak for the prompt and its 100 new tokens, not the prompt's 4,000 tokens.
    assert growth == 0 and book.charge(f, 4000, growth) == 53 * PS
    unstreamed = _book(_residency())
    f, growth = unstreamed.new(_req("a", 4000, 0, 100))
    assert unstreamed.charge(f, 4000, growth) == 4000 + 16


def test_requests_that_never_release_have_no_footprint():
    assert footprint(256, 512, PARAMS, threshold=THRESHOLD, page_size=PS) is None  # never past the threshold
    dense = HotSetParams(policy="dense", budget=0.2, window=4, sinks=1)
    assert footprint(256, 4096, dense, threshold=THRESHOLD, page_size=PS) is None


def test_sinks_and_window_bound_a_small_budget_from_below():
    tiny = HotSetParams(policy="window", budget=2, window=6, sinks=2)
    f = footprint(1024, 2048, tiny, threshold=THRESHOLD, page_size=PS)
    assert f.kept == (8 + 1) * PS


class _Pools:
    page_size = PS


def _residency(admitted: dict[str, list[int]] | None = None) -> Residency:
    r = Residency()
    r.enable(_Pools(), THRESHOLD)
    for rid, states in (admitted or {}).items():
        pages = r.admit(rid, torch.zeros(1), 0, PS)
        pages.state = torch.tensor(states, dtype=torch.uint8)
    return r


def _req(rid: str, prompt: int, generated: int, max_new: int, ignore_eos: bool = True):
    sampling = SimpleNamespace(max_new_tokens=max_new, ignore_eos=ignore_eos)
    return SimpleNamespace(rid=rid, origin_input_ids=[0] * prompt, output_ids=[0] * generated, sampling_params=sampling)


def _never_refused(rid: str) -> bool:
    return False


def _book(residency: Residency, host_pages: int = 10_000, params=PARAMS, kept=None, refused=()) -> FootprintBook:
    kept = kept or {}
    return FootprintBook(
        lambda rid: params, lambda rid: kept.get(rid), residency, lambda rid: rid in refused, host_pages, clip=4096
    )


def test_a_requests_key_ranges_and_codes_are_charged_as_the_kv_pages_borrowed_for_them():
    # The 56-page generation: 55 full pages at the end take ceil(55/16) = 4 pages of ranges and,
    # guarded, ceil(55/7) = 8 of codes: kept 29 + 12 pages; while dense, the threshold's 32
    # pages' rows (2 + 5) beside its 33.
    f = footprint(256, 896, PARAMS, threshold=THRESHOLD, page_size=PS, rows_per_page=(16, 7))
    assert (f.dense, f.kept, f.released) == ((33 + 7) * PS, (29 + 12) * PS, 56 - 29)
    unguarded = HotSetParams(policy="importance", budget=0.2, window=4, sinks=1, guard_threshold=1.0)
    f = footprint(256, 896, unguarded, threshold=THRESHOLD, page_size=PS, rows_per_page=(16, 7))
    assert (f.dense, f.kept) == ((33 + 2) * PS, (29 + 4) * PS), "no code rows without the guard"


def test_a_new_request_is_charged_its_growth_to_its_peak_and_books_host_pages_only_when_taken():
    book = _book(_residency(), host_pages=100)
    req = _req("a", 256, 0, 640)
    f, growth = book.new(req)
    assert growth == 33 * PS - 256
    assert book.host_left == 100  # asked, not booked
    book.take(f)
    assert book.host_left == 100 - 27


def test_a_request_whose_pages_the_host_pool_cannot_take_is_charged_in_full():
    f, growth = _book(_residency(), host_pages=26).new(_req("a", 256, 0, 640))
    assert f is not None and growth is None
    assert _book(_residency(), host_pages=27).new(_req("a", 256, 0, 640))[1] is not None


def test_without_release_or_a_hot_set_a_request_is_charged_as_sglang_charges_it():
    off = Residency()  # no host pool: release is off
    book = FootprintBook(lambda rid: PARAMS, lambda rid: None, off, _never_refused, 100, clip=4096)
    assert book.new(_req("a", 256, 0, 640)) == (None, None)
    assert _book(_residency(), params=None).new(_req("a", 256, 0, 640)) == (None, None)
    assert _book(_residency()).running(_req("a", 100, 10, 200), 190.0, 1.0) == 190.0  # never past the threshold


def test_a_running_request_not_released_yet_is_charged_to_its_peak_from_where_it_is():
    book = _book(_residency())
    # 256 + 100 generated of 640: holds 356 tokens, its peak (the threshold's 33 pages) ahead.
    assert book.running(_req("a", 256, 100, 640), 540.0, 1.0) == 33 * PS - 356
    assert book.running(_req("b", 256, 100, 640), 540.0, 0.5) == (33 * PS - 356) * 0.5  # SGLang's ratio


def test_a_released_running_request_is_charged_up_to_what_it_keeps_never_more_than_sglang():
    # 600 of 896 tokens: 38 pages, 20 on the device (tree and own), 18 released.
    states = [int(PageState.TREE)] * 16 + [int(PageState.COPIED)] * 4 + [int(PageState.RELEASED)] * 18
    r = _residency({"a": states})
    book = _book(r, host_pages=100)
    charge = book.running(_req("a", 256, 344, 640), 296.0, 1.0)
    assert charge == 29 * PS - 20 * PS  # kept at the end (29 pages) less the 20 it holds
    assert book.host_left == 100 - (27 - 18)
    assert _book(r).running(_req("a", 256, 344, 640), 40.0, 1.0) == 40.0


def test_a_running_request_refused_key_ranges_is_charged_as_sglang_charges_it():
    # It decodes dense with every page kept: no discount, nothing booked.
    states = [int(PageState.TREE)] * 16 + [int(PageState.COPIED)] * 22
    book = _book(_residency({"a": states}), host_pages=100, refused={"a"})
    assert book.running(_req("a", 256, 344, 640), 296.0, 1.0) == 296.0 and book.host_left == 100


def test_a_request_refused_key_ranges_is_known_by_its_record_a_new_one_is_not():
    from sgl_importance.hot_set.plan.request_state import TrackedRequest, ranges_refused
    from sgl_importance.hot_set.plan.selection import RequestHotSet

    tracked = {
        "a": TrackedRequest(RequestHotSet(PARAMS)),
        "b": TrackedRequest(RequestHotSet(PARAMS), ranges_refused=True),
    }
    assert [ranges_refused(tracked, rid) for rid in ("a", "b", "new")] == [False, True, False]


def test_a_hot_set_the_guard_grew_keeps_its_grown_share_and_is_charged_for_it():
    # The 56-page generation of the first test with its hot set grown to 30 % of its pages:
    # ceil(0.3 * 56) = 17 hot + 1 being filled + 16 of prompt = 34 pages kept (29 at the budget).
    f = footprint(256, 896, PARAMS, threshold=THRESHOLD, page_size=PS, kept_share=0.3)
    assert (f.kept, f.released) == (34 * PS, 56 - 34)
    states = [int(PageState.TREE)] * 16 + [int(PageState.COPIED)] * 4 + [int(PageState.RELEASED)] * 18
    r = _residency({"a": states})
    grown = _book(r, kept={"a": 0.3}).running(_req("a", 256, 344, 640), 296.0, 1.0)
    assert grown == 34 * PS - 20 * PS  # its grown share at the end less the 20 pages it holds
    assert _book(r).running(_req("a", 256, 344, 640), 296.0, 1.0) == 29 * PS - 20 * PS
    assert _book(r, kept={"a": 0.5}).running(_req("a", 256, 344, 640), 296.0, 1.0) == 296.0  # never past SGLang's


def test_a_new_request_is_charged_what_the_guard_has_grown_the_running_ones_to():
    from sgl_importance.hot_set.plan.request_state import TrackedRequest, kept_share
    from sgl_importance.hot_set.plan.selection import RequestHotSet

    def tracked(kept):
        return TrackedRequest(RequestHotSet(PARAMS), kept=kept)

    running = {"a": tracked(0.9), "b": tracked(None), "c": tracked(0.6)}
    assert kept_share(running, "a") == 0.9 and kept_share(running, "b") is None  # its own
    assert kept_share(running, "new") == pytest.approx(0.5)  # (0.9 + 0 + 0.6) / 3
    assert kept_share({"b": tracked(None)}, "new") is None and kept_share({}, "new") is None
    # Charged by it: the 56-page generation at half its pages keeps 28 + 1 + 16 = 45 pages,
    # more than the threshold's 33 it holds before it releases: its peak, and it releases
    # (books host room for) 11 pages, not 27.
    book = FootprintBook(lambda rid: PARAMS, lambda rid: 0.5, _residency(), _never_refused, 10_000, clip=4096)
    f, growth = book.new(_req("new", 256, 0, 640))
    assert (f.kept, f.released, f.peak) == (45 * PS, 56 - 45, 45 * PS)
    assert growth == 45 * PS - 256


def test_the_host_pages_admitted_requests_hold_are_their_own_copies():
    states = [int(s) for s in (PageState.TREE, PageState.COPIED, PageState.RELEASED, PageState.LENT_RELEASED)]
    assert _residency({"a": states, "b": [int(PageState.RELEASED)] * 3}).host_pages_held() == 2 + 3


class _Copies:
    """Release copies in flight: ``pending`` device pages freed once collected."""

    def __init__(self, pending: int) -> None:
        self.pending, self.freed, self.waited = pending, 0, False

    @property
    def frees_waiting(self) -> bool:
        return self.pending > 0

    def collect(self, wait: bool = False) -> None:
        self.waited = wait
        self.freed, self.pending = self.freed + self.pending, 0


class _Decoder:
    """``HotSetDecoder.shrink`` as the decode check sees it: ``grown`` requests' pages to release."""

    def __init__(self, grown: list[RequestMoves]) -> None:
        self.grown, self.shrunk = grown, 0

    def shrink(self) -> PageMoves:
        self.shrunk += 1
        grown, self.grown = self.grown, []
        return PageMoves(grown, MoveReason.SHRINK)


def _runtime(r: Residency, grown: list | None = None) -> SimpleNamespace:
    return SimpleNamespace(residency=r, hot_set_decoder=_Decoder(grown or []))


@pytest.mark.parametrize("pending, fits_after", [(4, True), (1, False), (0, False)])
def test_a_decode_check_short_of_room_waits_for_release_copies_before_sglang_retracts(pending, fits_after):
    from sgl_importance.scheduler.decode_room import fits_after_releases

    r = _residency()
    r.copies = _Copies(pending)
    free = {"pages": 2}
    checks = []

    def check(batch, selected_indices=None):  # SGLang's: the step needs 4 free pages
        checks.append(selected_indices)
        return free["pages"] + r.copies.freed >= 4

    runtime = _runtime(r)
    assert fits_after_releases(runtime, check, "batch", selected_indices=[0]) is fits_after
    assert r.counts.release_waits == (1 if pending else 0)
    assert r.copies.waited == bool(pending)
    assert checks == [[0]] * (2 if pending else 1)  # asked again only after freeing
    assert runtime.hot_set_decoder.shrunk == (0 if fits_after else 1)  # nothing grown: no third check
    r.copies = _Copies(5)
    free["pages"] = 4
    assert fits_after_releases(_runtime(r), check, "batch") and r.copies.pending == 5  # room: nothing waited for


def test_a_decode_check_still_short_puts_grown_hot_sets_back_to_their_budget_before_sglang_retracts():
    from sgl_importance.scheduler.decode_room import fits_after_releases

    r = _residency({"a": [int(PageState.RESIDENT)] * 5, "b": [int(PageState.RESIDENT)] * 8})
    released = []
    r.copies = _Copies(0)
    r._release = lambda wanted: released.extend((p.owner, t.tolist()) for p, t in wanted)  # the owner's, seen here
    grown = [RequestMoves("a", release=torch.tensor([3, 4])), RequestMoves("b", release=torch.tensor([7]))]
    runtime = _runtime(r, grown)
    room = lambda batch: len(released) == 2  # noqa: E731  (SGLang's check: fits once both released)
    assert fits_after_releases(runtime, room, "batch")
    assert released == [("a", [3, 4]), ("b", [7])]
    assert r.counts.hot_sets_shrunk == 2 and r.copies.waited  # counted by the owner; the frees run before the check
    # Short with nothing grown: SGLang retracts (the check's False is returned as is).
    assert not fits_after_releases(_runtime(r), lambda batch: False, "batch")
    assert r.counts.hot_sets_shrunk == 2


class _BaseAdder:
    """SGLang's ``PrefillAdder`` where ``add_chunked_req`` reads and charges the chunk budget."""

    def __init__(self, available: int, rem_chunk_tokens: int) -> None:
        self.page_size = PS
        self.rem_chunk_tokens = rem_chunk_tokens
        self.token_to_kv_pool_allocator = SimpleNamespace(available_size=lambda: available)
        self.tree_cache = SimpleNamespace(evictable_size=lambda: 0)
        self.scheduled: list[int] = []

    def add_chunked_req(self, req):
        chunk = min(self.rem_chunk_tokens, req.left)  # what SGLang schedules, then charges
        self.scheduled.append(chunk)
        self.rem_chunk_tokens -= chunk
        return req


def _continuing_adder(available: int, streamed: bool, chunk: int = 512):
    from sgl_importance.scheduler.admission import _adder_class

    adder = object.__new__(_adder_class(_BaseAdder))  # the subclass, without SGLang's __init__
    _BaseAdder.__init__(adder, available, chunk)
    residency = _residency({"r": [int(PageState.RELEASED)]} if streamed else {})
    adder.footprint_book = FootprintBook(
        lambda rid: PARAMS, lambda rid: None, residency, _never_refused, 100, 4096, chunk
    )
    adder._continuing = None
    return adder


@pytest.mark.parametrize("available, scheduled", [(10_000, [512]), (300, [272]), (20, [])])
def test_a_continuing_streamed_chunk_takes_only_the_room_there_is(available, scheduled):
    # SGLang schedules a continuing chunk even where the pool is short (a dense prompt frees its
    # earlier chunks only when it ends): a streamed one takes the page-floored room less a page
    # (the allocator's alignment), or waits for a page of it; the budget is charged what ran.
    adder = _continuing_adder(available, streamed=True)
    req = SimpleNamespace(rid="r", left=900)
    assert adder.add_chunked_req(req) is req
    assert adder.scheduled == scheduled
    assert adder.rem_chunk_tokens == 512 - sum(scheduled)
    # A prompt that does not stream is scheduled as SGLang schedules it.
    dense = _continuing_adder(20, streamed=False)
    dense.add_chunked_req(SimpleNamespace(rid="r", left=900))
    assert dense.scheduled == [512]


def test_a_grown_request_whose_prompt_is_held_on_the_host_keeps_only_its_hot_set():
    # The 56-page generation: with --hot-set-prefix host its prompt's 16 tree pages are lent and
    # released like its own, so it keeps its hot set and the page being filled (13), not 29.
    f = footprint(256, 896, PARAMS, threshold=THRESHOLD, page_size=PS, prefix_on_host=True)
    assert (f.kept, f.released) == (13 * PS, 56 - 13)
    r = _residency()
    r.prefix_on_host = True
    assert _book(r).new(_req("a", 256, 0, 640))[0].kept == 13 * PS
