"""The batched page-list decode (``decode_importance_paged``) against the float64 reference.

Every test runs twice: on the torch path and on the C kernel (``native.py``; skipped
where no C compiler builds it). No Triton. Each case lays out random K/V as a pool of pages, gives every
request a page list (random physical pages, in any order), and checks output, lse and
both importance tensors against ``decode_importance_reference`` run on the same
tokens' slots. Fresh random numbers each run (seed in every failure message; pin one
with KERNEL_TEST_SEED).
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from sgl_kernel_ext import (
    PagedDecodeWorkspace,
    decode_importance_paged,
    decode_importance_reference,
    native,
    plan_from_slots,
    plan_paged_decode,
)

# float32 arithmetic against a float64 reference: rounding only.
OUT_RTOL = 2e-6
LSE_ATOL = 2e-5
IMP_ATOL = 1e-6
HEADS = [(4, 4), (9, 3), (8, 2), (32, 1)]  # MHA, SmolLM2, Llama's 4:1, MQA


_path = {"native": False}


@pytest.fixture(autouse=True, params=["torch", "native"])
def decode_path(request):
    """Which implementation ``fast`` runs: the torch path or the C kernel."""
    if request.param == "native" and native.library() is None:
        pytest.skip("the C decode kernel could not be built here (no C compiler?)")
    _path["native"] = request.param == "native"
    yield request.param
    _path["native"] = False


def _seed() -> int:
    return int(os.environ.get("KERNEL_TEST_SEED", random.randrange(2**31)))


def make_case(
    counts,
    *,
    q_heads=9,
    kv_heads=3,
    head_dim=64,
    page_size=16,
    dtype=torch.float32,
    seed,
    partial=True,
    spare_pages=5,
):
    """Random pool and page lists: request ``b`` lists ``counts[b]`` distinct pages >= 1 in
    random order; with ``partial``, its last page holds a random 1..page_size tokens."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 1 + sum(counts) + spare_pages
    physical = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    ids, tokens = [], []
    for n in counts:
        mine, physical = physical[:n], physical[n:]
        ids += mine
        toks = [page_size] * n
        if partial and n:
            toks[-1] = int(torch.randint(1, page_size + 1, (1,), generator=gen))
        tokens += toks
    page_indptr = torch.zeros(len(counts) + 1, dtype=torch.int64)
    page_indptr[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    q = (2.0 * torch.randn(len(counts), q_heads, head_dim, generator=gen)).to(dtype)
    k = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, page_indptr, torch.tensor(ids, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64)


def slots_of(page_indptr, page_ids, page_tokens, page_size):
    """The reference's view of the same lists: each listed page's valid slots, in order."""
    indices, lengths = [], []
    bounds = page_indptr.tolist()
    for b in range(len(bounds) - 1):
        row = []
        for p, n in zip(page_ids[bounds[b] : bounds[b + 1]].tolist(), page_tokens[bounds[b] : bounds[b + 1]].tolist()):
            row += [p * page_size + t for t in range(n)]
        indices += row
        lengths.append(len(row))
    kv_indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return kv_indptr, torch.tensor(indices, dtype=torch.int64)


def reference_of(q, k, v, page_indptr, page_ids, page_tokens, page_size, max_pages, **kw):
    kv_indptr, kv_indices = slots_of(page_indptr, page_ids, page_tokens, page_size)
    return decode_importance_reference(
        q.double(),
        k.double(),
        v.double(),
        kv_indptr,
        kv_indices,
        page_size=page_size,
        max_pages=max_pages,
        mask_page0=False,
        compute_dtype=torch.float64,
        **kw,
    )


def fast(q, k, v, plan, page_size, **kw):
    heads, dim = k.shape[1], k.shape[2]
    # The C kernel takes staging pages of the pool's dtype only; others go the torch way.
    extra = kw.get("extra_k_pages")
    if extra is None or extra.dtype == k.dtype:
        kw.setdefault("native", _path["native"])
    return decode_importance_paged(q, k.view(-1, page_size, heads, dim), v.view(-1, page_size, heads, dim), plan, **kw)


def assert_close(got, ref, seed, what=""):
    msg = f"seed={seed} {what}"
    assert got.output.dtype == torch.float32 and got.importance.dtype == torch.float32, msg
    assert torch.isfinite(got.output).all() and torch.isfinite(got.importance).all(), msg
    err = (got.output.double() - ref.output).norm() / ref.output.norm().clamp_min(1e-30)
    assert err.item() < OUT_RTOL, msg
    assert (got.lse.double() - ref.lse.double()).abs().max().item() < LSE_ATOL, msg
    assert got.importance.shape == ref.importance.shape, msg
    assert (got.importance.double() - ref.importance.double()).abs().max().item() < IMP_ATOL, msg
    diff = got.importance_per_kv_head.double() - ref.importance_per_kv_head.double()
    assert diff.abs().max().item() < IMP_ATOL, msg


@pytest.mark.parametrize("q_heads,kv_heads", HEADS)
@pytest.mark.parametrize("counts", [[3], [1, 7, 2, 5], [4, 1, 9, 3, 6, 2, 8, 5]])
def test_matches_the_reference_for_ragged_batches_and_gqa_groups(q_heads, kv_heads, counts):
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case(counts, q_heads=q_heads, kv_heads=kv_heads, seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    ref = reference_of(q, k, v, indptr, ids, toks, 16, plan.max_pages)
    assert_close(fast(q, k, v, plan, 16), ref, seed, f"counts={counts}")


@pytest.mark.parametrize("chunk_pages", [None, 0, 1, 3, 64])
def test_chunking_the_page_lists_does_not_change_the_result(chunk_pages):
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([5, 11, 1, 8], seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    ref = reference_of(q, k, v, indptr, ids, toks, 16, plan.max_pages)
    assert_close(fast(q, k, v, plan, 16, chunk_pages=chunk_pages), ref, seed, f"chunk_pages={chunk_pages}")


@pytest.mark.parametrize("page_size", [1, 4, 16, 32])
def test_every_page_size_and_a_partial_last_page(page_size):
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([2, 6, 3], page_size=page_size, seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=page_size)
    ref = reference_of(q, k, v, indptr, ids, toks, page_size, plan.max_pages)
    assert_close(fast(q, k, v, plan, page_size, chunk_pages=2), ref, seed)


@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_pages_share_softmax_blocks_and_still_match_the_reference(page_size, dtype):
    # The C kernel takes small pages whole into blocks of up to 32 tokens (10 pages of 3, 8
    # of 4...); a bf16 pool's pages are converted into one block-wide tile.
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([97, 40, 5], page_size=page_size, dtype=dtype, seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=page_size)
    ref = reference_of(q.float(), k.float(), v.float(), indptr, ids, toks, page_size, plan.max_pages)
    assert_close(fast(q, k, v, plan, page_size), ref, seed)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_that_follow_one_another_in_the_pool_are_read_as_one_run(page_size, dtype):
    # A request's consecutive slots (1-token pages prefilled together) are one run of rows
    # in the C kernel; a page with fewer tokens than a page holds ends its run even where
    # the next listed page is the next one in the pool.
    seed = _seed()
    q, k, v, _, _, _ = make_case([60, 45], page_size=page_size, dtype=dtype, seed=seed, partial=False)
    ids = torch.cat([torch.arange(1, 61), torch.arange(61, 106)])
    toks = torch.full((105,), page_size, dtype=torch.int64)
    toks[20] = max(page_size // 2, 1) if page_size > 1 else 0  # mid-request: short, or skipped
    indptr = torch.tensor([0, 60, 105])
    plan = plan_paged_decode(indptr, ids, toks, page_size=page_size)
    ref = reference_of(q.float(), k.float(), v.float(), indptr, ids, toks, page_size, plan.max_pages)
    got = fast(q, k, v, plan, page_size)
    err = (got.output.double() - ref.output).norm() / ref.output.norm()
    assert err.item() < OUT_RTOL, f"seed={seed}"
    assert (got.lse.double() - ref.lse.double()).abs().max().item() < LSE_ATOL, f"seed={seed}"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_where_the_pages_lie_does_not_change_a_bit(page_size, dtype, head_dim):
    # The same pages read from one run of slots and scattered one by one (a prefix read back
    # from the host lands wherever the allocator has room): the same output, lse and masses
    # bit for bit, or tiering would change answers. The kernel once summed a run's tokens
    # otherwise than single pages' (off in the last bits on an AVX-512 build).
    seed = _seed()
    n = 48 // page_size + 1
    q, k, v, _, _, _ = make_case([2 * n], head_dim=head_dim, page_size=page_size, dtype=dtype, seed=seed)
    together, scattered = torch.arange(1, n + 1), torch.arange(n + 1, 2 * n + 1).flip(0)  # [2n .. n+1]
    k.view(-1, page_size, *k.shape[1:])[scattered] = k.view(-1, page_size, *k.shape[1:])[together]
    v.view(-1, page_size, *v.shape[1:])[scattered] = v.view(-1, page_size, *v.shape[1:])[together]
    toks = torch.full((n,), page_size, dtype=torch.int64)
    got = []
    for ids in (together, scattered):  # one run; descending slots, so never two pages in a run
        plan = plan_paged_decode(torch.tensor([0, n]), ids, toks, page_size=page_size)
        got.append(fast(q, k, v, plan, page_size))
    for name in ("output", "lse", "importance"):
        assert torch.equal(getattr(got[0], name), getattr(got[1], name)), f"seed={seed} {name}"


@pytest.mark.parametrize("page_size", [1, 16])
def test_importance_off_gives_the_same_output_and_lse_and_no_masses(page_size):
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([60, 9], page_size=page_size, dtype=torch.bfloat16, seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=page_size)
    on, off = fast(q, k, v, plan, page_size), fast(q, k, v, plan, page_size, importance=False)
    assert off.importance is None and off.importance_per_kv_head is None
    torch.testing.assert_close(off.output, on.output, rtol=1e-6, atol=1e-7, msg=f"seed={seed}")
    torch.testing.assert_close(off.lse, on.lse, rtol=1e-6, atol=1e-6, msg=f"seed={seed}")


def test_the_build_without_importance_decodes_as_importance_off(decode_path):
    # benchmark/kernel/bench_cpu_decode.py times importance off against this build.
    if decode_path != "native":
        pytest.skip("a build of the C kernel")
    from sgl_kernel_ext.paged import _decode_native, _native_inputs

    bare = native.library(("SGL_PAGED_DECODE_NO_IMPORTANCE",))
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([70, 3], page_size=1, seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=1)
    ws = PagedDecodeWorkspace()
    k_pages, v_pages = k.view(-1, 1, *k.shape[1:]), v.view(-1, 1, *v.shape[1:])
    with_masses = _native_inputs(bare, q, k_pages, v_pages, None, None, plan, ws, True)
    with pytest.raises(RuntimeError, match="returned -1"):  # it has no masses to give
        _decode_native(bare, with_masses, q, k_pages, v_pages, plan, 64**-0.5, 0.0, None, None, None, True)
    inputs = _native_inputs(bare, q, k_pages, v_pages, None, None, plan, ws, False)
    got = _decode_native(bare, inputs, q, k_pages, v_pages, plan, 64**-0.5, 0.0, None, None, None, False)
    off = fast(q, k, v, plan, 1, importance=False)
    torch.testing.assert_close(got.output, off.output, rtol=1e-6, atol=1e-7, msg=f"seed={seed}")


def test_the_c_kernel_refuses_split_buffers_that_do_not_cover_the_longest_list(decode_path):
    # The split buffers are sized by the count Python passes; the kernel indexes them by it
    # and refuses a count too small for the longest list rather than write past them.
    if decode_path != "native":
        pytest.skip("the C kernel's check")
    from sgl_kernel_ext.paged import _decode_native, _native_inputs

    lib = native.library()
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([150, 7], page_size=4, seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=4)
    k_pages, v_pages = k.view(-1, 4, *k.shape[1:]), v.view(-1, 4, *v.shape[1:])
    inputs = _native_inputs(lib, q, k_pages, v_pages, None, None, plan, PagedDecodeWorkspace(), True)
    assert inputs.splits * inputs.split_pages >= plan.max_pages > inputs.split_pages  # two splits of 64 pages
    short = inputs._replace(splits=inputs.splits - 1)
    with pytest.raises(RuntimeError, match="returned -1"):
        _decode_native(lib, short, q, k_pages, v_pages, plan, 64**-0.5, 0.0, None, None, None, True)
    got = _decode_native(lib, inputs, q, k_pages, v_pages, plan, 64**-0.5, 0.0, None, None, None, True)
    assert_close(got, reference_of(q, k, v, indptr, ids, toks, 4, plan.max_pages), seed)


def test_one_plan_serves_every_layer_and_sees_its_lists_changed_in_place():
    # The C kernel keeps a plan's inputs from its first call (a step's first layer).
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([12, 5], page_size=4, seed=seed, partial=False)
    plan = plan_paged_decode(indptr, ids, toks, page_size=4)
    plan = dataclasses.replace(plan, tokens=plan.tokens.int())  # the kernel reads a converted copy
    ws = PagedDecodeWorkspace()
    for layer in range(2):  # another layer: other K, V and queries on the same plan
        q2, k2, v2 = q + layer, k * (1 + layer), v - layer
        fresh = fast(q2, k2, v2, plan_paged_decode(indptr, ids, toks, page_size=4), 4)
        torch.testing.assert_close(fast(q2, k2, v2, plan, 4, workspace=ws).output, fresh.output, msg=f"seed={seed}")
    changed = toks.clone()
    changed[3] = 0
    other = plan_paged_decode(indptr, ids, changed, page_size=4)
    for name in ("table", "tokens", "bias", "live"):  # as a captured step rewrites its plan
        getattr(plan, name).copy_(getattr(other, name))
    fresh = fast(q, k, v, other, 4)
    torch.testing.assert_close(fast(q, k, v, plan, 4, workspace=ws).output, fresh.output, msg=f"seed={seed}")


def test_logit_cap_and_scale_match_the_reference():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([4, 9, 2], seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    ref = reference_of(q, k, v, indptr, ids, toks, 16, plan.max_pages, logit_cap=5.0, sm_scale=0.3)
    assert_close(fast(q, k, v, plan, 16, logit_cap=5.0, sm_scale=0.3), ref, seed)


def test_sinks_count_in_the_denominator_and_masses_sum_to_one_minus_the_sink_share():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([3, 7, 1], seed=seed)
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(seed)) + 4.0
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    ref = reference_of(q, k, v, indptr, ids, toks, 16, plan.max_pages, sinks=sinks)
    got = fast(q, k, v, plan, 16, sinks=sinks)
    assert_close(got, ref, seed)
    # Sink probability per (request, head) from the lse, then averaged over heads.
    sink_share = torch.exp(sinks.double()[None, :] - got.lse.double()).mean(dim=1)
    sums = got.importance.double().sum(dim=1)
    assert torch.allclose(sums, 1.0 - sink_share, atol=1e-5), f"seed={seed}"
    assert (sink_share > 0.01).all(), f"seed={seed}: the test's sinks should carry mass"


def test_without_sinks_each_request_s_masses_sum_to_one():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([6, 2, 13, 1], seed=seed)
    got = fast(q, k, v, plan_paged_decode(indptr, ids, toks, page_size=16), 16, chunk_pages=4)
    assert torch.allclose(got.importance.sum(dim=1), torch.ones(4), atol=1e-5), f"seed={seed}"
    assert torch.allclose(got.importance_per_kv_head.sum(dim=1), torch.ones(4, 3), atol=1e-5), f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_pool_is_read_exactly_in_float32(dtype):
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([4, 10, 3], dtype=dtype, seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    # The reference sees the same rounded numbers, in float64.
    ref = reference_of(q, k, v, indptr, ids, toks, 16, plan.max_pages)
    assert_close(fast(q, k, v, plan, 16, chunk_pages=3), ref, seed, str(dtype))


def test_importance_columns_follow_the_listed_order_not_the_physical_one():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([6], seed=seed, partial=False)
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    got = fast(q, k, v, plan, 16)
    order = torch.randperm(6, generator=torch.Generator().manual_seed(seed))
    shuffled = fast(q, k, v, plan_paged_decode(indptr, ids[order], toks[order], page_size=16), 16)
    assert torch.allclose(shuffled.importance[0], got.importance[0, order], atol=1e-7), f"seed={seed}"
    assert torch.allclose(shuffled.output, got.output, rtol=1e-5, atol=1e-6), f"seed={seed}"


def test_pages_past_the_pool_are_read_from_the_staging_buffers():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([5, 8, 3], seed=seed)
    num_pages = k.shape[0] // 16
    gen = torch.Generator().manual_seed(seed + 1)
    # Move every other listed page into staging buffers; the pool keeps garbage there.
    staged = torch.arange(ids.numel()) % 2 == 1
    extra_k = torch.randn(int(staged.sum()), 16, 3, 64, generator=gen)
    extra_v = torch.randn(int(staged.sum()), 16, 3, 64, generator=gen)
    moved = ids.clone()
    moved[staged] = num_pages + torch.arange(int(staged.sum()))
    whole_k = torch.cat([k, extra_k.view(-1, 3, 64)])
    whole_v = torch.cat([v, extra_v.view(-1, 3, 64)])
    plan = plan_paged_decode(indptr, moved, toks, page_size=16)
    ref = reference_of(q, whole_k, whole_v, indptr, moved, toks, 16, plan.max_pages)
    got = fast(q, k, v, plan, 16, extra_k_pages=extra_k, extra_v_pages=extra_v, chunk_pages=3)
    assert_close(got, ref, seed)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staging_pages_read_in_place_from_a_host_pools_layer_view(layout, dtype):
    """A host pool's layer as staging pages, no copy: SGLang's ``page_first`` puts a token's
    layers together (tokens of a layer lie 3 rows apart here), ``page_first_direct`` a
    page's layers together (pages lie apart, tokens adjacent). Bit for bit what the same
    pages give copied out contiguously."""
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([5, 8, 3], dtype=dtype, seed=seed)
    num_pages, layers, layer = k.shape[0] // 16, 3, 1
    gen = torch.Generator().manual_seed(seed + 1)
    host = ids.numel()  # a host page for every listed one
    if layout == "page_first":  # [tokens, layers, heads, dim]
        host_k, host_v = (torch.randn(host * 16, layers, 3, 64, generator=gen).to(dtype) for _ in range(2))
        view_k, view_v = (t[:, layer].view(host, 16, 3, 64) for t in (host_k, host_v))
    else:  # [pages, layers, page_size, heads, dim]
        host_k, host_v = (torch.randn(host, layers, 16, 3, 64, generator=gen).to(dtype) for _ in range(2))
        view_k, view_v = host_k[:, layer], host_v[:, layer]
    assert not view_k.is_contiguous()
    staged = torch.arange(ids.numel()) % 2 == 1
    moved = ids.clone()
    moved[staged] = num_pages + torch.randperm(host, generator=gen)[: int(staged.sum())]
    plan = plan_paged_decode(indptr, moved, toks, page_size=16)
    got = fast(q, k, v, plan, 16, extra_k_pages=view_k, extra_v_pages=view_v)
    want = fast(q, k, v, plan, 16, extra_k_pages=view_k.contiguous(), extra_v_pages=view_v.contiguous())
    assert torch.equal(got.output, want.output) and torch.equal(got.importance, want.importance), f"seed={seed}"
    whole_k, whole_v = (torch.cat([p, x.reshape(-1, 3, 64)]) for p, x in ((k, view_k), (v, view_v)))
    assert_close(got, reference_of(q, whole_k, whole_v, indptr, moved, toks, 16, plan.max_pages), seed)


def test_staging_buffers_of_another_dtype_are_converted_page_by_page():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([4, 6], dtype=torch.bfloat16, seed=seed)
    num_pages = k.shape[0] // 16
    extra_k = torch.randn(2, 16, 3, 64).to(torch.bfloat16)
    extra_v = torch.randn(2, 16, 3, 64).to(torch.bfloat16)
    moved = ids.clone()
    moved[[1, 7]] = torch.tensor([num_pages + 1, num_pages])
    plan = plan_paged_decode(indptr, moved, toks, page_size=16)
    ref = reference_of(
        q, torch.cat([k, extra_k.view(-1, 3, 64)]), torch.cat([v, extra_v.view(-1, 3, 64)]), indptr, moved, toks, 16,
        plan.max_pages,
    )  # fmt: skip
    assert_close(fast(q, k, v, plan, 16, extra_k_pages=extra_k, extra_v_pages=extra_v), ref, seed)


def test_empty_requests_give_zero_output_lse_and_importance():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([0, 4, 0, 2], seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    got = fast(q, k, v, plan, 16)
    for b in (0, 2):
        assert (got.output[b] == 0).all() and (got.lse[b] == 0).all() and (got.importance[b] == 0).all()
    ref = reference_of(q, k, v, indptr, ids, toks, 16, plan.max_pages)
    assert_close(got, ref, seed)


def test_a_batch_with_no_page_at_all():
    q = torch.randn(2, 9, 64)
    k = torch.randn(4 * 16, 3, 64)
    plan = plan_paged_decode(torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                             torch.zeros(0, dtype=torch.int64), page_size=16)  # fmt: skip
    got = fast(q, k, k, plan, 16)
    assert got.output.shape == (2, 9, 64) and (got.output == 0).all() and (got.importance == 0).all()


def test_a_page_listed_with_zero_tokens_is_skipped_and_gets_zero_importance():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([5], seed=seed, partial=False)
    toks[2] = 0
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    got = fast(q, k, v, plan, 16)
    assert got.importance[0, 2] == 0
    keep = torch.tensor([0, 1, 3, 4])
    ref = reference_of(
        q, k, v, torch.tensor([0, 4]), ids[keep], toks[keep], 16, 4
    )  # the same request without that page
    assert torch.allclose(got.importance[0, keep].double(), ref.importance[0].double(), atol=IMP_ATOL)
    assert ((got.output.double() - ref.output).abs().max() < 1e-5).item()


def test_a_reused_workspace_gives_the_same_numbers_as_a_fresh_one():
    seed = _seed()
    workspace = PagedDecodeWorkspace()
    for counts in ([9, 2], [1], [3, 12, 4, 4]):  # grows, shrinks, grows again
        q, k, v, indptr, ids, toks = make_case(counts, seed=seed)
        plan = plan_paged_decode(indptr, ids, toks, page_size=16)
        a = fast(q, k, v, plan, 16, workspace=workspace, chunk_pages=5)
        b = fast(q, k, v, plan, 16, chunk_pages=5)
        assert torch.equal(a.output, b.output) and torch.equal(a.importance, b.importance), f"seed={seed}"


# ------------------------------------------------------------------ from SGLang's slot rows


def slot_rows(lengths, page_size, *, first_page_zero=(), seed):
    """A req_to_token table as SGLang's paged allocator fills it (rows of a bigger pool)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lengths]
    num_pages = 1 + sum(pages) + 3
    physical = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    width = max(pages + [1]) * page_size + 2 * page_size
    table = torch.zeros(len(lengths) + 2, width, dtype=torch.int32)
    rows = torch.randperm(len(lengths) + 2, generator=gen)[: len(lengths)]
    for b, (n, npg) in enumerate(zip(lengths, pages)):
        mine, physical = physical[:npg], physical[npg:]
        if b in first_page_zero and npg:
            mine[0] = 0
        slots = (torch.tensor(mine, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        table[rows[b], :n] = slots[:n].to(torch.int32)
    return table, rows, torch.tensor(lengths), num_pages


def test_plan_from_slots_lists_each_request_s_pages_in_sequence_order():
    seed = _seed()
    table, rows, lens, _ = slot_rows([1, 33, 16, 0, 70], 16, seed=seed)
    plan = plan_from_slots(table, rows, lens, page_size=16)
    assert plan.page_indptr.tolist() == [0, 1, 4, 5, 5, 10]
    for b, n in enumerate(lens.tolist()):
        lo, hi = plan.page_indptr[b], plan.page_indptr[b + 1]
        expect = table[rows[b], :n:16].long() // 16
        assert plan.page_ids[lo:hi].tolist() == expect.tolist()
        expect_tokens = [min(16, n - 16 * j) for j in range(hi - lo)]
        assert plan.page_tokens[lo:hi].tolist() == expect_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_step_from_slot_rows_matches_the_reference_on_the_same_slots(dtype):
    seed = _seed()
    lengths = [1, 37, 150, 16, 64]
    table, rows, lens, num_pages = slot_rows(lengths, 16, first_page_zero=(2,), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q = (2.0 * torch.randn(len(lengths), 9, 64, generator=gen)).to(dtype)
    k = torch.randn(num_pages * 16, 3, 64, generator=gen).to(dtype)
    v = torch.randn(num_pages * 16, 3, 64, generator=gen).to(dtype)
    kv_indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    kv_indptr[1:] = lens.cumsum(0)
    kv_indices = torch.cat([table[r, :n].long() for r, n in zip(rows.tolist(), lengths)])
    # The reference masks SGLang's padding page 0 (request 2's first page here).
    ref = decode_importance_reference(
        q.double(), k.double(), v.double(), kv_indptr, kv_indices, page_size=16, compute_dtype=torch.float64
    )
    plan = plan_from_slots(table, rows, lens, page_size=16)
    got = fast(q, k, v, plan, 16, workspace=PagedDecodeWorkspace(), chunk_pages=3)
    assert_close(got, ref, seed)
    assert got.importance[2, 0] == 0


def test_a_listed_page_outside_the_pool_is_an_error_not_a_read_of_other_memory():
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([3, 2], seed=seed)
    bad = ids.clone()
    bad[1] = k.shape[0] // 16 + 5
    plan = plan_paged_decode(indptr, bad, toks, page_size=16)
    with pytest.raises((IndexError, RuntimeError)):
        fast(q, k, v, plan, 16)


def test_the_kernel_path_and_the_torch_path_agree_on_a_long_bf16_context(decode_path):
    # Many pages per request and several splits per (request, KV head) in the C kernel.
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([300, 41], dtype=torch.bfloat16, seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    got = fast(q, k, v, plan, 16)
    ref = reference_of(q, k, v, indptr, ids, toks, 16, plan.max_pages)
    assert_close(got, ref, seed)


def test_without_a_compiler_the_kernel_is_not_built_and_the_torch_path_runs(monkeypatch, decode_path):
    if decode_path != "torch":
        pytest.skip("one run is enough")
    monkeypatch.setenv("CC", "no-such-compiler-sgl")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_default", [])
    assert native.library() is None
    seed = _seed()
    q, k, v, indptr, ids, toks = make_case([4], seed=seed)
    plan = plan_paged_decode(indptr, ids, toks, page_size=16)
    with pytest.raises(RuntimeError, match="not built"):
        fast(q, k, v, plan, 16, native=True)
    assert_close(
        fast(q, k, v, plan, 16, native=None), reference_of(q, k, v, indptr, ids, toks, 16, plan.max_pages), seed
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_decodes_a_request_to_the_same_bits_alone_and_beside_longer_ones(decode_path, dtype):
    # A request's splits are fixed runs of its own list: beside a longer request (more
    # splits, a longer table) and on any thread count its sums run in the same order.
    # (The torch path pads to the batch's longest list: close, not bitwise; its fallback role.)
    if decode_path != "native":
        pytest.skip("the C kernel's property")
    seed = _seed()
    page_size = 4  # 64 pages a split: the alone request spans three
    q, k, v, indptr, ids, toks = make_case([150, 230, 7], page_size=page_size, dtype=dtype, seed=seed)
    together = fast(q, k, v, plan_paged_decode(indptr, ids, toks, page_size=page_size), page_size)
    first = slice(0, 150)
    alone_plan = plan_paged_decode(indptr[:2], ids[first], toks[first], page_size=page_size)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            alone = fast(q[:1], k, v, alone_plan, page_size)
            msg = f"seed={seed} threads={n}"
            assert torch.equal(alone.output[0], together.output[0]), msg
            assert torch.equal(alone.lse[0], together.lse[0]), msg
            assert torch.equal(alone.importance[0], together.importance[0, :150]), msg
    finally:
        torch.set_num_threads(threads)
