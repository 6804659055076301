"""The hot set's rows paid from the KV pool: borrowed pages, their stock between steps, what
start-up sets aside (the page importance table only) and the series that show it."""

from __future__ import annotations

import inspect
import logging
import types

import pytest
import torch
from prometheus_client import CollectorRegistry

from sgl_importance.attention import hot_set_attention, table_reserve
from sgl_importance.attention.step_phase import StepPhase
from sgl_importance.config import ImportanceConfig
from sgl_importance.hot_set.decode import StepResult
from sgl_importance.hot_set.guard.key_codes import GuardPool, code_rows_per_page
from sgl_importance.hot_set.guard.key_ranges import KeyRanges
from sgl_importance.hot_set.pages.rows import BorrowedPages, LocalPages, RowStore
from sgl_importance.hot_set.pages.state import PageMoves, page_offsets
from sgl_importance.hot_set.plan.selection import HotSetCounts
from sgl_importance.hot_set.residency import Residency
from sgl_importance.hot_set.table_budget import KVShape, describe, plan_table
from sgl_importance.importance.page_importance import TABLE_BYTES_PER_PAGE, PageImportanceTable
from sgl_importance.metrics import HotSetMetrics
from sgl_importance.runtime import Runtime
from sgl_importance.scheduler import hot_set_rows

PAGE = 16
# SmolLM2-135M on torch_cpu in bfloat16 and a Llama-3.1-8B shape (bf16 KV).
SMOL = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, v_head_dim=64, element_size=2, page_size=PAGE)
LLAMA = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, v_head_dim=128, element_size=2, page_size=PAGE)
GUARDED = ImportanceConfig(hot_set_policy="importance")


def slots_of(pages) -> torch.Tensor:
    """The token slots of device ``pages``, page after page (what the allocator hands out and frees)."""
    return page_offsets(torch.as_tensor(pages, dtype=torch.int64), PAGE)


# -- rows in borrowed pages --------------------------------------------------------


def four_rows(page: int) -> list[int]:
    return [4 * page + j for j in range(4)]


def test_a_row_store_takes_a_page_only_when_its_pages_are_full_and_gives_it_back_when_empty():
    source = LocalPages(1, 3)
    store = RowStore(four_rows, source)
    a = store.alloc(3)
    assert store.pages == 1 and source.available() == 2
    b = store.alloc(2)  # one row left on the first page, then a second page
    assert store.pages == 2 and source.available() == 1 and len(set((a.tolist() + b.tolist()))) == 5
    store.free(a)
    assert store.pages == 2, "a page keeps going while any of its rows is held"
    store.free(b)
    assert store.pages == 0 and source.available() == 3 and store.rows_in_use == 0


def test_rows_come_from_the_pages_most_held_first_so_the_others_can_empty_out():
    store = RowStore(four_rows, LocalPages(1, 2))
    first, second = store.alloc(4), store.alloc(4)
    store.free(first[:3])
    store.free(second[:1])  # page 1 holds 1 row, page 2 holds 3
    again = store.alloc(1)
    assert again.item() // 4 == second[0].item() // 4, "the page with more rows held gives the row"


def test_a_store_refuses_what_its_source_cannot_lend_and_counts_it():
    store = RowStore(four_rows, LocalPages(1, 1))
    assert store.can_alloc(4) and not store.can_alloc(5)
    assert store.alloc(5) is None and store.refused == 1 and store.pages == 0
    assert store.alloc(4) is not None


def test_the_stock_borrows_and_returns_whole_pages_between_steps_only_through_settle():
    freed: list[torch.Tensor] = []
    pool = iter(range(10, 100))

    def alloc(tokens: int) -> torch.Tensor:
        return slots_of([next(pool) for _ in range(tokens // PAGE)])

    stock = BorrowedPages(PAGE)
    assert stock.settle(3, alloc, freed.append) == 3 and stock.borrowed == 3
    store = RowStore(four_rows, stock)
    rows = store.alloc(5)  # two pages to the store, one left in stock
    assert stock.in_stores == 2 and stock.available() == 1 and store.alloc(9) is None
    assert stock.settle(0, alloc, freed.append) == 0
    assert torch.equal(freed[-1], slots_of([10])), "the page left over, as token slots"
    store.free(rows)
    assert stock.in_stores == 0 and stock.available() == 2
    stock.settle(0, alloc, freed.append)
    assert stock.borrowed == 0 and sum(f.numel() for f in freed) == 3 * PAGE


def test_the_stock_takes_what_the_allocator_has_when_it_is_short():
    stock = BorrowedPages(PAGE)
    assert stock.settle(4, lambda tokens: None, lambda slots: None) == 0
    two_left = iter([[7, 8]])

    def alloc(tokens: int):  # an allocator with two free pages: more is refused whole
        return slots_of(next(two_left)) if tokens <= 2 * PAGE else None

    assert stock.settle(5, alloc, lambda slots: None) == 2 and sorted(stock.stock) == [7, 8]


def test_range_rows_are_token_slots_of_the_borrowed_page_min_in_k_max_in_v():
    k = torch.zeros(3 * PAGE, 2, 8)
    v = torch.zeros(3 * PAGE, 2, 8)
    ranges = KeyRanges.over_pool([k], [v], PAGE, LocalPages(2, 1))
    ids = ranges.alloc(PAGE)
    assert sorted(ids.tolist()) == list(range(2 * PAGE, 3 * PAGE)) and ranges.alloc(1) is None
    low, high = -torch.rand(PAGE, 2, 8), torch.rand(PAGE, 2, 8)
    ranges.write(0, ids, low, high)
    assert torch.equal(k[ids], low) and torch.equal(v[ids], high) and (k[: 2 * PAGE] == 0).all()
    got_low, got_high = ranges.gather(0, torch.cat((ids[:2], torch.tensor([0]))))
    assert torch.equal(got_low[:2], low[:2]) and (got_low[2] == float("inf")).all()
    assert (got_high[2] == float("-inf")).all(), "the padding id reads as an empty range"


# -- the arithmetic ----------------------------------------------------------------


def test_rows_cost_a_sixteenth_of_a_page_for_ranges_and_a_seventh_for_codes_at_16_bits():
    assert LLAMA.ranges_per_page == 16 and LLAMA.codes_per_page == 7 == code_rows_per_page(2)
    assert code_rows_per_page(4) == 15 and code_rows_per_page(2, fused=False) == 3
    # A request of 1,000 full pages: 63 pages of ranges, 143 of codes (guarded).
    assert LLAMA.row_pages(1000, guarded=True) == 63 + 143 and LLAMA.row_pages(1000, guarded=False) == 63


def test_the_kv_pool_gives_up_only_the_whole_pages_the_importance_table_needs():
    budget = plan_table(2048, SMOL)
    assert budget.kv_tokens % PAGE == 0 and budget.table_bytes == (budget.kv_tokens // PAGE + 1) * TABLE_BYTES_PER_PAGE
    per_token = SMOL.kv_bytes_per_page // PAGE
    assert budget.kv_tokens * per_token + budget.table_bytes <= 2048 * per_token
    assert budget.kv_tokens_given_up == PAGE, "one page pays a table of 128 pages many times over"
    assert "nothing set aside for its rows" in describe(budget) and "2048 -> 2032" in describe(budget)


# -- the hook around SGLang's sizing ----------------------------------------------


def _configurator(max_total_tokens=None):
    """Stands for SGLang's configurator, and what kv_sizing reads of it (monkeypatched)."""
    return types.SimpleNamespace(sizing=(SMOL, max_total_tokens, True))


def _sizing(tokens_alone: int):
    calls = []

    def original(configurator, budget_bytes, cap_tokens=None):
        calls.append(cap_tokens)
        tokens = tokens_alone if cap_tokens is None else min(tokens_alone, cap_tokens)
        return types.SimpleNamespace(max_total_num_tokens=tokens)

    return original, calls


@pytest.fixture
def smol_shape(monkeypatch):
    monkeypatch.setattr(table_reserve, "kv_sizing", lambda configurator: configurator.sizing)


def test_sglangs_sizing_takes_the_cap_the_hook_passes():
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    params = inspect.signature(KVCacheConfigurator.config_from_budget).parameters
    assert list(params)[:2] == ["self", "budget_bytes"] and params["cap_tokens"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_kv_pool_is_sized_again_under_the_tables_cap_and_the_runtime_keeps_the_budget(smol_shape):
    runtime = Runtime(GUARDED)
    original, calls = _sizing(2048)
    config = table_reserve.reserve_table(runtime, original, _configurator(max_total_tokens=2048), 10**9)
    assert config.max_total_num_tokens == 2032 and calls == [None, 2032]
    assert runtime.table_budget.kv_tokens_alone == 2048 and runtime.table_budget.sized_by.startswith("--max-total")


def test_a_resize_with_a_cap_passes_through(smol_shape):
    runtime = Runtime(GUARDED)
    original, calls = _sizing(2048)
    config = table_reserve.reserve_table(runtime, original, _configurator(), 10**9, cap_tokens=2032)
    assert config.max_total_num_tokens == 2032 and calls == [2032] and runtime.table_budget is None


@pytest.mark.parametrize("config", [ImportanceConfig(), ImportanceConfig(hot_set_policy="dense")])
def test_without_a_hot_set_or_with_a_dense_one_the_kv_pool_keeps_its_size(smol_shape, config):
    original, calls = _sizing(2048)
    assert table_reserve.reserve_table(Runtime(config), original, _configurator(), 10**9).max_total_num_tokens == 2048
    assert calls == [None]


# -- the backend's stores over the pool --------------------------------------------


class _KVPool:
    """SGLang's MHA pool layout: each layer's K and V halves of one allocation."""

    def __init__(self, tokens: int, dtype=torch.bfloat16) -> None:
        self.fused = torch.zeros(2, tokens + PAGE, SMOL.num_kv_heads, SMOL.head_dim, dtype=dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.fused[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.fused[1]


def _model_runner(config: ImportanceConfig, tokens: int):
    server_args = types.SimpleNamespace(_importance=config, enable_metrics=False, enable_hierarchical_cache=True)
    return types.SimpleNamespace(
        server_args=server_args, token_to_kv_pool=_KVPool(tokens), page_size=PAGE, max_total_num_tokens=tokens
    )


def test_the_backend_borrows_its_rows_from_the_kv_pool_and_sets_nothing_aside(caplog):
    runtime = Runtime(GUARDED)
    runtime.table_budget = plan_table(2048, SMOL)
    tokens = runtime.table_budget.kv_tokens
    table = PageImportanceTable.for_pool(tokens, page_size=PAGE)
    runner = _model_runner(GUARDED, tokens)
    with caplog.at_level(logging.INFO, logger=hot_set_attention.__name__):
        hot_set = hot_set_attention.build_hot_set(runtime, runner, SMOL.num_layers - 1, table)
    guard, ranges = hot_set.decoder.guard, hot_set.decoder.ranges
    assert guard.layout.halves == 2 and guard.rows.rows_per_page == 7 and ranges.rows.rows_per_page == PAGE
    assert runtime.row_pages.borrowed == 0 and guard.alloc(1) is None, "no page is lent before a batch"
    # A page lent: its code rows are bytes of that page's K and V, nowhere else.
    runtime.row_pages.settle(1, lambda t: slots_of([5]), lambda s: None)
    rows = guard.alloc(7)
    keys = torch.randn(7, PAGE, SMOL.num_kv_heads, SMOL.head_dim)
    guard.write(0, rows, keys, keys.amin(1), keys.amax(1), keys)
    touched = (runner.token_to_kv_pool.fused != 0).any(dim=(2, 3))  # [2, slots]
    assert touched.any() and not touched[:, : 5 * PAGE].any() and not touched[:, 6 * PAGE :].any()
    assert "nothing set aside" in caplog.text


def test_a_batch_is_lent_the_pages_its_rows_need_and_gives_back_the_rest(monkeypatch):
    freed, moves = [], []
    runtime = Runtime(GUARDED)
    runtime.row_pages = BorrowedPages(PAGE)
    tokens = iter(range(1, 50))
    allocator = types.SimpleNamespace(
        alloc=lambda n: slots_of([next(tokens) for _ in range(n // PAGE)]), free=freed.append, device="cpu"
    )
    scheduler = types.SimpleNamespace(tree_cache=types.SimpleNamespace(token_to_kv_pool_allocator=allocator))
    runtime.residency.apply = moves.append  # what the step's end returned, made after the batch
    ended = []  # the stock when the step ended: its end writes rows into borrowed pages

    def end_batch() -> str:
        ended.append(runtime.row_pages.available())
        return "the step's moves"

    runtime.hot_set_attention = types.SimpleNamespace(end_batch=end_batch)
    lent = []

    def run(scheduler, batch):
        lent.append(runtime.row_pages.available())
        runtime.row_pages.take(1)  # the step's rows took one page

    monkeypatch.setattr(hot_set_rows, "pages_for_batch", lambda rt, batch: 3)
    hot_set_rows.around_batch(runtime, run, scheduler, types.SimpleNamespace(reqs=[]))
    assert lent == [3] and runtime.row_pages.borrowed == 1 and sum(f.numel() for f in freed) == 2 * PAGE
    assert ended == [2], "the step ended while the stock was still lent"
    assert moves == ["the step's moves"], "its page moves made after the stock is back"


# -- the series ----------------------------------------------------------------------


def test_the_gauges_show_rows_in_use_the_pages_borrowed_for_them_and_what_requests_hold():
    registry = CollectorRegistry()
    metrics = HotSetMetrics({"tp_rank": 0}, registry=registry)
    guard = GuardPool(2, 1, 8, page_size=4, capacity_pages=10)
    ranges = KeyRanges(2, 1, 8, capacity_pages=12, page_size=4)
    decoder = types.SimpleNamespace(
        guard=guard,
        ranges=ranges,
        residency=Residency(),
        held_bytes=1234,
        tracked={"a": None},
        fold_step=lambda: [None],  # the step's requests (what end_step, faked too, takes)
        end_step=lambda live, ahead: StepResult(HotSetCounts(), PageMoves()),
        totals=HotSetCounts(),
    )
    hot_set = hot_set_attention.HotSetAttention(decoder, page_importance=None, metrics=metrics)
    guard.alloc(3)
    ranges.alloc(5)
    hot_set.phase = StepPhase.EAGER  # begun (its plan faked away above)
    hot_set.end_step()

    def gauge(name: str) -> float:
        return registry.get_sample_value(f"sgl_importance:hot_set_{name}", {"tp_rank": "0"})

    assert gauge("guard_rows_in_use") == 3 and gauge("range_rows_in_use") == 5
    assert gauge("borrowed_pages") == guard.rows.pages + ranges.rows.pages == 1 + 2
    assert gauge("device_bytes") == 1234 and gauge("tracked_requests") == 1


def test_a_batch_is_lent_pages_for_the_rows_its_requests_will_write_and_no_more():
    from sgl_importance.hot_set import HotSetDecoder, HotSetParams
    from sgl_importance.hot_set.plan.request_state import TrackedRequest
    from sgl_importance.hot_set.plan.selection import RequestHotSet

    ranges = KeyRanges(2, 1, 8, capacity_pages=1000, page_size=PAGE)
    guard = GuardPool(2, 1, 8, page_size=PAGE, capacity_pages=1000)
    params = HotSetParams(policy="importance", budget=0.5)
    decoder = HotSetDecoder(params, ranges, pool_pages=64, page_size=PAGE, threshold=256, guard=guard)
    per_code = guard.rows.rows_per_page
    # A request at 40 full pages, untracked: a row of each kind for every full page.
    assert hot_set_rows.pages_wanted(decoder, {"a": 40 * PAGE + 3}) == 3 + -(-40 // per_code)
    # Within the threshold: none, unless it is known to be long (a streamed prompt's first chunk).
    assert hot_set_rows.pages_wanted(decoder, {"a": 10 * PAGE}) == 0
    assert hot_set_rows.pages_wanted(decoder, {"a": 10 * PAGE}, long=True) == 1 + -(-10 // per_code)
    # Tracked with 39 pages summarised: one page more of each kind's rows, within the stores'
    # free rows once they hold pages.
    tracked = decoder.residency.open("a").tracked = TrackedRequest(RequestHotSet(params))
    tracked.ranges, tracked.codes = ranges.alloc(39), guard.alloc(39)
    assert hot_set_rows.pages_wanted(decoder, {"a": 40 * PAGE}) == 0, "the stores' held pages have free rows"
    # Refused a guard: ranges only; a dense policy keeps no rows at all.
    tracked.guard_refused = True
    assert hot_set_rows.pages_wanted(decoder, {"a": 200 * PAGE}) == ranges.rows.pages_for(200 - 39)
    decoder.request_params.note("b", HotSetParams(policy="dense", budget=0.5))
    assert hot_set_rows.pages_wanted(decoder, {"b": 200 * PAGE}) == 0


@pytest.mark.parametrize("checkpoint", [True, False], ids=["finished", "retracted or aborted"])
def test_a_leaving_request_gives_its_rows_back_and_their_pages_go_back_to_the_allocator(checkpoint):
    from sgl_importance.hot_set import HotSetDecoder, HotSetParams
    from sgl_importance.hot_set.plan.request_state import TrackedRequest
    from sgl_importance.hot_set.plan.selection import RequestHotSet

    freed: list[torch.Tensor] = []
    pages = iter(range(1, 100))
    allocator = types.SimpleNamespace(
        alloc=lambda n: slots_of([next(pages) for _ in range(n // PAGE)]), free=freed.append, device="cpu"
    )
    tree_cache = types.SimpleNamespace(token_to_kv_pool_allocator=allocator)
    runtime = Runtime(GUARDED)
    runtime.row_pages = BorrowedPages(PAGE)
    fused = torch.zeros(2, 100 * PAGE, 1, 8)
    ranges = KeyRanges.over_pool([fused[0]], [fused[1]], PAGE, runtime.row_pages)
    guard = GuardPool.over_pool([fused[0]], [fused[1]], PAGE, runtime.row_pages)
    params = HotSetParams(policy="importance", budget=0.5)
    decoder = HotSetDecoder(params, ranges, pool_pages=100, page_size=PAGE, threshold=0, guard=guard)
    runtime.hot_set_attention, runtime.hot_set_decoder = types.SimpleNamespace(metrics=None), decoder
    hot_set_rows.settle(runtime.row_pages, tree_cache, 5)
    tracked = decoder.residency.open("r").tracked = TrackedRequest(RequestHotSet(params))
    tracked.ranges, tracked.codes = ranges.alloc(20), guard.alloc(20)
    hot_set_rows.settle(runtime.row_pages, tree_cache, 0)  # after the batch: the stock back
    held = ranges.rows.pages + guard.rows.pages  # 20 ranges in 2 pages, 20 code rows in 2 (15 a page)
    assert held == 4 and runtime.row_pages.borrowed == held and sum(f.numel() for f in freed) == PAGE
    left = []
    hot_set_rows.release_rows(runtime, lambda req, cache, **kw: left.append(kw), types.SimpleNamespace(rid="r"),
                              tree_cache, checkpoint=checkpoint)  # fmt: skip
    assert left == [{"checkpoint": checkpoint}] and "r" not in decoder.tracked
    assert runtime.row_pages.borrowed == 0 and sum(f.numel() for f in freed) == 5 * PAGE  # the stock's and the rows'
    assert ranges.pages_in_use == guard.pages_in_use == 0
