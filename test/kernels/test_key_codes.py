"""The guard's page pass over 4-bit key codes: the C kernel against the torch reference,
and the reference against the keys the codes stand for."""

from __future__ import annotations

import pytest
import torch

from sgl_importance.hot_set.guard.key_codes import quantise, steps
from sgl_kernel_ext import key_code_pages, key_code_pages_torch, native

KV, G, D, PAGE = 3, 3, 64, 16


def coded_pool(num_pages: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_pages, PAGE, KV, D, generator=g) * torch.linspace(0.2, 6.0, D)
    low, high = keys.amin(dim=1), keys.amax(dim=1)
    codes = torch.zeros(KV, num_pages + 1, PAGE, D // 2, dtype=torch.uint8)
    codes[:, 1:] = quantise(keys, low, high)
    return keys, low, high, codes


@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
def test_the_c_kernel_matches_the_torch_reference(logit_cap):
    if native.library() is None:
        pytest.skip("no C compiler here")
    keys, low, high, codes = coded_pool(30, 0)
    g = torch.Generator().manual_seed(1)
    n, listed = 2, 12
    ids = torch.randint(1, 31, (n, listed), generator=g)
    valid = torch.rand(n, listed, generator=g) > 0.2
    q = torch.randn(KV, n, G, D, generator=g) * 0.3
    lo, st = low[ids - 1].float(), steps(low, high)[ids - 1]
    args = (q, codes, ids, lo, st, valid)
    lse_c, err_c = key_code_pages(*args, logit_cap=logit_cap, margin=2.0**-18, use_native=True)
    lse_t, err_t = key_code_pages_torch(*args, logit_cap=logit_cap, margin=2.0**-18)
    assert torch.equal(torch.isinf(lse_c), torch.isinf(lse_t))
    finite = torch.isfinite(lse_t)
    assert torch.allclose(lse_c[finite], lse_t[finite], rtol=1e-5, atol=1e-4)
    assert torch.allclose(err_c, err_t, rtol=1e-5, atol=1e-6)


def test_the_exact_page_mass_lies_within_the_estimate_and_its_error():
    keys, low, high, codes = coded_pool(8, 2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(KV, 1, G, D, generator=g) * 0.3
    ids = torch.arange(1, 9)[None]
    lse, err = key_code_pages(
        q, codes, ids, low.float()[None], steps(low, high)[None], torch.ones(1, 8, dtype=torch.bool)
    )
    exact = torch.logsumexp(torch.einsum("hgd,pthd->hpgt", q[:, 0].double(), keys.double()), dim=-1)  # [KV, P, G]
    assert (exact <= lse[:, 0].double() + err[:, 0].double() + 1e-5).all()
    assert (exact >= lse[:, 0].double() - err[:, 0].double() - 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_kernel_reads_code_rows_in_place_in_the_kv_pool(dtype):
    """Codes kept in borrowed KV pages (a strided view over a layer's K and V bytes): the C
    kernel reads them where they are, as the torch reference reads the same rows."""
    if native.library() is None:
        pytest.skip("no C compiler here")
    from sgl_importance.hot_set.guard.key_codes import GuardPool
    from sgl_importance.hot_set.pages.rows import LocalPages

    pages = 6
    fused = torch.zeros(2, pages * PAGE, KV, D, dtype=dtype)
    pool = GuardPool.over_pool([fused[0]], [fused[1]], PAGE, LocalPages(1, pages - 1))
    keys, low, high, _ = coded_pool(20, 4)
    rows = pool.alloc(20)
    pool.write(0, rows, keys, low, high, keys)
    assert not pool.codes[0].is_contiguous()
    g = torch.Generator().manual_seed(6)
    n, listed = 3, 9
    pick = torch.randint(0, 20, (n, listed), generator=g)
    valid = torch.rand(n, listed, generator=g) > 0.2
    q = torch.randn(KV, n, G, D, generator=g) * 0.3
    lo, st = low[pick].float(), steps(low, high)[pick]
    args = (q, pool.codes[0], rows[pick], lo, st, valid)
    lse_c, err_c = key_code_pages(*args, margin=2.0**-18, use_native=True)
    lse_t, err_t = key_code_pages_torch(q, coded_pool(20, 4)[3][:, 1:], pick, lo, st, valid, margin=2.0**-18)
    finite = torch.isfinite(lse_t)
    assert finite.any() and torch.equal(torch.isinf(lse_c), torch.isinf(lse_t))
    assert torch.allclose(lse_c[finite], lse_t[finite], rtol=1e-5, atol=1e-4)
    assert torch.allclose(err_c, err_t, rtol=1e-5, atol=1e-6)
