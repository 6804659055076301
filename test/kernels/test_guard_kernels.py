"""The guard's Triton kernels against their torch references: the key codes' page pass
(``key_code_pages_triton`` vs ``key_code_pages_torch``), the merge of two softmax parts
(``merge_parts_triton`` vs ``merge_parts_torch``) and the sampled estimate with its bound
(``combine_triton`` vs ``estimate.combine``'s torch code).

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

from sgl_importance.hot_set.guard.estimate import MIN_SAMPLED, T_QUANTILES, Outside, Sampled, Z, combine  # noqa: E402
from sgl_importance.hot_set.guard.key_codes import ROUNDING_MARGIN, RowLayout, quantise, steps  # noqa: E402
from sgl_importance.hot_set.guard.layer import _combine  # noqa: E402
from sgl_kernel_ext import (  # noqa: E402
    combine_rest_triton,
    combine_triton,
    key_code_pages,
    key_code_pages_ranged,
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


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,logit_cap", [(1, 0.0), (4, 3.0)])
def test_the_ranged_key_code_kernel_reads_the_range_tables_as_the_gathered_ranges(group, logit_cap, table_dtype):
    """key_code_pages_ranged (a captured step): ranges read from the tables by row, the
    step computed in the kernel, q scaled there, heads in query order, the value norms by
    code row; against the torch reference over the same ranges gathered and their steps
    (as estimate_outside builds them)."""
    seed = _seed()
    keys, q, codes, ids, _, _, valid = coded_case(kv=2, group=group, d=64, page_size=16, n=3, listed=5, seed=seed)
    low, high = keys.amin(dim=1), keys.amax(dim=1)  # coded_case's ranges, page i at code row i + 1
    pad = torch.zeros(1, *low.shape[1:])
    tables = tuple(torch.cat((pad, t)).to(table_dtype) for t in (low, high))  # row = code id
    # Range rows apart from code ids: a permuted table, its rows named by range_ids.
    rows = torch.randperm(tables[0].shape[0], generator=torch.Generator().manual_seed(seed))
    tables = tuple(t[rows] for t in tables)
    range_ids = torch.argsort(rows)[ids]
    lo, st = tables[0][range_ids].float(), steps(tables[0][range_ids], tables[1][range_ids])
    kw = dict(logit_cap=logit_cap, margin=ROUNDING_MARGIN)
    want = key_code_pages_torch(q, codes, ids, lo, st, valid, **kw)
    n, hq = q.shape[1], q.shape[0] * q.shape[2]
    q_rows = (q * 2).transpose(0, 1).reshape(n, hq, -1)  # unscaled by sm_scale 0.5 (exact in binary)
    # The norms as a pool keeps them: in the norm block of each code row's KV page.
    kv, rows = q.shape[0], codes.shape[1]
    row_bytes = kv * 16 * 64 // 2
    layout = RowLayout.of(2, -(-rows // 4) * 4, 4, row_bytes, kv)  # every id a K-half row
    flat = torch.zeros(layout.halves * layout.rows_per_half * layout.row_floats)
    norms = torch.rand(rows, kv, generator=torch.Generator().manual_seed(seed))  # [rows, Hkv]
    flat[layout.norm_index(torch.arange(rows))[:, None] + torch.arange(kv)] = norms
    args = (q_rows, codes, ids, *tables, range_ids, valid, flat)
    lse, err, got_norms = key_code_pages_ranged(*(t.to(DEVICE) for t in args), layout, sm_scale=0.5, **kw)
    want_norms = torch.where(valid[:, None, :], norms[ids].permute(0, 2, 1), 0.0)  # [n, Hkv, P] by code row
    assert torch.equal(got_norms.cpu(), want_norms), f"seed={seed}: value norms"
    heads = lambda x: x.transpose(2, 3).transpose(0, 1).reshape(n, hq, -1)  # noqa: E731  [Hkv, n, P, g] -> [n, Hq, P]
    assert_pages_match((lse.cpu(), err.cpu()), tuple(map(heads, want)), seed, f"ranged group={group}")


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
    # hot_set/guard/layer.py calls the dispatcher: on CPU tensors it must behave as before.
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


# ---------------------------------------------------------------------------- combine


def combine_case(*, n, hq, sampled, dv, rest, seed):
    """Per request: an exact part, ``sampled`` sampled pages (some not estimated, -inf),
    key-code log-masses of ``rest`` rest pages. Request 0 has every page estimated and
    ``pi`` < 1; the last request has no sampled page left and is uncovered; request 1
    (when there are 3 or more) keeps only two sampled pages (too few to vouch) and has
    an empty exact part in one head; request 2 (4 or more) has ``pi`` = 1."""
    gen = torch.Generator().manual_seed(seed)
    lse_e = torch.randn(n, hq, generator=gen) * 2 + 3
    out_e = torch.randn(n, hq, dv, generator=gen)
    lse_s = torch.randn(n, hq, sampled, generator=gen) * 2
    out_s = torch.randn(n, hq, sampled, dv, generator=gen)
    keep = torch.rand(n, sampled, generator=gen) < 0.8
    keep[0] = True
    keep[-1] = False
    if n >= 3:
        keep[1] = False
        keep[1, :2] = True
        lse_e[1, 0] = float("-inf")
    lse_s = lse_s.masked_fill(~keep[:, None, :], float("-inf"))
    pi = torch.rand(n, generator=gen) * 0.3 + 0.05
    if n >= 4:
        pi[2] = 1.0
    rest_lse = torch.randn(n, hq, rest, generator=gen) * 2
    rest_lse = rest_lse.masked_fill(torch.rand(n, 1, rest, generator=gen) < 0.2, float("-inf"))
    rest_lse[:, :, :sampled] = torch.where(keep[:, None, :], rest_lse[:, :, :sampled], float("-inf"))
    codes = (rest_lse, rest_lse[..., :sampled].clone())
    uncovered = torch.zeros(n, dtype=torch.bool)
    uncovered[-1] = True
    return lse_e, out_e, Sampled(lse_s, out_s), pi, uncovered, codes


def assert_combined_match(got, want, seed, what):
    msg = f"seed={seed} {what}"
    names = ("output", "lse", "exact_share", "bound", "relative")
    for name, g in zip(names, got):
        w = getattr(want, name)
        assert g.shape == w.shape and g.dtype == torch.float32, f"{msg} {name}"
        g = g.cpu()
        assert torch.equal(torch.isinf(g), torch.isinf(w)), f"{msg} {name}: {g} vs {w}"
        finite = torch.isfinite(w)
        torch.testing.assert_close(g[finite], w[finite], rtol=1e-4, atol=1e-5, msg=f"{msg} {name}")


@pytest.mark.parametrize("with_codes", [False, True], ids=["sample-only", "codes-floor"])
@pytest.mark.parametrize(
    "n,hq,sampled,dv,rest",
    [(3, 4, 5, 64, 30), (4, 8, 20, 128, 70), (2, 1, 3, 80, 3)],
    ids=["small", "tiled-pages", "one-head"],
)
def test_the_combine_kernel_matches_the_torch_estimate(n, hq, sampled, dv, rest, with_codes):
    seed = _seed()
    lse_e, out_e, sample, pi, uncovered, codes = combine_case(n=n, hq=hq, sampled=sampled, dv=dv, rest=rest, seed=seed)
    codes = codes if with_codes else None
    want = combine(lse_e, out_e, sample, pi, uncovered, codes)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    got = combine_triton(
        on(lse_e), on(out_e), on(sample.lse), on(sample.output), on(pi), on(uncovered),
        None if codes is None else tuple(map(on, codes)),
        quantiles=T_QUANTILES, z=Z, min_sampled=MIN_SAMPLED,
    )  # fmt: skip
    assert_combined_match(got, want, seed, f"n={n} hq={hq} S={sampled} dv={dv} P={rest} codes={with_codes}")
    # The cases reach both a finite bound and the ones that cannot vouch.
    assert torch.isinf(want.relative[-1]) and torch.isfinite(want.bound).all(), f"seed={seed}"
    assert (want.bound[0] > 0).item(), f"seed={seed}"


@pytest.mark.parametrize(
    "n,hq,sampled,dv,rest,part1_dtype",
    [(4, 4, 6, 64, 30, torch.float32), (3, 8, 20, 128, 150, torch.bfloat16)],
    ids=["small", "tiled-bf16-part1"],
)
def test_the_masked_combine_kernel_is_the_guards_combine_over_the_pages_still_estimated(
    n, hq, sampled, dv, rest, part1_dtype
):
    """combine_rest_triton (a captured guarded layer): the read pages' part merged into
    part 1 and the masks of the pages read and of the sample applied inside the launches,
    against guard._combine's torch merge and masking."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    lse_e, out_e = torch.randn(n, hq, generator=gen) * 2 + 3, torch.randn(n, hq, dv, generator=gen)
    out_e = out_e.to(part1_dtype)  # part 1 as the decode wrote it; the kernel reads it as it is
    sample = Sampled(torch.randn(n, hq, sampled, generator=gen) * 2, torch.randn(n, hq, sampled, dv, generator=gen))
    page_lse = (torch.randn(hq, n, rest, generator=gen) * 2).transpose(0, 1)  # strided, as the estimate's heads
    valid = torch.rand(n, rest, generator=gen) < 0.9
    read = (torch.rand(n, rest, generator=gen) < 0.3) & valid
    valid[0], read[0] = True, False  # every page estimated
    valid[-1, sampled], read[-1, sampled] = True, False
    in_sample = torch.zeros(n, rest, dtype=torch.bool)
    in_sample[:, :sampled] = torch.rand(n, sampled, generator=gen) < 0.8
    in_sample[0, :sampled] = True
    read[-1, :sampled] = valid[-1, :sampled]  # pages left (column S), none of them sampled: uncovered
    pi = (torch.rand(n, 3, generator=gen) * 0.3 + 0.05)[:, 1]  # a column, as the step's parameters hold it
    zeros = torch.zeros_like(page_lse)
    outside = Outside(page_lse, zeros, zeros)
    # The pages the selection read: a second exact part (one row read nothing; one had no part 1 in a head).
    read_part = (torch.randn(n, hq, generator=gen) * 2 + 2, torch.randn(n, hq, dv, generator=gen))
    read_part[0][1] = float("-inf")
    lse_e[0, 0] = float("-inf")
    masks = (valid, read, in_sample)
    lse_w, out_w, want = _combine(lse_e, out_e.float(), read_part, outside, sample, masks, pi, use_triton=False)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    (lse_g, out_g), got = combine_rest_triton(
        on(lse_e), on(out_e), tuple(map(on, read_part)), on(sample.lse), on(sample.output), on(pi), on(page_lse),
        *map(on, masks), quantiles=T_QUANTILES, z=Z, min_sampled=MIN_SAMPLED,
    )  # fmt: skip
    assert_combined_match(got, want, seed, f"n={n} hq={hq} S={sampled} P={rest}")
    torch.testing.assert_close(lse_g.cpu(), lse_w, rtol=1e-6, atol=1e-5, msg=f"seed={seed}: the merged exact part")
    torch.testing.assert_close(out_g.cpu(), out_w, rtol=1e-5, atol=1e-5, msg=f"seed={seed}: the merged exact part")
    assert torch.isinf(want.relative[-1]) and (want.bound[0] > 0).item(), f"seed={seed}"


def test_the_combine_kernel_reads_its_quantile_by_the_count_of_sampled_pages():
    # One request per count of sampled pages, around the table's steps (pi < 1): the
    # bound is the quantile for count - 1 degrees of freedom (looked up here from the
    # table) times the square root of the sample's variance (computed here); under
    # MIN_SAMPLED pages the estimate does not vouch.
    seed = _seed()
    counts = [1, 2, 3, 4, 5, 10, 11, 12, 13, 15, 16, 21, 30, 31, 60, 61, 121, 122, 130]
    n, hq, dv, width = len(counts), 2, 16, max(counts)
    gen = torch.Generator().manual_seed(seed)
    lse_e = torch.zeros(n, hq)
    out_e = torch.randn(n, hq, dv, generator=gen)
    lse_s = torch.randn(n, hq, width, generator=gen)
    cols = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
    lse_s = lse_s.masked_fill(~cols[:, None, :], float("-inf"))
    # Sampled outputs near the exact one: a bound small enough to vouch from 3 pages on.
    out_s = out_e[:, :, None] + 0.01 * torch.randn(n, hq, width, dv, generator=gen)
    pi = torch.full((n,), 0.1)
    uncovered = torch.zeros(n, dtype=torch.bool)
    want = combine(lse_e, out_e, Sampled(lse_s, out_s), pi, uncovered)
    vouches = torch.tensor(counts) >= MIN_SAMPLED
    assert torch.isfinite(want.relative[vouches]).all() and torch.isinf(want.relative[~vouches]).all()
    on = lambda t: t.to(DEVICE)  # noqa: E731
    got = combine_triton(
        *(on(t) for t in (lse_e, out_e, lse_s, out_s, pi, uncovered)),
        quantiles=T_QUANTILES, z=Z, min_sampled=MIN_SAMPLED,
    )  # fmt: skip
    assert_combined_match(got, want, seed, "counts")
    # float64 here; float32 in the kernel rounds y (outputs 0.01 apart) to ~1e-4, and
    # neighbouring quantiles in the table differ by 1 % or more.
    share = torch.exp(lse_s.double() - want.lse[..., None].double())  # 0 where not sampled
    y = share[..., None] * (out_s.double() - want.output[:, :, None].double())
    variance = (1 - pi.double()) / pi.double().square() * y.square().sum(dim=(1, 2, 3))
    expected = _expected_quantile(counts).double() * variance.sqrt()
    torch.testing.assert_close(got[3].cpu().double(), expected, rtol=1e-3, atol=0, msg=f"seed={seed}")


def _expected_quantile(counts):
    table = sorted(T_QUANTILES.items())
    out = []
    for c in counts:
        df = c - 1
        t = T_QUANTILES[1] if df < 1 else Z if df > table[-1][0] else max((k, v) for k, v in table if k <= df)[1]
        out.append(t)
    return torch.tensor(out)


@on_cuda
def test_combine_runs_the_triton_kernels_for_cuda_tensors():
    seed = _seed()
    lse_e, out_e, sample, pi, uncovered, codes = combine_case(n=4, hq=32, sampled=24, dv=128, rest=300, seed=seed)
    want = combine(lse_e, out_e, sample, pi, uncovered, codes)
    cuda = lambda t: t.cuda()  # noqa: E731
    got = combine(
        cuda(lse_e), cuda(out_e), Sampled(cuda(sample.lse), cuda(sample.output)), cuda(pi), cuda(uncovered),
        tuple(map(cuda, codes)),
    )  # fmt: skip
    assert got.output.is_cuda
    assert_combined_match(tuple(vars(got).values()), want, seed, "dispatched")
