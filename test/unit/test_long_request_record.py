"""One long request, one record: ``Residency.records`` holds every part the hot set keeps of
a request, and the record goes with its last part (hot_set/record.py)."""

from __future__ import annotations

import torch

from sgl_importance.hot_set import HotSetParams
from sgl_importance.hot_set.decode import HotSetDecoder
from sgl_importance.hot_set.guard.key_ranges import KeyRanges
from sgl_importance.hot_set.pages.prefix_hold import HistoryLoan
from sgl_importance.hot_set.plan.request_state import Seed

PAGE = 4


def decoder() -> HotSetDecoder:
    ranges = KeyRanges(num_layers=1, num_kv_heads=1, head_dim=2, capacity_pages=64)
    params = HotSetParams(policy="importance", budget=0.5)
    return HotSetDecoder(params, ranges, pool_pages=64, page_size=PAGE, threshold=0)


def test_the_selection_the_pages_and_the_loan_of_a_request_are_one_record():
    d = decoder()
    residency = d.residency
    tracked = d.track("r").tracked
    pages = residency.admit("r", torch.zeros(32, dtype=torch.int32), first_owned_page=0, page_size=PAGE)
    residency.open("r").loan = HistoryLoan(None, None, torch.zeros(0, dtype=torch.int64), 0, 0)
    record = residency.record("r")
    assert record.tracked is tracked and record.pages is pages and record.loan is not None
    assert d.tracked == {"r": tracked} and residency.peek("r") is pages
    # A second admission or tracking keeps the parts it has.
    assert residency.admit("r", torch.zeros(32, dtype=torch.int32), 0, PAGE) is pages
    assert d.track("r").tracked is tracked


def test_the_record_goes_with_its_last_part_and_not_before():
    d = decoder()
    residency = d.residency
    d.track("r")
    residency.admit("r", torch.zeros(32, dtype=torch.int32), first_owned_page=0, page_size=PAGE)
    d.ranges.alloc(3)  # another request's rows: only "r"'s go back
    d.residency.record("r").tracked.ranges = d.ranges.alloc(2)
    assert d.ranges.pages_in_use == 5
    residency.forget("r")  # SGLang's release_kv_cache: its pages end
    assert residency.record("r") is not None and not residency.admitted("r")
    d.forget_request("r")  # its selection ends, its rows back
    assert residency.record("r") is None and d.ranges.pages_in_use == 3
    assert d.tracked == {}


def test_a_request_absent_from_a_batch_ends_its_selection_unless_its_prompt_still_streams():
    d = decoder()
    residency = d.residency
    row = torch.zeros(32, dtype=torch.int32)
    for rid in ("left", "streaming", "admitted", "seeded"):
        residency.admit(rid, row, 0, PAGE)
    d.track("left")
    d.track("streaming").prefilling = True
    d.track("admitted")
    residency.open("seeded").seed = Seed(torch.zeros(4, dtype=torch.float64), 0, 1, torch.zeros(1, dtype=torch.int64))
    d.track("unadmitted")
    residency.open("unadmitted-seed").seed = Seed(torch.zeros(4), 0, 1, torch.zeros(1, dtype=torch.int64))
    residency.forget("left")
    assert sorted(residency.absent({"admitted"})) == ["left", "unadmitted", "unadmitted-seed"]
    d.drop_absent({"admitted"})
    assert set(d.tracked) == {"streaming", "admitted"}
    assert residency.record("seeded").seed is not None  # waits for its first step while admitted
    assert residency.record("left") is None and residency.record("unadmitted-seed") is None
