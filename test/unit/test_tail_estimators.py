"""The selection study's estimators (benchmark/long_context/tail_estimators.py): the deterministic
bound holds on adversarial keys and values, a full read is exact, a sample that takes every page is
exact, and top-p on exact masses reaches p."""

from __future__ import annotations

import math

import pytest
import torch

from benchmark.long_context.tail_estimators import CANDIDATES, Setup, evaluate, layer_step, topp_pages

HQ, HKV, D, PAGE = 6, 2, 16, 16


def adversarial(seed: int, pages: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys with an outlier channel and duplicated pages, values with heavy-tailed page scales."""
    g = torch.Generator().manual_seed(seed)
    n = pages * PAGE - 5  # a partial last page
    q = torch.randn(HQ, D, generator=g) * 2
    k = torch.randn(HKV, n, D, generator=g)
    k[..., seed % D] *= 25.0  # an outlier channel
    k[:, 5 * PAGE : 6 * PAGE] = k[:, 20 * PAGE : 21 * PAGE]  # a duplicated page
    k[:, 9 * PAGE : 10 * PAGE] += 3 * q.view(HKV, -1, D)[:, 0, None]  # a page the first heads attend
    scale = torch.exp(torch.randn(HKV, pages, 1, 1, generator=g) * 2).repeat_interleave(PAGE, 1)[:, :n].view(HKV, n, 1)
    v = torch.randn(HKV, n, D, generator=g) * scale
    return q, k, v


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("cap", [0.1, 0.25])
def test_the_deterministic_bound_holds_for_every_candidate(seed, cap):
    q, k, v = adversarial(seed)
    setup = Setup(page=PAGE, cap=cap, stratum=8)
    step = layer_step(q, k, v, 1 / math.sqrt(D), setup)
    got = evaluate(step, setup, torch.rand(step.always.numel()), torch.arange(16))
    for name in CANDIDATES[1:]:
        r = got[name]
        assert bool((r["error"] <= r["bound_det"] + 1e-9).all()), (name, r["error"], r["bound_det"])


def test_reading_every_page_is_exact_with_a_zero_bound():
    q, k, v = adversarial(1)
    setup = Setup(page=PAGE, cap=1.0, p=1.0)
    step = layer_step(q, k, v, 1 / math.sqrt(D), setup)
    got = evaluate(step, setup, torch.rand(step.always.numel()), torch.arange(4))["topp"]
    assert float(got["error"].max()) < 1e-12
    assert float(got["bound_det"].max()) < 1e-12
    assert float(got["read"].max()) == step.always.numel()


def test_a_sample_of_every_tail_page_makes_the_estimators_exact():
    q, k, v = adversarial(2, pages=41)  # 36 rest pages: 18 strata of two
    # Strata of two pages, both drawn: every tail page is read into the estimate with weight 1.
    setup = Setup(page=PAGE, cap=0.9, stratum=2)
    step = layer_step(q, k, v, 1 / math.sqrt(D), setup)
    got = evaluate(step, setup, torch.rand(step.always.numel()), torch.arange(3))
    for name in ("topp+ht", "topp+diff"):
        assert float(got[name]["error"].max()) < 1e-9, name


@pytest.mark.parametrize("p", [0.5, 0.9, 0.98])
def test_top_p_on_exact_masses_reaches_p_in_every_query_head(p):
    q, k, v = adversarial(3)
    step = layer_step(q, k, v, 1 / math.sqrt(D), Setup(page=PAGE))
    chosen = topp_pages(step, p, -1, mass=step.d_page).repeat_interleave(HQ // HKV, 0) | step.always
    kept = (step.d_page * chosen).sum(-1) / step.d_page.sum(-1)
    assert bool((kept >= p - 1e-12).all()), kept


def test_the_cap_limits_the_pages_of_every_kv_head():
    q, k, v = adversarial(4)
    step = layer_step(q, k, v, 1 / math.sqrt(D), Setup(page=PAGE))
    assert int(topp_pages(step, 0.999, 3).sum(-1).max()) <= 3
