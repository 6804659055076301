"""The guard's pool inside the memory budget: its bytes, what the KV pool gives up, when nothing is reserved."""

from __future__ import annotations

import inspect
import logging
import types
from dataclasses import replace

import pytest
import torch
from prometheus_client import CollectorRegistry

from sgl_importance.attention import hot_set_attention
from sgl_importance.config import ImportanceConfig
from sgl_importance.hot_set.decode import StepResult
from sgl_importance.hot_set.guard_budget import (
    MAX_AUTO_COVERAGE,
    GuardBudget,
    KVShape,
    auto_coverage,
    describe,
    guard_budget,
    plan_guard,
)
from sgl_importance.hot_set.key_codes import GuardPool, bytes_per_token
from sgl_importance.hot_set.key_ranges import KeyRanges
from sgl_importance.hot_set.residency import Residency, StepMoves
from sgl_importance.hot_set.selection import HotSetCounts
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.metrics import HotSetMetrics
from sgl_importance.runtime import Runtime

PAGE = 16
# SmolLM2-135M on torch_cpu (float32 KV) and a Llama-3.1-8B shape (bf16 KV).
SMOL = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, v_head_dim=64, element_size=4, page_size=PAGE)
LLAMA = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, v_head_dim=128, element_size=2, page_size=PAGE)
GUARDED = ImportanceConfig(hot_set_policy="importance")


def fits(budget: GuardBudget) -> bool:
    """The KV pool and the hot set's pools together within what the KV pool alone had."""
    per_token = budget.shape.kv_bytes_per_page // budget.shape.page_size
    return budget.kv_tokens * per_token + budget.reserved_bytes <= budget.kv_tokens_alone * per_token


# -- the arithmetic ---------------------------------------------------------------


def test_the_guard_takes_an_eighth_of_bf16_kv_per_token_at_head_dim_128():
    assert bytes_per_token(128, PAGE) == 64.25
    per_token_kv = LLAMA.kv_bytes_per_page / PAGE
    assert LLAMA.guard_bytes_per_page / PAGE / per_token_kv == pytest.approx(64.25 / 512)


@pytest.mark.parametrize("shape", [SMOL, LLAMA], ids=["smollm-f32", "llama-bf16"])
@pytest.mark.parametrize("tokens", [1, 256, 1000, 4096])
def test_the_reserved_bytes_are_what_the_guard_pool_allocates_for_those_tokens(shape, tokens):
    budget = plan_guard(2**20, shape, guard_tokens=tokens)
    assert budget.guard_pages == -(-tokens // PAGE) and budget.guard_tokens >= tokens
    pool = GuardPool(shape.num_layers, shape.num_kv_heads, shape.head_dim, page_size=PAGE,
                     capacity_pages=budget.guard_pages)  # fmt: skip
    assert budget.guard_bytes == pool.nbytes


def test_a_stated_guard_takes_its_bytes_out_of_the_kv_pool_in_whole_pages():
    budget = plan_guard(2048, SMOL, guard_tokens=256)
    # 17 pages (one padding) x 30 layers x 3 heads x (16 x 32 + 4) bytes.
    assert budget.guard_bytes == 17 * 90 * 516 == 789_480
    # 789 480 / 46 080 bytes per KV token = 17.1 tokens: two 16-token pages.
    assert budget.kv_tokens == 2048 - 32 and budget.kv_tokens_given_up == 32
    assert fits(budget)
    # Giving up one page less would overrun.
    assert not fits(GuardBudget(budget.guard_pages, budget.guard_bytes, 2048, budget.kv_tokens + PAGE, SMOL))


@pytest.mark.parametrize("tokens", [16, 300, 5000, 100_000])
def test_the_kv_pool_gives_up_the_fewest_whole_pages_that_hold_the_guard(tokens):
    budget = plan_guard(200_000, LLAMA, guard_tokens=tokens)
    kv_token = LLAMA.kv_bytes_per_page // PAGE
    assert budget.kv_tokens % PAGE == 0 and fits(budget)
    assert (budget.kv_tokens + PAGE) * kv_token + budget.reserved_bytes > budget.kv_tokens_alone * kv_token


@pytest.mark.parametrize("coverage", [1.0, 2.5, 5.0, MAX_AUTO_COVERAGE])
def test_an_auto_guard_covers_its_multiple_of_the_smaller_kv_pool_and_both_fit(coverage):
    budget = plan_guard(32768, SMOL, guard_tokens=None, coverage=coverage)
    assert budget.guard_pages == int(coverage * budget.kv_tokens // PAGE)
    assert fits(budget)
    # One more KV page (and the guard pages it would bring) would not fit.
    more = budget.kv_tokens // PAGE + 1
    bigger = GuardBudget(int(coverage * more), SMOL.guard_bytes(int(coverage * more)), 32768, more * PAGE, SMOL)
    assert not fits(bigger)


def test_at_the_default_budget_a_llama_shape_keeps_about_three_fifths_of_its_kv_pool():
    # 5 x 12.5 % of the KV's bytes per KV token: the pool keeps 1 / 1.63 of its tokens.
    budget = plan_guard(100_000 // PAGE * PAGE, LLAMA, guard_tokens=None, coverage=5.0)
    assert budget.kv_tokens / budget.kv_tokens_alone == pytest.approx(1 / (1 + 5 * 64.25 / 512), abs=1e-3)


def test_auto_coverage_follows_the_budget_fraction_only_where_pages_are_released():
    assert auto_coverage(0.2, hierarchical=True) == pytest.approx(5.0)
    assert auto_coverage(0.5, hierarchical=True) == pytest.approx(2.0)
    assert auto_coverage(1.0, hierarchical=True) == 1.0
    assert auto_coverage(0.01, hierarchical=True) == MAX_AUTO_COVERAGE
    assert auto_coverage(40, hierarchical=True) == 5.0  # a budget in pages
    # Nothing released: every guarded page is in the KV pool already.
    assert auto_coverage(0.2, hierarchical=False) == 1.0


@pytest.mark.parametrize(
    "config",
    [ImportanceConfig(), ImportanceConfig(hot_set_policy="dense", hot_set_guard_tokens=4096)],
    ids=["hot-set-off", "dense"],
)
def test_nothing_is_reserved_without_a_hot_set_or_with_a_dense_one(config):
    budget = guard_budget(config, SMOL, 32768, hierarchical=True)
    assert (budget.reserved_bytes, budget.kv_tokens) == (0, 32768)
    assert "no key-range or guard pool" in describe(budget)


@pytest.mark.parametrize("tokens", [0, 4096], ids=["auto", "stated"])
def test_with_the_guard_off_only_the_key_ranges_and_the_table_are_reserved(tokens):
    config = ImportanceConfig(hot_set_policy="importance", hot_set_guard_threshold=1.0, hot_set_guard_tokens=tokens)
    budget = guard_budget(config, SMOL, 32768, hierarchical=True)
    assert budget.guard_pages == budget.guard_bytes == 0 and budget.range_pages > 0
    assert budget.range_bytes == SMOL.range_bytes(budget.range_pages) and budget.table_bytes > 0
    assert fits(budget) and "no guard pool" in describe(budget)


def test_a_range_page_is_a_sixteenth_of_bf16_kv_and_a_thirty_second_of_float32_kv():
    # Min and max vectors per page, layer and KV head, in 16 bits.
    assert LLAMA.range_bytes_per_page * 16 == LLAMA.kv_bytes_per_page
    assert SMOL.range_bytes_per_page * 32 == SMOL.kv_bytes_per_page
    ranges = KeyRanges(SMOL.num_layers, SMOL.num_kv_heads, SMOL.head_dim, capacity_pages=100)
    assert ranges.nbytes == SMOL.range_bytes(100)


def test_the_flags_pick_a_stated_or_an_auto_guard():
    stated = guard_budget(ImportanceConfig(hot_set_policy="importance", hot_set_guard_tokens=256), SMOL, 2048,
                          hierarchical=True)  # fmt: skip
    assert stated.guard_tokens == 256
    auto = guard_budget(GUARDED, SMOL, 32768, hierarchical=True)
    assert auto.guard_pages == int(5 * auto.kv_tokens // PAGE)
    no_host = guard_budget(GUARDED, SMOL, 32768, hierarchical=False)
    assert no_host.guard_pages == no_host.kv_tokens // PAGE


def test_a_guard_that_leaves_the_kv_pool_nothing_stops_start_up_naming_the_flag():
    with pytest.raises(ValueError, match="--hot-set-guard-tokens 100000 is invalid"):
        plan_guard(2048, SMOL, guard_tokens=100_000)


def test_the_flag_is_validated_at_start_up():
    with pytest.raises(ValueError, match="--hot-set-guard-tokens -1 is invalid"):
        ImportanceConfig(hot_set_guard_tokens=-1)


def test_the_start_up_line_states_tokens_bytes_share_and_what_the_kv_pool_gave_up():
    budget = plan_guard(2048, SMOL, guard_tokens=256, ranges=True)
    line = describe(replace(budget, sized_by="--max-total-tokens 2048"))
    assert "pools of 256 tokens (16 pages over 30 layers x 3 KV heads)" in line
    # Float32 keys, ranges in bfloat16: a page's range (2 x 64 x 2 bytes a head) is half its codes.
    assert "key ranges 0.37 MiB, guard codes 0.75 MiB" in line
    assert "% of the KV pool's" in line and "gave up 32 tokens: 2048 -> 2016 (--max-total-tokens 2048)" in line


# -- the hook around SGLang's sizing ----------------------------------------------


def _configurator(max_total_tokens=None, hierarchical=True):
    """Stands for SGLang's configurator, and what kv_sizing reads of it (monkeypatched)."""
    return types.SimpleNamespace(sizing=(SMOL, max_total_tokens, hierarchical))


def _sizing(tokens_alone: int):
    """SGLang's config_from_budget, reduced to what the hook sees: the tokens, capped."""
    calls = []

    def original(configurator, budget_bytes, cap_tokens=None):
        calls.append(cap_tokens)
        tokens = tokens_alone if cap_tokens is None else min(tokens_alone, cap_tokens)
        return types.SimpleNamespace(max_total_num_tokens=tokens)

    return original, calls


@pytest.fixture
def smol_shape(monkeypatch):
    monkeypatch.setattr(hot_set_attention, "kv_sizing", lambda configurator: configurator.sizing)


def test_sglangs_sizing_takes_the_cap_the_hook_passes():
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    params = inspect.signature(KVCacheConfigurator.config_from_budget).parameters
    assert list(params)[:2] == ["self", "budget_bytes"] and params["cap_tokens"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_kv_pool_is_sized_again_under_the_guards_cap_and_the_runtime_keeps_the_budget(smol_shape):
    runtime = Runtime(ImportanceConfig(hot_set_policy="importance", hot_set_guard_tokens=256))
    original, calls = _sizing(2048)
    config = hot_set_attention.reserve_guard(runtime, original, _configurator(max_total_tokens=2048), 10**9)
    assert config.max_total_num_tokens == 2016 and calls == [None, 2016]
    assert runtime.guard_budget.guard_tokens == 256 and runtime.guard_budget.kv_tokens_alone == 2048
    assert runtime.guard_budget.sized_by == "--max-total-tokens 2048 bound it"


def test_a_profiled_pool_says_so(smol_shape):
    runtime = Runtime(ImportanceConfig(hot_set_policy="importance", hot_set_guard_tokens=256))
    original, _ = _sizing(4096)
    hot_set_attention.reserve_guard(runtime, original, _configurator(max_total_tokens=None), 10**9)
    assert runtime.guard_budget.sized_by == "the profiled memory" and runtime.guard_budget.kv_tokens == 4064


def test_a_resize_with_a_cap_passes_through(smol_shape):
    # SGLang's post-capture resize measures memory the guard already holds.
    runtime = Runtime(ImportanceConfig(hot_set_policy="importance", hot_set_guard_tokens=256))
    original, calls = _sizing(2048)
    config = hot_set_attention.reserve_guard(runtime, original, _configurator(), 10**9, cap_tokens=2016)
    assert config.max_total_num_tokens == 2016 and calls == [2016] and runtime.guard_budget is None


@pytest.mark.parametrize("config", [ImportanceConfig(), ImportanceConfig(hot_set_policy="dense")])
def test_without_a_hot_set_or_with_a_dense_one_the_kv_pool_keeps_its_size(smol_shape, config):
    runtime = Runtime(config)
    original, calls = _sizing(2048)
    assert hot_set_attention.reserve_guard(runtime, original, _configurator(), 10**9).max_total_num_tokens == 2048
    assert calls == [None]


# -- the pool built with that size, and its series -----------------------------------


class _KVPool:
    def __init__(self, tokens: int) -> None:
        self.k = torch.zeros(tokens + PAGE, SMOL.num_kv_heads, SMOL.head_dim)
        self.v = torch.zeros(tokens + PAGE, SMOL.num_kv_heads, SMOL.v_head_dim)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v


def _model_runner(config: ImportanceConfig, tokens: int):
    server_args = types.SimpleNamespace(_importance=config, enable_metrics=False, enable_hierarchical_cache=True)
    return types.SimpleNamespace(
        server_args=server_args, token_to_kv_pool=_KVPool(tokens), page_size=PAGE, max_total_num_tokens=tokens
    )


def test_the_backend_builds_the_guard_pool_it_reserved_and_logs_it(caplog):
    config = ImportanceConfig(hot_set_policy="importance", hot_set_guard_tokens=256)
    runtime = Runtime(config)
    runtime.guard_budget = plan_guard(2048, SMOL, guard_tokens=256, ranges=True)
    tokens = runtime.guard_budget.kv_tokens
    table = PageImportanceTable.for_pool(tokens, page_size=PAGE)
    with caplog.at_level(logging.INFO, logger=hot_set_attention.__name__):
        hot_set = hot_set_attention.build_hot_set(runtime, _model_runner(config, tokens), SMOL.num_layers - 1, table)
    guard, ranges = hot_set.decoder.guard, hot_set.decoder.ranges
    assert guard.capacity == ranges.capacity == 16 and guard.nbytes == runtime.guard_budget.guard_bytes
    # Every byte the pools and the table hold is what was taken out of the KV pool.
    assert guard.nbytes + ranges.nbytes + table.nbytes == runtime.guard_budget.reserved_bytes
    assert "pools of 256 tokens" in caplog.text and "2048 -> 2016" in caplog.text
    assert "exceed" not in caplog.text


def test_a_backend_built_without_sglangs_sizing_says_its_guard_is_outside_the_kv_pool(caplog):
    config = ImportanceConfig(hot_set_policy="importance", hot_set_guard_tokens=256)
    table = PageImportanceTable.for_pool(2048, page_size=PAGE)
    with caplog.at_level(logging.INFO, logger=hot_set_attention.__name__):
        hot_set = hot_set_attention.build_hot_set(Runtime(config), _model_runner(config, 2048), 29, table)
    assert hot_set.decoder.guard.capacity == 16 and "NOT taken out of the KV pool" in caplog.text


def test_the_pools_gauges_show_their_size_and_after_each_step_their_use_and_what_requests_hold():
    registry = CollectorRegistry()
    metrics = HotSetMetrics({"tp_rank": 0}, registry=registry)
    guard = GuardPool(2, 1, 8, page_size=4, capacity_pages=10)
    ranges = KeyRanges(2, 1, 8, capacity_pages=12)
    metrics.pools(guard.capacity, guard.nbytes, ranges.capacity, ranges.nbytes)
    decoder = types.SimpleNamespace(
        guard=guard,
        ranges=ranges,
        residency=Residency(),
        held_bytes=1234,
        tracked={"a": None},
        fold_step=lambda: [None],  # the step's requests (what end_step, faked too, takes)
        end_step=lambda live, ahead: StepResult(HotSetCounts(), StepMoves()),
        totals=HotSetCounts(),
    )
    hot_set = hot_set_attention.HotSetAttention(decoder, page_importance=None, metrics=metrics)
    guard.alloc(3)
    ranges.alloc(5)
    hot_set.in_step = True
    hot_set.end_step()

    def gauge(name: str) -> float:
        return registry.get_sample_value(f"sgl_importance:hot_set_{name}", {"tp_rank": "0"})

    assert gauge("guard_capacity_pages") == 10 and gauge("guard_bytes") == guard.nbytes
    assert gauge("range_capacity_pages") == 12 and gauge("range_bytes") == ranges.nbytes
    assert gauge("guard_pages_in_use") == 3 and gauge("range_pages_in_use") == 5
    assert gauge("device_bytes") == 1234 and gauge("tracked_requests") == 1
