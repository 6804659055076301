"""A returning turn's history taken from the host pool at admission (scheduler/returning.py):
who is eligible, what its prefix row shows, and undoing the loan of a turn not admitted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_importance.hot_set.pages.state import RELEASED_SLOT
from sgl_importance.hot_set.params import HotSetParams
from sgl_importance.hot_set.request_params import RequestParams
from sgl_importance.hot_set.residency import Residency
from sgl_importance.scheduler import hot_set_release, returning
from support.array_pools import ArrayPools

PAGE = 4


def world(monkeypatch, *, host_path: int = 12 * PAGE, stream: bool = True):
    residency = Residency()
    residency.enable(
        ArrayPools(layers=1, kv_heads=1, dim=2, page_size=PAGE, device_pages=8, host_pages=16), threshold=8
    )
    residency.prefix_on_host = True
    runtime = SimpleNamespace(
        residency=residency,
        hot_set_attention=SimpleNamespace(stream_prefill=stream),
        request_params=RequestParams(),
        hot_set_params=HotSetParams(policy="importance", budget=0.2),
    )
    locks = []
    tree_cache = SimpleNamespace(
        linker=None,
        buffer_pipeline=None,
        inc_host_lock_ref=lambda node: locks.append(("lock", node)) or SimpleNamespace(to_dec_params=lambda: "rc"),
        dec_host_lock_ref=lambda node, receipt: locks.append(("unlock", node, receipt)),
    )
    host = torch.arange(host_path, dtype=torch.int64) + 100
    monkeypatch.setattr(hot_set_release, "path_host_slots", lambda cache, node: host)
    req = SimpleNamespace(
        rid="r",
        host_hit_length=10 * PAGE,
        host_loaded_length=0,
        swa_host_hit_length=0,
        mamba_host_hit_length=0,
        auxiliary_swa_host_hit_length=0,
        kv=SimpleNamespace(holds_kv=False, cache_protected_len=2 * PAGE),
        full_untruncated_fill_ids=list(range(14 * PAGE)),
        prefix_len=2 * PAGE,
        best_match_node="host-node",
    )
    return runtime, tree_cache, req, locks


def test_a_turn_admitted_takes_its_host_hit_as_prefix_and_its_row_shows_it_released(monkeypatch):
    runtime, tree_cache, req, locks = world(monkeypatch)
    loan = returning.borrow(runtime, req, tree_cache, lambda: True)
    assert loan is not None and locks == [("lock", "host-node")]
    # What SGLang's admission sees: no host hit to load back, the history a prefix.
    assert req.prefix_len == 12 * PAGE and req.host_hit_length == 0
    returning.settle(runtime, req, tree_cache, loan, admitted=True)
    assert runtime.residency.record("r").loan is loan and req.kv.cache_protected_len == 12 * PAGE
    assert req.host_hit_length == req.host_loaded_length == 10 * PAGE  # the cached-token split credits the host

    def device_prefix(cache, r):
        assert r.prefix_len == 2 * PAGE  # only the device part is asked of the tree
        return torch.tensor([40, 41, 42, 43, 44, 45, 46, 47])

    row = returning.prefix_with_history(runtime.residency, device_prefix, tree_cache, req)
    assert row[: 2 * PAGE].tolist() == list(range(40, 48))
    assert (row[2 * PAGE :] == RELEASED_SLOT).all() and row.numel() == 12 * PAGE and req.prefix_len == 12 * PAGE


def test_a_turn_not_admitted_gets_its_host_hit_back_and_the_lock_goes(monkeypatch):
    runtime, tree_cache, req, locks = world(monkeypatch)
    loan = returning.borrow(runtime, req, tree_cache, lambda: True)
    returning.settle(runtime, req, tree_cache, loan, admitted=False)
    assert req.prefix_len == 2 * PAGE and req.host_hit_length == 10 * PAGE and runtime.residency.record("r") is None
    assert locks == [("lock", "host-node"), ("unlock", "host-node", "rc")]


@pytest.mark.parametrize(
    "change",
    [
        "no stream",
        "short",
        "swa",
        "holds kv",
        "dense",
        "copy missing",
        "no host hit",
        "ranges do not fit",
    ],
)
def test_what_is_not_eligible_is_loaded_back_as_sglang_does(monkeypatch, change):
    runtime, tree_cache, req, locks = world(
        monkeypatch, stream=change != "no stream", host_path=11 * PAGE if change == "copy missing" else 12 * PAGE
    )
    if change == "short":
        req.full_untruncated_fill_ids = list(range(8))
    elif change == "swa":
        req.swa_host_hit_length = PAGE
    elif change == "holds kv":
        req.kv.holds_kv = True
    elif change == "dense":
        runtime.request_params.note("r", HotSetParams(policy="dense"))
    elif change == "no host hit":
        req.host_hit_length = 0
    before = (req.prefix_len, req.host_hit_length)
    assert returning.borrow(runtime, req, tree_cache, lambda: change != "ranges do not fit") is None
    assert (req.prefix_len, req.host_hit_length) == before and locks == []
