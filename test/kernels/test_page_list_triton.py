"""The Triton kernel over a step's page lists (``TritonPageListDecode``) against the
batched torch path (``decode_importance_paged``), which the float64 reference pins.

Same contract, same numbers: output, lse and both importance tensors, columns in listed
order, on random plans with pages in any order, partial pages anywhere in a list,
pages listed with no tokens, GQA groups, soft caps, sinks, staged pages (read from
staging buffers) and requests with nothing to read. Runs under TRITON_INTERPRET=1 on
a CPU (conftest.py) in small shapes; with TRITON_INTERPRET=0 on a GPU the same tests
compile the kernel. Fresh random numbers each run (seed in every failure message; pin
one with KERNEL_TEST_SEED).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")

from sgl_kernel_ext import (  # noqa: E402
    TritonPageListDecode,
    decode_importance_paged,
    page_list_slots,
    plan_paged_decode,
)
from support.kernel_device import DEVICE, EMPTY_PAGES_WARN  # noqa: E402

pytestmark = [EMPTY_PAGES_WARN]

# Both float32 (the kernel's fp32 dots are IEEE): rounding only. bf16 inputs: the
# compiled kernel rounds the softmax weights to bf16 for the P.V dot.
OUT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LSE_ATOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
IMP_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}
DIM = 16


def _seed() -> int:
    return int(os.environ.get("KERNEL_TEST_SEED", random.randrange(2**31)))


def make_case(
    counts,
    *,
    q_heads=4,
    kv_heads=2,
    page_size=8,
    dtype=torch.float32,
    seed,
    staged=(),
    empty_pages=0,
    page_zero=(),
):
    """Random pool and page lists.

    Request ``b`` lists ``counts[b]`` distinct pages >= 1 in random order, each with a
    random 1..page_size tokens (partial pages anywhere in the list). ``staged[b]`` of
    them are staging-buffer pages (ids past the pool); ``empty_pages`` entries with no
    tokens are mixed in; requests in ``page_zero`` also list page 0 with tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    staged = list(staged) + [0] * (len(counts) - len(staged))
    num_pages = 1 + sum(counts) + 3
    physical = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    num_extra = sum(staged)
    extra_ids = list(range(num_pages, num_pages + num_extra))
    ids, tokens, indptr = [], [], [0]
    for b, n in enumerate(counts):
        mine, physical = physical[: n - staged[b]], physical[n - staged[b] :]
        mine += [extra_ids.pop() for _ in range(staged[b])]
        if b in page_zero:
            mine.append(0)
        toks = torch.randint(1, page_size + 1, (len(mine),), generator=gen).tolist()
        for _ in range(empty_pages if mine else 0):
            mine.append(int(torch.randint(1, num_pages, (1,), generator=gen)))
            toks.append(0)
        order = torch.randperm(len(mine), generator=gen).tolist()
        ids += [mine[i] for i in order]
        tokens += [toks[i] for i in order]
        indptr.append(len(ids))
    q = (2.0 * torch.randn(len(counts), q_heads, DIM, generator=gen)).to(dtype)
    k = torch.randn(num_pages, page_size, kv_heads, DIM, generator=gen).to(dtype)
    v = torch.randn(num_pages, page_size, kv_heads, DIM, generator=gen).to(dtype)
    ek = torch.randn(max(num_extra, 1), page_size, kv_heads, DIM, generator=gen).to(dtype)
    ev = torch.randn(max(num_extra, 1), page_size, kv_heads, DIM, generator=gen).to(dtype)
    plan = plan_paged_decode(
        torch.tensor(indptr), torch.tensor(ids, dtype=torch.int64), torch.tensor(tokens), page_size=page_size
    )
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    extra = (ek, ev) if num_extra else (None, None)
    return dev(q), dev(k), dev(v), plan, extra


def assert_same(got, want, dtype, seed, what=""):
    msg = f"seed={seed} {what}"
    for name in ("output", "lse", "importance", "importance_per_kv_head"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.float32 and g.shape == w.shape, f"{msg} {name} {g.shape} vs {w.shape}"
        assert torch.isfinite(g).all(), f"{msg} {name}"
    g, w = got.output.cpu().double(), want.output.cpu().double()
    assert ((g - w).norm() / w.norm().clamp_min(1e-30)).item() < OUT_RTOL[dtype], msg
    assert (got.lse.cpu() - want.lse.cpu()).abs().max().item() < LSE_ATOL[dtype], msg
    assert (got.importance.cpu() - want.importance.cpu()).abs().max().item() < IMP_ATOL[dtype], msg
    diff = got.importance_per_kv_head.cpu() - want.importance_per_kv_head.cpu()
    assert diff.abs().max().item() < IMP_ATOL[dtype], msg


def both(q, k, v, plan, extra, num_splits=2, **kw):
    ek, ev = extra
    kernel = TritonPageListDecode(num_splits=num_splits)
    got = kernel(q, k, v, plan, extra_k_pages=ek, extra_v_pages=ev, **kw)
    to_cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    kw = {name: to_cpu(value) if torch.is_tensor(value) else value for name, value in kw.items()}
    want = decode_importance_paged(
        q.cpu(), k.cpu(), v.cpu(), plan, extra_k_pages=to_cpu(ek), extra_v_pages=to_cpu(ev), **kw
    )
    return got, want


def test_the_slot_lists_keep_every_listed_page_in_its_column():
    # Request 0: pages 5 (3 tokens), 2 (no tokens), 7 (4 tokens, partial, last).
    # Request 1: page 9 staged (the pool has 8 pages), then page 3 full.
    # Request 2: nothing.
    plan = plan_paged_decode(
        torch.tensor([0, 3, 5, 5]), torch.tensor([5, 2, 7, 9, 3]), torch.tensor([3, 0, 4, 4, 4]), page_size=4
    )
    lists = page_list_slots(plan, num_pages=8, device="cpu")
    assert lists.kv_indptr.tolist() == [0, 12, 20, 20]
    assert lists.kv_indices[:20].tolist() == [
        20, 21, 22, 0,  0, 0, 0, 0,  28, 29, 30, 31,
        0, 0, 0, 0,  12, 13, 14, 15,
    ]  # fmt: skip
    assert lists.side.tolist() == [[False, False, False], [True, False, False], [False, False, False]]
    assert lists.kernel_live.tolist() == [True, True, False] and lists.staged


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_matches_the_paged_torch_path_on_unordered_partial_pages_and_gqa(q_heads, kv_heads):
    seed = _seed()
    q, k, v, plan, extra = make_case([3, 1, 5], q_heads=q_heads, kv_heads=kv_heads, seed=seed, empty_pages=1)
    got, want = both(q, k, v, plan, extra, sm_scale=DIM**-0.5)
    assert_same(got, want, torch.float32, seed, f"heads={q_heads}/{kv_heads}")


@pytest.mark.parametrize("page_size", [1, 4, 32, 64])
def test_every_page_size_the_kernel_tiles_differently(page_size):
    # Below, equal to and above the kernel's 32-token tile (one page per tile, several
    # per tile, several tiles per page).
    seed = _seed()
    counts = [6, 2] if page_size < 32 else [2, 1]
    q, k, v, plan, extra = make_case(counts, page_size=page_size, seed=seed)
    got, want = both(q, k, v, plan, extra, num_splits=3, sm_scale=DIM**-0.5)
    assert_same(got, want, torch.float32, seed, f"page_size={page_size}")


@pytest.mark.parametrize("logit_cap", [0.0, 2.5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_soft_caps_and_sinks_as_the_torch_path(logit_cap, with_sinks):
    seed = _seed()
    q, k, v, plan, extra = make_case([4, 2], q_heads=6, kv_heads=2, seed=seed)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(seed)).to(DEVICE) if with_sinks else None
    got, want = both(q, k, v, plan, extra, sm_scale=0.5, logit_cap=logit_cap, sinks=sinks)
    assert_same(got, want, torch.float32, seed, f"cap={logit_cap} sinks={with_sinks}")


@pytest.mark.parametrize("with_sinks", [False, True])
def test_staged_pages_are_read_from_the_staging_buffers_and_merged_into_one_softmax(with_sinks):
    # Request 1 reads only staged pages, request 2 none; request 0 mixes both.
    seed = _seed()
    q, k, v, plan, extra = make_case([4, 2, 3], q_heads=6, kv_heads=2, seed=seed, staged=[2, 2, 0], empty_pages=1)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(seed)).to(DEVICE) if with_sinks else None
    got, want = both(q, k, v, plan, extra, sm_scale=0.5, logit_cap=3.0, sinks=sinks)
    assert_same(got, want, torch.float32, seed, f"sinks={with_sinks}")


def test_page_zero_listed_with_tokens_is_attended_like_the_torch_path():
    # The kernel masks page 0 (SGLang's padding page); a plan that lists it with tokens
    # still gets it read, by the torch part.
    seed = _seed()
    q, k, v, plan, extra = make_case([3, 2], seed=seed, page_zero=(1,))
    got, want = both(q, k, v, plan, extra, sm_scale=0.5)
    assert_same(got, want, torch.float32, seed)


def test_requests_with_nothing_to_read_get_zeros():
    seed = _seed()
    q, k, v, _, _ = make_case([2, 2, 2, 2], seed=seed)
    # Request 0 lists nothing, 1 a full page and one without tokens, 2 only a page
    # without tokens, 3 nothing.
    plan = plan_paged_decode(
        torch.tensor([0, 0, 2, 3, 3]), torch.tensor([3, 5, 6]), torch.tensor([8, 0, 0]), page_size=8
    )
    got, want = both(q, k, v, plan, (None, None), sm_scale=0.5, sinks=torch.ones(4, device=DEVICE))
    assert_same(got, want, torch.float32, seed)
    empty = [0, 2, 3]
    assert (got.output[empty] == 0).all() and (got.lse[empty] == 0).all() and (got.importance[empty] == 0).all()


def test_bf16_pools_within_bf16_rounding():
    seed = _seed()
    q, k, v, plan, extra = make_case([5, 3], q_heads=6, kv_heads=2, dtype=torch.bfloat16, seed=seed, staged=[1, 0])
    got, want = both(q, k, v, plan, extra, sm_scale=0.5)
    assert_same(got, want, torch.bfloat16, seed)


def test_one_instance_serves_successive_plans_and_results_outlive_the_next_call():
    seed = _seed()
    kernel = TritonPageListDecode(num_splits=2)
    q, k, v, plan_a, _ = make_case([3, 2], seed=seed)
    _, _, _, plan_b, _ = make_case([1, 4], seed=seed + 1)
    first = kernel(q, k, v, plan_a, sm_scale=0.5)
    kept = first.output.clone(), first.importance.clone()
    second = kernel(q, k, v, plan_b, sm_scale=0.5)
    again = kernel(q, k, v, plan_a, sm_scale=0.5)
    assert torch.equal(first.output, kept[0]) and torch.equal(first.importance, kept[1])
    assert torch.equal(again.output, first.output)
    want = decode_importance_paged(q.cpu(), k.cpu(), v.cpu(), plan_b, sm_scale=0.5)
    assert_same(second, want, torch.float32, seed)


def test_staged_pages_without_staging_buffers_are_refused():
    q, k, v, plan, _ = make_case([3], seed=1, staged=[1])
    with pytest.raises(ValueError, match="staged pages"):
        TritonPageListDecode()(q, k, v, plan, sm_scale=0.5)
