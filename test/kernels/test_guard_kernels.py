"""The guard's Triton kernels against their torch references: the key codes' page pass
(``key_code_pages_triton`` vs ``key_code_pages_torch``) and the merge of two softmax parts
(``merge_parts_triton`` vs ``merge_parts_torch``).

Runs under TRITON_INTERPRET=1 on a CPU (conftest.py) in small shapes: GQA groups 1 and
4, page sizes 4 and 16 (and one the kernel tiles twice), D 64 and 128 (and one whose
half is no power of two), invalid entries, soft caps on and off, empty (-inf) parts.
With TRITON_INTERPRET=0 on a GPU the same tests compile the kernels, and the tests
marked for CUDA check that the dispatchers pick them. Fresh random numbers each run
(seed in every failure message; pin one with KERNEL_TEST_SEED).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton guard kernels cannot run")

from sgl_importance.hot_set.key_codes import ROUNDING_MARGIN, quantise, steps  # noqa: E402
from sgl_kernel_ext import (  # noqa: E402
    key_code_pages,
    key_code_pages_torch,
    key_code_pages_triton,
    merge_parts,
    merge_parts_torch,
    merge_parts_triton,
)
from support.kernel_device import DEVICE  # noqa: E402

LSE_ATOL, LSE_RTOL = 1e-4, 1e-5
ERR_ATOL, ERR_RTOL = 1e-6, 1e-5
OUT_ATOL = 1e-5
on_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="the dispatch to Triton happens for CUDA tensors only")


def _seed() -> int:
    return int(os.environ.get("KERNEL_TEST_SEED", random.randrange(2**31)))


# ---------------------------------------------------------------------------- key codes


def coded_case(*, kv, group, d, page_size, n, listed, seed, invalid=0.25):
    """A code pool written from real keys (rows 1.. of it; row 0 is padding) and page
    lists drawn from it with repeats, a share ``invalid`` of entries marked invalid (at
    least one where ``invalid`` > 0; invalid entries list the padding row 0)."""
    gen = torch.Generator().manual_seed(seed)
    pages = listed + 3
    keys = torch.randn(pages, page_size, kv, d, generator=gen) * torch.linspace(0.2, 4.0, d)
    low, high = keys.amin(dim=1), keys.amax(dim=1)
    codes = torch.zeros(kv, pages + 1, page_size, d // 2, dtype=torch.uint8)
    codes[:, 1:] = quantise(keys, low, high)
    ids = torch.randint(1, pages + 1, (n, listed), generator=gen)
    valid = torch.rand(n, listed, generator=gen) >= invalid
    if invalid > 0:  # both kinds of entry in every case, whatever the draw
        valid[0, 0], valid[-1, -1] = False, True
    ids = torch.where(valid, ids, 0)
    q = torch.randn(kv, n, group, d, generator=gen) * 0.4
    lo, st = low[ids - 1].float(), steps(low, high)[ids - 1]  # [n, P, kv, d]
    return keys, q, codes, ids, lo, st, valid


def assert_pages_match(got, want, seed, what):
    msg = f"seed={seed} {what}"
    (lse_g, err_g), (lse_w, err_w) = got, want
    assert lse_g.shape == lse_w.shape and err_g.shape == err_w.shape, msg
    assert lse_g.dtype == torch.float32 and err_g.dtype == torch.float32, msg
    lse_g, err_g = lse_g.cpu(), err_g.cpu()
    assert torch.equal(torch.isneginf(lse_g), torch.isneginf(lse_w)), msg
    finite = torch.isfinite(lse_w)
    assert torch.isfinite(lse_g[finite]).all(), msg
    torch.testing.assert_close(lse_g[finite], lse_w[finite], rtol=LSE_RTOL, atol=LSE_ATOL, msg=msg)
    torch.testing.assert_close(err_g, err_w, rtol=ERR_RTOL, atol=ERR_ATOL, msg=msg)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
def test_the_key_code_kernel_matches_the_torch_reference(d, page_size, group, logit_cap):
    seed = _seed()
    _, q, codes, ids, lo, st, valid = coded_case(kv=2, group=group, d=d, page_size=page_size, n=3, listed=5, seed=seed)
    args = (q, codes, ids, lo, st, valid)
    kw = dict(logit_cap=logit_cap, margin=ROUNDING_MARGIN)
    want = key_code_pages_torch(*args, **kw)
    got = key_code_pages_triton(*(t.to(DEVICE) for t in args), **kw)
    assert_pages_match(got, want, seed, f"d={d} page={page_size} group={group} cap={logit_cap}")
    # Non-trivial inputs: invalid entries and finite ones both occur, caps bite.
    assert (~valid).any() and valid.any(), f"seed={seed}"


@pytest.mark.parametrize(
    "d,page_size,group",
    [(96, 24, 3), (32, 40, 8)],
    ids=["half-48-two-tiles", "group-8-three-tiles"],
)
def test_the_key_code_kernel_masks_odd_widths_and_tiles_long_pages(d, page_size, group):
    # D/2 not a power of two, a group of 3, pages longer than one tile of tokens
    # (the online softmax across tiles) and a partial last tile.
    seed = _seed()
    _, q, codes, ids, lo, st, valid = coded_case(kv=1, group=group, d=d, page_size=page_size, n=2, listed=4, seed=seed)
    args = (q, codes, ids, lo, st, valid)
    want = key_code_pages_torch(*args, margin=ROUNDING_MARGIN)
    got = key_code_pages_triton(*(t.to(DEVICE) for t in args), margin=ROUNDING_MARGIN)
    assert_pages_match(got, want, seed, f"d={d} page={page_size} group={group}")


def test_the_key_code_kernel_brackets_the_exact_page_mass():
    # Against the keys the codes stand for, not the reference: every valid page's exact
    # log-mass lies within the kernel's estimate plus or minus its error.
    seed = _seed()
    keys, q, codes, ids, lo, st, valid = coded_case(
        kv=2, group=4, d=64, page_size=16, n=2, listed=6, seed=seed, invalid=0.0
    )
    lse, err = key_code_pages_triton(*(t.to(DEVICE) for t in (q, codes, ids, lo, st, valid)), margin=ROUNDING_MARGIN)
    lse, err = lse.cpu().double(), err.cpu().double()
    listed_keys = keys[ids - 1].double()  # [n, P, page, kv, d]
    exact = torch.logsumexp(torch.einsum("hngd,npthd->hnpgt", q.double(), listed_keys), dim=-1)
    assert (exact <= lse + err + 1e-5).all(), f"seed={seed}"
    assert (exact >= lse - err - 1e-5).all(), f"seed={seed}"
    assert (err > 0).all(), f"seed={seed}"


@on_cuda
def test_key_code_pages_runs_the_triton_kernel_for_cuda_queries_at_a_llama_8b_shape():
    # Llama-3.1-8B's heads (8 KV, group 4, D 128), page 16, a long rest list per request.
    seed = _seed()
    _, q, codes, ids, lo, st, valid = coded_case(kv=8, group=4, d=128, page_size=16, n=4, listed=512, seed=seed)
    want = key_code_pages_torch(q, codes, ids, lo, st, valid, margin=ROUNDING_MARGIN)
    cuda = [t.cuda() for t in (q, codes, ids, lo, st, valid)]
    got = key_code_pages(*cuda, margin=ROUNDING_MARGIN)
    assert got[0].is_cuda
    assert_pages_match(got, want, seed, "dispatched")
    assert_pages_match(key_code_pages_triton(*cuda, margin=ROUNDING_MARGIN), want, seed, "direct")
    # use_native=False keeps the torch path on the GPU.
    torch_path = key_code_pages(*cuda, margin=ROUNDING_MARGIN, use_native=False)
    assert torch.equal(torch_path[0], key_code_pages_torch(*cuda, margin=ROUNDING_MARGIN)[0])


# ---------------------------------------------------------------------------- merge


def parts(shape, dv, *, seed, empty=0.2):
    """Two parts with random lse (a share ``empty`` of them -inf on each side, so some
    rows are empty on both) and random outputs."""
    gen = torch.Generator().manual_seed(seed)
    lse_a = torch.randn(shape, generator=gen) * 4
    lse_b = torch.randn(shape, generator=gen) * 4 + 1.0
    lse_a = lse_a.masked_fill(torch.rand(shape, generator=gen) < empty, float("-inf"))
    lse_b = lse_b.masked_fill(torch.rand(shape, generator=gen) < empty, float("-inf"))
    out_a = torch.randn(*shape, dv, generator=gen)
    out_b = torch.randn(*shape, dv, generator=gen)
    return lse_a, out_a, lse_b, out_b


def assert_merged_match(got, want, seed, what=""):
    msg = f"seed={seed} {what}"
    (lse_g, out_g), (lse_w, out_w) = got, want
    assert lse_g.shape == lse_w.shape and out_g.shape == out_w.shape, msg
    assert lse_g.dtype == lse_w.dtype and out_g.dtype == out_w.dtype, msg
    lse_g, out_g = lse_g.cpu(), out_g.cpu()
    assert torch.equal(torch.isneginf(lse_g), torch.isneginf(lse_w)), msg
    finite = torch.isfinite(lse_w)
    torch.testing.assert_close(lse_g[finite], lse_w[finite], rtol=1e-6, atol=1e-5, msg=msg)
    torch.testing.assert_close(out_g, out_w, rtol=1e-5, atol=OUT_ATOL, msg=msg)


@pytest.mark.parametrize(
    "shape,dv",
    [((3, 4), 64), ((2, 32), 128), ((5,), 80), ((2, 3), 300)],
    ids=["gqa-64", "llama-heads-128", "dv-80-masked", "dv-300-two-blocks"],
)
def test_the_merge_kernel_matches_the_torch_reference(shape, dv):
    seed = _seed()
    args = parts(shape, dv, seed=seed, empty=0.3)
    lse_a, _, lse_b, _ = args
    got = merge_parts_triton(*(t.to(DEVICE) for t in args))
    want = merge_parts_torch(*args)
    assert_merged_match(got, want, seed, f"shape={shape} dv={dv}")
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    if both_empty.any():
        assert (got[1].cpu()[both_empty] == 0).all(), f"seed={seed}: an empty union has output 0"


def test_the_merge_kernel_keeps_one_sided_rows_exactly_and_empty_rows_empty():
    # Row 0: only part a; row 1: only part b; row 2: neither; row 3: both.
    seed = _seed()
    _, out_a, _, out_b = parts((4,), 16, seed=seed, empty=0.0)
    inf = float("-inf")
    lse_a = torch.tensor([1.5, inf, inf, 0.0])
    lse_b = torch.tensor([inf, -2.0, inf, 0.0])
    lse, out = (t.cpu() for t in merge_parts_triton(*(t.to(DEVICE) for t in (lse_a, out_a, lse_b, out_b))))
    assert lse[0] == 1.5 and lse[1] == -2.0 and torch.isneginf(lse[2]), f"seed={seed}"
    torch.testing.assert_close(lse[3], torch.tensor(0.6931472), msg=f"seed={seed}")
    torch.testing.assert_close(out[0], out_a[0], msg=f"seed={seed}")
    torch.testing.assert_close(out[1], out_b[1], msg=f"seed={seed}")
    assert (out[2] == 0).all(), f"seed={seed}"
    torch.testing.assert_close(out[3], (out_a[3] + out_b[3]) / 2, msg=f"seed={seed}")


def test_merging_two_token_sets_gives_the_softmax_over_their_union():
    # The meaning, not the reference: attention over all tokens, split into two sets.
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    rows, tokens, dv = 6, 20, 32
    logits = torch.randn(rows, tokens, generator=gen) * 3
    values = torch.randn(tokens, dv, generator=gen)
    in_a = torch.rand(tokens, generator=gen) < 0.5
    in_a[0], in_a[1] = True, False

    def part(mask):
        x = logits[:, mask]
        return torch.logsumexp(x, dim=-1), torch.softmax(x, dim=-1) @ values[mask]

    lse_a, out_a = part(in_a)
    lse_b, out_b = part(~in_a)
    lse, out = (t.cpu() for t in merge_parts_triton(*(t.to(DEVICE) for t in (lse_a, out_a, lse_b, out_b))))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), msg=f"seed={seed}")
    torch.testing.assert_close(out, torch.softmax(logits, dim=-1) @ values, msg=f"seed={seed}")


def test_merge_parts_on_the_cpu_is_the_torch_reference_bit_for_bit():
    # guard.py calls the dispatcher: on CPU tensors it must behave as before.
    seed = _seed()
    args = parts((3, 4), 64, seed=seed, empty=0.3)
    got, want = merge_parts(*args), merge_parts_torch(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed={seed}"


def test_the_merge_kernel_refuses_parts_of_different_shapes():
    lse = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="do not match"):
        merge_parts_triton(lse, torch.zeros(2, 3, 8), lse, torch.zeros(2, 3, 4))


@on_cuda
def test_merge_parts_runs_the_triton_kernel_for_cuda_tensors():
    seed = _seed()
    args = parts((8, 32), 128, seed=seed, empty=0.2)
    got = merge_parts(*(t.cuda() for t in args))
    assert got[1].is_cuda
    assert_merged_match(got, merge_parts_torch(*args), seed)
