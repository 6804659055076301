"""Exact attention over a fixed page list with a page mask (the guard's reads), as a
specification: the torch path equals float64 attention over exactly the chosen pages'
tokens, and the Triton kernel equals the torch path, on random lists with pages in any
order, GQA groups (a group that is not a power of two), soft caps, several splits, and
rows that choose nothing (lse -inf, output 0). Runs under TRITON_INTERPRET=1 on a CPU
(conftest.py) in small shapes; with TRITON_INTERPRET=0 on a GPU the same tests compile
the kernel."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_ext.masked_pages import HAS_TRITON, masked_page_attention_reference, merge_page_parts, page_parts
from support.kernel_device import DEVICE

DIM, PAGE = 16, 4


def make_case(n, listed, *, q_heads, kv_heads, pool_pages=24, seed=0, share=0.5):
    g = torch.Generator().manual_seed(seed)
    k_pages = torch.randn(pool_pages, PAGE, kv_heads, DIM, generator=g)
    v_pages = torch.randn(pool_pages, PAGE, kv_heads, DIM, generator=g)
    q = torch.randn(n, q_heads, DIM, generator=g) * 2
    pages = torch.stack([torch.randperm(pool_pages - 1, generator=g)[:listed] + 1 for _ in range(n)])
    mask = torch.rand(n, listed, generator=g) < share
    mask[0] = False  # a row that reads nothing
    return q, k_pages, v_pages, pages, mask


def dense(q, k_pages, v_pages, pages, mask, scale, logit_cap):
    """float64 attention of each row over its chosen pages' tokens: (lse [n, Hq], out [n, Hq, D])."""
    n, hq, _ = q.shape
    hkv = k_pages.shape[2]
    lse = torch.full((n, hq), float("-inf"), dtype=torch.float64)
    out = torch.zeros(n, hq, DIM, dtype=torch.float64)
    for i in range(n):
        chosen = pages[i][mask[i]]
        if chosen.numel() == 0:
            continue
        k = k_pages[chosen].flatten(0, 1).double()  # [tokens, Hkv, D]
        v = v_pages[chosen].flatten(0, 1).double()
        qg = q[i].double().view(hkv, hq // hkv, DIM)
        logits = torch.einsum("hgd,thd->hgt", qg, k) * scale
        if logit_cap:
            logits = logit_cap * torch.tanh(logits / logit_cap)
        lse[i] = torch.logsumexp(logits, -1).reshape(hq)
        out[i] = torch.einsum("hgt,thd->hgd", torch.softmax(logits, -1), v).reshape(hq, DIM)
    return lse, out


@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (6, 2)])
def test_the_chosen_pages_merged_from_their_parts_equal_attention_over_their_tokens(q_heads, kv_heads, logit_cap):
    q, k_pages, v_pages, pages, mask = make_case(3, 7, q_heads=q_heads, kv_heads=kv_heads, seed=1)
    scale = DIM**-0.5
    parts = page_parts(q, k_pages[pages], v_pages[pages], sm_scale=scale, logit_cap=logit_cap)
    lse, out = merge_page_parts(parts, mask)
    want_lse, want_out = dense(q, k_pages, v_pages, pages, mask, scale, logit_cap)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.isinf(lse[0]).all() and (out[0] == 0).all()
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite].double(), want_lse[finite], atol=1e-5)
    assert torch.allclose(out.double(), want_out, atol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (6, 2)])
def test_the_triton_kernel_reads_the_chosen_pages_as_the_torch_path_does(q_heads, kv_heads, logit_cap, num_splits):
    from sgl_kernel_ext.masked_pages import masked_page_attention

    q, k_pages, v_pages, pages, mask = make_case(3, 9, q_heads=q_heads, kv_heads=kv_heads, seed=2)
    args = [t.to(DEVICE) for t in (q, k_pages, v_pages, pages, mask)]
    run = dict(sm_scale=DIM**-0.5, logit_cap=logit_cap)
    lse, out = masked_page_attention(*args, num_splits=num_splits, **run)
    want_lse, want_out = masked_page_attention_reference(q, k_pages, v_pages, pages, mask, **run)
    lse, out = lse.cpu(), out.cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-4)
    assert torch.allclose(out, want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_splits_merge_block_by_block_as_one_softmax(monkeypatch):
    """Many splits (short splits keep a program's chain of mask loads short) merged a few at a
    time with a running maximum: the same part as the torch path, empty splits included."""
    from sgl_kernel_ext import masked_pages

    monkeypatch.setattr(masked_pages, "MERGE_BLOCK", 2)
    q, k_pages, v_pages, pages, mask = make_case(3, 9, q_heads=4, kv_heads=2, seed=5)
    run = dict(sm_scale=DIM**-0.5)
    args = [t.to(DEVICE) for t in (q, k_pages, v_pages, pages, mask)]
    lse, out = masked_pages.masked_page_attention(*args, num_splits=7, **run)
    want_lse, want_out = masked_page_attention_reference(q, k_pages, v_pages, pages, mask, **run)
    lse, out = lse.cpu(), out.cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert finite.any() and torch.allclose(lse[finite], want_lse[finite], atol=1e-4)
    assert torch.allclose(out, want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_triton_kernel_never_reads_a_page_it_is_not_given():
    """A masked entry may hold any id, even one past the pool: it is not read."""
    from sgl_kernel_ext.masked_pages import masked_page_attention

    q, k_pages, v_pages, pages, mask = make_case(2, 5, q_heads=4, kv_heads=2, seed=3)
    mask[1] = torch.tensor([True, False, True, False, False])
    wild = torch.where(mask, pages, 10**6)
    args = [t.to(DEVICE) for t in (q, k_pages, v_pages, wild, mask)]
    lse, out = masked_page_attention(*args, sm_scale=DIM**-0.5)
    want_lse, want_out = dense(q, k_pages, v_pages, pages, mask, DIM**-0.5, 0.0)
    assert torch.isinf(lse[0].cpu()).all() and (out[0].cpu() == 0).all()
    assert torch.allclose(lse[1].cpu().double(), want_lse[1], atol=1e-4)
    assert torch.allclose(out.cpu().double(), want_out, atol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (6, 2)])
def test_each_chosen_pages_own_part_is_the_torch_paths_read_from_the_pool(q_heads, kv_heads, logit_cap):
    """masked_page_parts (the guard's sampled pages in a captured step): page_parts of the
    gathered pages where chosen, lse -inf and output 0 elsewhere, no page read off the mask."""
    from sgl_kernel_ext.masked_pages import masked_page_parts

    q, k_pages, v_pages, pages, mask = make_case(3, 7, q_heads=q_heads, kv_heads=kv_heads, seed=4)
    run = dict(sm_scale=DIM**-0.5, logit_cap=logit_cap)
    wild = torch.where(mask, pages, 10**6)  # an unchosen entry may hold any id
    got = masked_page_parts(*(t.to(DEVICE) for t in (q, k_pages, v_pages, wild, mask)), **run)
    want = page_parts(q, k_pages[pages], v_pages[pages], **run)
    lse, out = got.lse.cpu(), got.output.cpu()
    chosen = mask[:, None, :].expand_as(lse)
    assert torch.isneginf(lse[~chosen]).all() and (out[~chosen] == 0).all()
    assert torch.allclose(lse[chosen], want.lse[chosen], atol=1e-4)
    assert torch.allclose(out[chosen], want.output[chosen], rtol=1e-5, atol=1e-5)
