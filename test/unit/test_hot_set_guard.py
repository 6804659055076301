"""The guard as a specification: the shadow rounds within its stated error, the
estimate folded into the softmax is the exact attention when nothing is left to
estimate, and the bound on the output error is never below the exact error, on
random inputs and on inputs built to break it."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_importance.hot_set import OutsidePlan, ShadowPool, combine, estimate_outside, pages_to_read

PAGE = 4
KV_HEADS, GROUP, DIM = 2, 3, 8
Q_HEADS = KV_HEADS * GROUP
SCALE = DIM**-0.5


def exact_attention(q, keys, values, scale=SCALE, logit_cap=0.0):
    """float64 attention of one request: q [Hq, D], keys/values [n, Hkv, D] -> (lse [Hq], out [Hq, D])."""
    qg = q.double().view(KV_HEADS, GROUP, -1)
    logits = torch.einsum("hgd,nhd->hgn", qg, keys.double()) * scale
    if logit_cap:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    lse = torch.logsumexp(logits, -1)
    out = torch.einsum("hgn,nhd->hgd", torch.softmax(logits, -1), values.double())
    return lse.reshape(Q_HEADS), out.reshape(Q_HEADS, -1)


def request(num_pages, seed, *, key_scale=1.0, value_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g) * key_scale
    values = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g) * value_scale
    q = torch.randn(Q_HEADS, DIM, generator=g) * 2
    return q, keys, values


def shadow_of(keys, values):
    pool = ShadowPool(1, KV_HEADS, DIM, page_size=PAGE, initial_pages=2)
    ids = pool.alloc(keys.shape[0])
    pool.write(0, ids, keys, values)
    return pool, ids


def estimated(q, keys, values, exact_pages, logit_cap=0.0):
    """The guard's view of one request: exact pages read, the rest from the shadow."""
    num_pages = keys.shape[0]
    pool, ids = shadow_of(keys, values)
    outside = torch.tensor([p for p in range(num_pages) if p not in exact_pages], dtype=torch.int64)
    plan = OutsidePlan.build([0], [ids[outside]], [outside])
    est = estimate_outside(q[None], pool, 0, plan, sm_scale=SCALE, logit_cap=logit_cap)
    sel = torch.tensor(sorted(exact_pages), dtype=torch.int64)
    lse_s, out_s = exact_attention(q, keys[sel].flatten(0, 1), values[sel].flatten(0, 1), logit_cap=logit_cap)
    return combine(lse_s[None].float(), out_s[None].float(), est), plan, est


def test_the_shadow_rounds_every_logit_and_value_within_its_stated_error():
    q, keys, values = request(6, 0, key_scale=5.0)
    keys[2, :, 0, 3] += 40.0  # an outlier channel
    pool, ids = shadow_of(keys, values)
    pages = pool.pages(0, ids)
    got_k = pages.keys().permute(1, 2, 0, 3)  # [n, ps, Hkv, D]
    got_v = pages.values().permute(1, 2, 0, 3)
    # Element-wise: within half a step (8 bits: 1/510 of the channel's range over the page).
    span = (keys.amax(1) - keys.amin(1)).transpose(0, 1)  # [Hkv, n, D]
    assert ((got_k - keys).abs().amax(1).transpose(0, 1) <= pages.k_step * 0.5 + 1e-5).all()
    assert (pages.k_step <= span / 255 * (1 + 1e-2) + 1e-6).all()
    # What the bound uses: the logit error of any query, the value error in L2.
    qs = (q.view(KV_HEADS, GROUP, DIM) * SCALE)[:, None]  # [Hkv, 1, g, D]
    exact = torch.einsum("hgd,pthd->hgpt", qs[:, 0].double(), keys.double())
    approx = torch.einsum("hgd,pthd->hgpt", qs[:, 0].double(), got_k.double())
    bound = pages.logit_error(qs)[:, 0]  # [Hkv, g, P]
    assert ((exact - approx).abs().amax(-1) <= bound.double()).all()
    assert ((got_v - values).norm(dim=-1).amax(1).transpose(0, 1) <= pages.v_error).all()
    assert torch.allclose(pages.v_norm, got_v.norm(dim=-1).permute(2, 0, 1))


def test_freed_shadow_ids_are_reused_and_the_pool_grows_keeping_what_it_held():
    pool = ShadowPool(1, KV_HEADS, DIM, page_size=PAGE, initial_pages=2)
    _, keys, values = request(3, 1)
    first = pool.alloc(1)
    pool.write(0, first, keys[:1], values[:1])
    more = pool.alloc(5)  # past the capacity: grows
    assert pool.capacity >= 7 and 0 not in more.tolist() and first.item() not in more.tolist()
    assert torch.equal(
        pool.pages(0, first).keys(), shadow_of(keys[:1], values[:1])[0].pages(0, torch.tensor([1])).keys()
    )
    pool.free(more[:2])
    assert sorted(pool.alloc(2).tolist()) == sorted(more[:2].tolist())
    assert pool.pages_in_use == 6


def test_every_page_read_exactly_gives_the_exact_output_and_a_zero_bound():
    q, keys, values = request(7, 2)
    combined, _, _ = estimated(q, keys, values, set(range(7)))
    lse, out = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
    assert torch.allclose(combined.output[0].double(), out, atol=1e-5)
    assert torch.allclose(combined.lse[0].double(), lse, atol=1e-5)
    assert combined.bound.item() == 0.0 and combined.relative.item() == 0.0


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
def test_the_bound_is_never_below_the_exact_error_on_random_requests(seed, logit_cap):
    q, keys, values = request(12, seed, key_scale=1.0 + seed % 4)
    exact_pages = {0, 10, 11} | {seed % 9 + 1}
    combined, _, _ = estimated(q, keys, values, exact_pages, logit_cap)
    _, out = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1), logit_cap=logit_cap)
    error = (combined.output[0].double() - out).norm()
    assert error <= combined.bound[0].double() + 1e-6
    assert error / out.norm() <= combined.relative[0].double() + 1e-6
    # The estimate is far closer than leaving the outside out.
    assert error < 0.05 * out.norm()


def adversarial_requests():
    """Inputs built against the bound: a heavy hitter outside the exact pages, outlier
    key channels, huge values on a rarely attended token, a page of identical keys, and
    near-uniform attention over many pages (the diffuse case)."""
    q, keys, values = request(10, 100)
    hitter = keys.clone()
    hitter[6, 2] = q.view(KV_HEADS, GROUP, DIM).sum(1) * 3  # aligned with every head's query
    yield "heavy hitter outside", q, hitter, values, {0, 9}
    outlier = keys.clone()
    outlier[:, :, :, 5] *= 60.0
    yield "outlier key channel", q, outlier, values, {0, 9}
    spiky = values.clone()
    spiky[4, 1] = 1e3
    yield "huge value", q, keys, spiky, {0, 9}
    flat = keys.clone()
    flat[3] = flat[3, :1]
    yield "identical keys", q, flat, values, {0, 9}
    yield "diffuse", q * 0.01, keys, values, {0, 9}
    yield "sharp inside", q * 20, keys, values, {0, 4, 9}


@pytest.mark.parametrize("case", list(adversarial_requests()), ids=lambda c: c[0])
def test_the_bound_is_never_below_the_exact_error_on_adversarial_requests(case):
    _, q, keys, values, exact_pages = case
    combined, _, _ = estimated(q, keys, values, exact_pages)
    _, out = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
    error = (combined.output[0].double() - out).norm()
    assert error <= combined.bound[0].double() * (1 + 1e-5) + 1e-6
    assert error / out.norm() <= combined.relative[0].double() * (1 + 1e-5) + 1e-6


def test_reading_the_pages_the_guard_picks_brings_the_bound_under_the_threshold():
    q, keys, values = request(16, 5, value_scale=3.0)
    keys[7, 1] = q.view(KV_HEADS, GROUP, DIM).mean(1) * 4  # a page the exact set misses
    exact_pages = {0, 15}
    combined, plan, est = estimated(q, keys, values, exact_pages)
    threshold = 0.5 * combined.relative.item()
    chosen = pages_to_read(combined, plan.valid, threshold)
    picked = set(plan.logical[0][chosen[0]].tolist())
    assert 0 < len(picked) < 14 and 7 in picked
    # Read them exactly and combine again: the bound now holds.
    read = sorted(exact_pages | picked)
    lse_s, out_s = exact_attention(q, keys[read].flatten(0, 1), values[read].flatten(0, 1))
    again = combine(lse_s[None].float(), out_s[None].float(), est, keep=plan.valid & ~chosen)
    assert again.relative.item() <= threshold
    _, out = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
    error = (again.output[0].double() - out).norm() / out.norm()
    assert error <= again.relative.item() + 1e-6


def test_a_bound_that_already_holds_reads_nothing():
    q, keys, values = request(8, 6)
    combined, plan, _ = estimated(q, keys, values, {0, 7})
    assert not pages_to_read(combined, plan.valid, combined.relative.item() * 2 + 1e-3).any()


def test_rows_without_outside_pages_keep_the_exact_output():
    q, keys, values = request(3, 7)
    pool, ids = shadow_of(keys, values)
    plan = OutsidePlan.build([0], [ids[:0]], [torch.zeros(0, dtype=torch.int64)])
    est = estimate_outside(q[None], pool, 0, plan, sm_scale=SCALE)
    lse, out = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
    combined = combine(lse[None].float(), out[None].float(), est)
    assert torch.allclose(combined.output[0].double(), out, atol=1e-6)
    assert combined.bound.item() == 0.0 and not math.isnan(combined.relative.item())
