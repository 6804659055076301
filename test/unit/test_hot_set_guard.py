"""The guard as a specification: key codes round within their stated error, so each
page's logit interval holds; the selection (top-p on the codes) wants the pages that
hold the mass, reads at most its cap in one read and never a released page; the
deterministic bound never understates the exact error, adversarial keys and values
included; the sampled estimate's bound fails no more often than
its stated probability; and the guard pool never grows. (Key codes of two guarded
requests that fill and release pages in one step: ``test_hot_set_release.py``.)"""

from __future__ import annotations

import pytest
import torch

from sgl_importance.hot_set import GuardPool, HotSetDecoder, HotSetParams, KeyRanges, OutsidePlan
from sgl_importance.hot_set.guard.estimate import (
    DELTA,
    combine,
    estimate_outside,
    negligible_rest,
    sampled_pages,
)
from sgl_importance.hot_set.guard.key_codes import bytes_per_token, kv_bytes_per_token, quantise, steps
from sgl_importance.hot_set.guard.layer import capped, guard_layer, wanted_pages
from sgl_importance.hot_set.pages.rows import LocalPages
from sgl_kernel_ext.key_codes import unpack

PAGE = 4
KV_HEADS, GROUP, DIM = 2, 3, 8
Q_HEADS = KV_HEADS * GROUP
SCALE = DIM**-0.5


def exact_attention(q, keys, values, logit_cap=0.0):
    """float64 attention of one request: q [Hq, D], keys/values [n, Hkv, D] -> (lse [Hq], out [Hq, D])."""
    qg = q.double().view(KV_HEADS, GROUP, -1)
    logits = torch.einsum("hgd,nhd->hgn", qg, keys.double()) * SCALE
    if logit_cap:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    lse = torch.logsumexp(logits, -1)
    out = torch.einsum("hgn,nhd->hgd", torch.softmax(logits, -1), values.double())
    return lse.reshape(Q_HEADS), out.reshape(Q_HEADS, -1)


def request(num_pages, seed, *, key_scale=1.0, q_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g) * key_scale
    values = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g)
    q = torch.randn(Q_HEADS, DIM, generator=g) * q_scale
    return q, keys, values


def coded(keys, values):
    """A guard pool holding one layer of ``keys``' codes; their ranges."""
    pool = GuardPool(1, KV_HEADS, DIM, page_size=PAGE, capacity_pages=keys.shape[0])
    ids = pool.alloc(keys.shape[0])
    low, high = keys.amin(dim=1), keys.amax(dim=1)
    pool.write(0, ids, keys, low, high, values)
    return pool, ids, low, high


def rest_of(q, keys, values, exact_pages, logit_cap=0.0, sampled=()):
    """The guard's view of one request: ``exact_pages`` read, every other page rest."""
    num_pages = keys.shape[0]
    pool, ids, low, high = coded(keys, values)
    rest = [p for p in sampled if p not in exact_pages] + [
        p for p in range(num_pages) if p not in exact_pages and p not in sampled
    ]
    rest_t = torch.tensor(rest, dtype=torch.int64)
    in_sample = torch.tensor([p in sampled for p in rest])
    plan = OutsidePlan.build([0], [ids[rest_t]], [rest_t], [in_sample], [0.5])
    outside = estimate_outside(
        q[None], pool, 0, plan, low[rest_t][None], high[rest_t][None], sm_scale=SCALE, logit_cap=logit_cap
    )
    sel = torch.tensor(sorted(exact_pages), dtype=torch.int64)
    lse_e, out_e = exact_attention(q, keys[sel].flatten(0, 1), values[sel].flatten(0, 1), logit_cap)
    return plan, outside, lse_e[None].float(), out_e[None].float(), rest_t


def test_guard_state_is_an_eighth_of_bf16_kv_for_a_llama_8b_shape():
    assert bytes_per_token(128, 16) == 64.25
    assert bytes_per_token(128, 16) / kv_bytes_per_token(128, 2) < 0.15


@pytest.mark.parametrize("dtype,rows", [(torch.bfloat16, 7), (torch.float32, 15)])
def test_a_borrowed_kv_page_holds_the_codes_and_norms_of_several_pages_without_overlap(dtype, rows):
    """Over SGLang's pool layout (a layer's K and V one allocation), one KV page holds
    ``4 x element size - 1`` code rows and their value norms; writing every row of a page
    leaves each row's codes and norms as written (a norm block over a code row would not)."""
    layers, pages, head_dim = 2, 4, 64
    fused = [torch.zeros(2, pages * PAGE, KV_HEADS, head_dim, dtype=dtype) for _ in range(layers)]
    k_buffers, v_buffers = [f[0] for f in fused], [f[1] for f in fused]
    pool = GuardPool.over_pool(k_buffers, v_buffers, PAGE, LocalPages(1, 1))
    ids = pool.alloc(rows)
    assert ids is not None and pool.alloc(1) is None, "one page holds exactly this many code rows"
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(rows, PAGE, KV_HEADS, head_dim, generator=g)
    values = torch.randn(rows, PAGE, KV_HEADS, head_dim, generator=g)
    low, high = keys.amin(dim=1), keys.amax(dim=1)
    for layer in range(layers):
        pool.write(layer, ids, keys, low, high, values * (layer + 1))
    for layer in range(layers):
        codes, norms = pool.gather(layer, ids)
        assert torch.equal(codes, quantise(keys, low, high))
        assert torch.allclose(norms.T, (values * (layer + 1)).norm(dim=-1).amax(dim=1))
    # Page 0 (SGLang's padding page) is never written.
    assert all((f[:, :PAGE] == 0).all() for f in fused)
    pool.free(ids)
    assert pool.rows.pages == 0


def test_every_key_is_within_half_a_step_of_its_code():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(5, PAGE, KV_HEADS, DIM, generator=g) * torch.linspace(0.1, 20, DIM)
    low, high = keys.amin(dim=1), keys.amax(dim=1)
    codes = unpack(quantise(keys, low, high))  # [H, n, PAGE, D]
    step = steps(low, high).transpose(0, 1)[:, :, None]
    back = low.transpose(0, 1)[:, :, None].float() + codes * step
    assert ((back - keys.permute(2, 0, 1, 3)).abs() <= step / 2 + 1e-5).all()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
def test_each_pages_mass_lies_in_its_interval(seed, logit_cap):
    q, keys, values = request(9, seed, key_scale=3.0)
    plan, outside, *_ = rest_of(q, keys, values, exact_pages={0}, logit_cap=logit_cap)
    for col, page in enumerate(plan.logical[0].tolist()):
        lse, _ = exact_attention(q, keys[page], values[page], logit_cap)
        est, err = outside.page_lse[0, :, col].double(), outside.logit_error[0, :, col].double()
        assert (lse <= est + err + 1e-4).all() and (lse >= est - err - 1e-4).all()


def test_leaving_a_negligible_rest_out_is_bounded_deterministically():
    vouched = 0
    for seed in range(8):
        q, keys, values = request(12, seed, key_scale=0.3, q_scale=1.0)
        # A sink page the query aligns with holds most of the mass; the rest is light.
        keys[0] = q.view(KV_HEADS, GROUP, DIM).mean(1)[None] * 10
        plan, outside, lse_e, out_e, _ = rest_of(q, keys, values, exact_pages={0, 11})
        light = negligible_rest(lse_e, out_e, outside, plan.valid)
        _, true = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
        error = (light.output[0].double() - true).norm() / true.norm()
        assert error <= light.relative[0] + 1e-6
        vouched += int(torch.isfinite(light.relative[0]))
    assert vouched >= 5  # not vacuous: on most of these the bound is finite


def test_a_page_the_query_aligns_with_is_wanted():
    q, keys, values = request(16, 3, key_scale=0.3, q_scale=1.0)
    q = q.view(KV_HEADS, GROUP, DIM)[:, :1].expand(-1, GROUP, -1).reshape(Q_HEADS, DIM)  # one query per KV head
    keys[9] = q.view(KV_HEADS, GROUP, DIM)[:, 0][None] * 4  # one page holds every head's mass
    plan, outside, lse_e, _, rest = rest_of(q, keys, values, exact_pages={0, 15})
    wanted = wanted_pages(lse_e, outside.page_lse, plan.valid, torch.tensor([0.5]))
    assert rest[wanted[0]].tolist() == [9]
    # A larger p wants more pages, never fewer; p = 1 wants every page with mass.
    more = wanted_pages(lse_e, outside.page_lse, plan.valid, torch.tensor([0.9]))
    every = wanted_pages(lse_e, outside.page_lse, plan.valid, torch.tensor([1.0]))
    assert bool((more | wanted).eq(more).all()) and bool(every[plan.valid].all())


def test_the_cap_keeps_the_heaviest_chosen_pages_and_no_more():
    weight = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.3], [1.0, 2.0, 3.0, 4.0, 5.0]])
    chosen = torch.tensor([[True, True, True, False, True], [True, False, True, False, False]])
    keep = capped(weight, chosen, torch.tensor([2, 5]))
    assert keep.tolist() == [[False, True, True, False, False], [True, False, True, False, False]]
    assert capped(weight, chosen, torch.tensor([0, 0])).sum() == 0


def _sampled(q, keys, values, sampled):
    return sampled_pages(
        q[None], keys[list(sampled)][None], values[list(sampled)][None], torch.ones(1, len(sampled), dtype=torch.bool),
        sm_scale=SCALE,
    )  # fmt: skip


def _reader(q, keys, values, rest, calls):
    def read_exactly(chosen):
        calls.append(chosen.clone())
        pages = rest[chosen[0]]
        if pages.numel() == 0:
            return torch.full((1, Q_HEADS), float("-inf")), torch.zeros(1, Q_HEADS, DIM)
        lse, out = exact_attention(q, keys[pages].flatten(0, 1), values[pages].flatten(0, 1))
        return lse[None].float(), out[None].float()

    return read_exactly


def test_top_p_one_with_room_for_every_page_reads_the_rest_once_and_exactly():
    q, keys, values = request(10, 5)
    sampled = (2, 5)
    plan, outside, lse_e, out_e, rest = rest_of(q, keys, values, exact_pages={0, 9}, sampled=sampled)
    calls = []
    none = torch.zeros_like(plan.valid)
    outcome = guard_layer(
        lse_e, out_e, outside, _sampled(q, keys, values, sampled), plan.valid, plan.sampled, plan.inclusion,
        torch.tensor([0.1]), none, torch.tensor([1.0]), torch.tensor([100]), _reader(q, keys, values, rest, calls),
    )  # fmt: skip
    _, true = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
    assert len(calls) == 1 and outcome.read[plan.valid].all()
    assert torch.allclose(outcome.combined.output[0].double(), true, atol=1e-5)
    assert float(outcome.combined.relative[0]) == 0.0 and not bool(outcome.flagged[0])


def test_the_read_never_passes_the_cap_nor_touches_a_released_page_and_an_overbound_layer_is_flagged():
    q, keys, values = request(24, 7, key_scale=2.0)
    plan, outside, lse_e, out_e, rest = rest_of(q, keys, values, exact_pages={0, 23}, sampled=(3, 11))
    released = torch.zeros_like(plan.valid)
    released[0, 4:10] = True
    calls = []
    outcome = guard_layer(
        lse_e, out_e, outside, _sampled(q, keys, values, (3, 11)), plan.valid, plan.sampled, plan.inclusion,
        torch.tensor([1e-6]), released, torch.tensor([1.0]), torch.tensor([3]), _reader(q, keys, values, rest, calls),
    )  # fmt: skip
    assert len(calls) == 1 and int(calls[0].sum()) == 3 == int(outcome.read.sum())
    assert not bool((outcome.read & released).any())
    assert torch.equal(outcome.missed, outcome.wanted & released) and bool(outcome.missed.any())
    assert bool(outcome.flagged[0])  # a threshold nothing but an exact output meets


def _adversarial(seed):
    """Keys and values built to break a bound: outlier channels, duplicated keys, a few
    pages holding most of the mass (heavy-tailed), large value norms on light pages (seeds
    0-23, a kind each in turn); from seed 24, values the bound is nearly tight on: every page
    left out holds one value opposite the read part's, the read part holding most of the mass."""
    g = torch.Generator().manual_seed(seed)
    q, keys, values = request(20, seed, key_scale=0.5)
    kind = seed % 4 if seed < 24 else 4
    if kind == 4:
        u = torch.randn(KV_HEADS, DIM, generator=g)
        u = u / u.norm(dim=-1, keepdim=True)
        values[:] = -u * (1 + seed % 3)
        values[[0, 18, 19]] = u  # the pages read exactly (exact_pages below)
        keys[[0, 18, 19]] = q.view(KV_HEADS, GROUP, DIM).mean(1)[None, None] * (1.5 + seed % 4 * 0.5)
    elif kind == 0:
        keys[..., 0] *= 40.0  # an outlier channel
        values[..., 0] *= 30.0
    elif kind == 1:
        keys[:] = keys[3:4]  # every page the same keys
    elif kind == 2:
        heavy = torch.randint(1, 19, (3,), generator=g)
        keys[heavy] = q.view(KV_HEADS, GROUP, DIM).mean(1)[None, None] * 3
    else:
        keys *= torch.exp(torch.randn(20, 1, 1, 1, generator=g) * 2)  # page scales spread over e^±4
        values *= torch.exp(torch.randn(20, 1, 1, 1, generator=g) * 2)
    return q, keys, values


def test_the_deterministic_bound_is_never_exceeded_on_adversarial_keys():
    """40 cases. The bound on the error's norm, ``||o - o_hat|| <= B``, is finite on every one
    and holds, within 1-12 % of the error on most opposed-value cases. The relative bound
    ``B / (||o_hat|| - B)`` (what the threshold is compared to) is finite only where
    ``B < ||o_hat||``: on 18 of the 40, honestly infinite where what is left out can outweigh
    what was read (every outlier-channel and duplicated-key case, most heavy-tailed ones);
    where finite it holds. Mutants caught: ``alpha`` halved, the codes' rounding radius or
    ``||o_E||`` left out of ``estimate.negligible_rest``'s bound."""
    from sgl_kernel_ext import merge_parts

    finite, relative_finite = 0, 0
    for seed in range(40):
        q, keys, values = _adversarial(seed)
        plan, outside, lse_e, out_e, rest = rest_of(q, keys, values, exact_pages={0, 18, 19})
        wanted = wanted_pages(lse_e, outside.page_lse, plan.valid, torch.tensor([0.95]))
        read = capped(outside.page_lse.amax(dim=1), wanted, torch.tensor([seed % 6]))
        lse_r, out_r = _reader(q, keys, values, rest, [])(read)
        lse, out = merge_parts(lse_e, out_e, lse_r, out_r)
        left_out = negligible_rest(lse, out, outside, plan.valid & ~read)
        _, true = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
        error = float((left_out.output[0].double() - true).norm())
        bound = float(left_out.bound[0])
        finite += int(torch.isfinite(left_out.bound[0]))
        assert error <= bound * (1 + 1e-5) + 1e-6, (seed, error, bound)
        if torch.isfinite(left_out.relative[0]):
            relative_finite += 1
            assert error / float(true.norm()) <= float(left_out.relative[0]) * (1 + 1e-5) + 1e-6, seed
    assert finite == 40 and relative_finite == 18


@pytest.mark.parametrize("pi", [0.08, 0.2])
def test_the_sampled_bound_fails_no_more_often_than_its_stated_probability(pi):
    # A diffuse layer: 200 pages, 2 read exactly (their values apart from the rest's),
    # the rest estimated from a Bernoulli(pi) page sample; over many independent draws
    # the exact error exceeds the bound on at most about DELTA of them.
    g = torch.Generator().manual_seed(11)
    num_pages = 200
    q = torch.randn(Q_HEADS, DIM, generator=g)
    keys = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g)
    values = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g) + 0.5
    values[:2] += 3.0
    _, true = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
    plan, outside, lse_e, out_e, rest = rest_of(q, keys, values, exact_pages={0, 1})
    draws, failures, vacuous = 400, 0, 0
    for _ in range(draws):
        cols = torch.nonzero(torch.rand(rest.numel(), generator=g) < pi).flatten()
        members = rest[cols]
        sample = sampled_pages(
            q[None], keys[members][None], values[members][None], torch.ones(1, members.numel(), dtype=torch.bool),
            sm_scale=SCALE,
        )  # fmt: skip
        combined = combine(lse_e, out_e, sample, torch.tensor([pi]), torch.tensor([False]))
        error = float((combined.output[0].double() - true).norm() / true.norm())
        vacuous += int(not torch.isfinite(combined.relative[0]))
        failures += int(error > float(combined.relative[0]))
    print(f"pi {pi}: {failures} of {draws} draws over the bound, {vacuous} vacuous")
    assert vacuous <= DELTA * draws  # a vacuous bound is safe (the guard reads everything), but rare
    assert failures <= 2 * DELTA * draws


def test_a_sample_that_missed_the_heavier_pages_is_caught_by_the_key_codes():
    # 12 of 198 rest pages lean towards the query (values apart from the rest's); a
    # sample of 16 light pages only sees the light ones, so its own variance
    # understates the error. The key codes know every page's estimated mass, and the
    # variance they imply bounds the error (here: the bound is vacuous, so the guard
    # reads on).
    g = torch.Generator().manual_seed(0)
    num_pages = 200
    q = torch.randn(Q_HEADS, DIM, generator=g)
    keys = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g)
    values = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=g) + 1.0
    leaning = torch.arange(2, 14)
    towards = q.view(KV_HEADS, GROUP, DIM).mean(dim=1)
    keys[leaning] += 2.5 * towards / towards.norm(dim=-1, keepdim=True)
    values[leaning] -= 1.5
    _, true = exact_attention(q, keys.flatten(0, 1), values.flatten(0, 1))
    plan, outside, lse_e, out_e, rest = rest_of(q, keys, values, exact_pages={0, 1})
    cols = torch.arange(20, 36)  # rest columns 20.. are light pages
    members = rest[cols]
    sample = sampled_pages(
        q[None], keys[members][None], values[members][None], torch.ones(1, cols.numel(), dtype=torch.bool),
        sm_scale=SCALE,
    )  # fmt: skip
    pi, uncovered = torch.tensor([0.08]), torch.tensor([False])
    alone = combine(lse_e, out_e, sample, pi, uncovered)
    floored = combine(lse_e, out_e, sample, pi, uncovered, (outside.page_lse, outside.page_lse[..., cols]))
    error = float((alone.output[0].double() - true).norm() / true.norm())
    assert torch.equal(alone.output, floored.output)  # the floor widens the bound, nothing else
    assert error > float(alone.relative[0])  # the sample alone: violated
    assert error <= float(floored.relative[0])
    assert float(floored.bound[0]) >= float(alone.bound[0])


def test_the_guard_pool_never_grows_and_a_request_it_cannot_hold_decodes_unguarded():
    g = torch.Generator().manual_seed(0)
    layers, pages = 2, 40
    k_buf = torch.randn(pages * PAGE, KV_HEADS, DIM, generator=g)
    v_buf = torch.randn(pages * PAGE, KV_HEADS, DIM, generator=g)
    slots = torch.arange(PAGE, 30 * PAGE)
    ranges = KeyRanges(layers, KV_HEADS, DIM, capacity_pages=pages)
    pool = GuardPool(layers, KV_HEADS, DIM, page_size=PAGE, capacity_pages=10)
    params = HotSetParams(policy="importance", budget=0.3, window=1, sinks=1, guard_threshold=0.1)
    decoder = HotSetDecoder(params, ranges, pool_pages=pages, page_size=PAGE, threshold=8, guard=pool)
    for _ in range(3):
        decoder.begin_step(["r"], [slots])
        for layer in range(layers):
            decoder.attend(layer, torch.randn(1, Q_HEADS, DIM, generator=g), k_buf, v_buf, sm_scale=SCALE)
        decoder.end_step()
    assert pool.capacity == 10 and pool.pages_in_use == 0 and pool.refused == 1
    assert decoder.totals.guard_refused == 1 and decoder.totals.guard_checks == 0
    assert decoder.tracked["r"].state.params.guard_threshold == 1.0


def test_the_bounds_quantile_is_the_next_smaller_tabled_t_and_the_normals_past_the_table():
    from sgl_importance.hot_set.guard.estimate import T_QUANTILES, Z, quantile

    # count sampled pages: count - 1 degrees of freedom.
    cases = {0: T_QUANTILES[1], 1: T_QUANTILES[1], 2: T_QUANTILES[1], 3: T_QUANTILES[2], 11: T_QUANTILES[10],
             12: T_QUANTILES[10], 13: T_QUANTILES[12], 59: T_QUANTILES[30], 61: T_QUANTILES[60],
             121: T_QUANTILES[120], 122: Z, 5000: Z}  # fmt: skip
    for dtype in (torch.int32, torch.int64):
        got = quantile(torch.tensor(list(cases), dtype=dtype))
        assert got.dtype == torch.float32
        assert got.tolist() == pytest.approx(list(cases.values()), rel=1e-6)
