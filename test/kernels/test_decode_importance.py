"""Decode attention with page importance: Triton kernels against a float64 reference.

Runs under TRITON_INTERPRET=1 on CPU (see conftest.py); with TRITON_INTERPRET=0 on a
GPU machine the same tests exercise the compiled kernels. Inputs are fresh random
numbers each run (seed in every failure message; pin one with KERNEL_TEST_SEED).
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")

from sgl_kernel_ext import (  # noqa: E402
    DecodeImportanceWrapper,
    decode_attention_with_importance,
    decode_importance_reference,
    scatter_page_importance,
    split_bounds,
)
from sgl_kernel_ext.plan import (  # noqa: E402
    SPLIT_POLICIES,
    TILE_CANDIDATES,
    WAVE_FILL,
    decode_geometry,
    default_num_splits,
    whole_wave_splits,
)
from support.kernel_device import DEVICE, EMPTY_PAGES_WARN  # noqa: E402

pytestmark = [EMPTY_PAGES_WARN]

OUT_RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
IMP_ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}
LSE_ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}

# (q_heads, kv_heads): MHA, SmolLM2's 9/3, Llama's 4:1 ratio, MQA wider than one head tile
HEADS = [(4, 4), (9, 3), (8, 2), (32, 1)]


def _seed() -> int:
    return int(os.environ.get("KERNEL_TEST_SEED", random.randrange(2**31)))


def make_batch(
    lengths,
    *,
    q_heads,
    kv_heads,
    head_dim=64,
    v_head_dim=None,
    page_size,
    dtype,
    seed,
    spare_pages=3,
    first_page_zero=(),
):
    """Random q/K/V laid out the way SGLang's paged allocator lays them out.

    Each request gets distinct random physical pages >= 1 (page 0 is SGLang's
    padding page), its tokens fill them in order, the last page may be partial.
    Requests listed in ``first_page_zero`` get physical page 0 as their first page.
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-n // page_size) for n in lengths]
    num_pages = 1 + sum(pages_per_req) + spare_pages
    physical = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    indices = []
    for b, (n, npg) in enumerate(zip(lengths, pages_per_req)):
        mine, physical = physical[:npg], physical[npg:]
        if b in first_page_zero and npg:
            mine[0] = 0
        slots = (torch.tensor(mine, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        indices.append(slots[:n])
    kv_indices = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int64)
    kv_indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    num_slots = num_pages * page_size
    # scaled so logits are peaky enough for page masses to differ by orders of magnitude
    q = (2.0 * torch.randn(len(lengths), q_heads, head_dim, generator=gen)).to(dtype)
    k = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_slots, kv_heads, v_head_dim, generator=gen).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(k), to(v), to(kv_indptr), to(kv_indices)


def lengths_for(page_size):
    """Ragged: a single token, a partial last page, several pages (and splits)."""
    if page_size == 1:
        return [1, 37, 150]
    return [1, 2 * page_size + 5, min(200, 3 * page_size + page_size // 2)]


def ragged_batch(page_size, heads, dtype):
    """A fresh seed, a ``make_batch`` over ``lengths_for(page_size)`` and the pages the
    longest request spans: ``(seed, (q, k, v, indptr, indices), max_pages)``."""
    seed = _seed()
    lengths = lengths_for(page_size)
    batch = make_batch(lengths, q_heads=heads[0], kv_heads=heads[1], page_size=page_size, dtype=dtype, seed=seed)
    return seed, batch, -(-max(lengths) // page_size)


def run_kernel(q, k, v, indptr, indices, *, page_size, max_pages, num_splits=3, poison=True, **kw):
    importance = kw.pop("importance", True)
    w = DecodeImportanceWrapper(
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
        v_head_dim=v.shape[2],
        max_pages=max_pages,
        page_size=page_size,
        max_splits=8,
        dtype=q.dtype,
        device=q.device,
        per_kv_head=True,
        importance=importance,
    )
    if poison:
        poison_buffers(w)
    return w, w.run(q, k, v, indptr, indices, num_splits=num_splits, **kw)


def poison_buffers(w):
    for t in (w.out, w.lse, w.mid_o, w.mid_lse, w.page_lse, w.importance, w.importance_per_kv_head):
        if t is not None:
            t.fill_(float("nan"))


def reference(q, k, v, indptr, indices, **kw):
    return decode_importance_reference(q, k, v, indptr, indices, compute_dtype=torch.float64, **kw)


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_abs(a, b):
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def assert_matches(got, ref, dtype, seed, what=""):
    msg = f"seed={seed} {what}"
    assert not torch.isnan(got.output).any(), msg
    assert rel_err(got.output, ref.output) < OUT_RTOL[dtype], msg
    assert max_abs(got.lse, ref.lse) < LSE_ATOL[dtype], msg
    assert max_abs(got.importance, ref.importance) < IMP_ATOL[dtype], msg
    if got.importance_per_kv_head is not None:
        assert max_abs(got.importance_per_kv_head, ref.importance_per_kv_head) < IMP_ATOL[dtype], msg


# ---------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}q{kv}kv" for h, kv in HEADS])
def test_output_lse_and_page_importance_match_float64_reference(dtype, page_size, heads):
    seed, (q, k, v, indptr, indices), spanned = ragged_batch(page_size, heads, dtype)
    max_pages = spanned + 2
    _, got = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    ref = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    assert_matches(got, ref, dtype, seed)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fp16_matches_float64_reference(page_size):
    seed, (q, k, v, indptr, indices), max_pages = ragged_batch(page_size, (8, 2), torch.float16)
    _, got = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    ref = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    assert_matches(got, ref, torch.float16, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "9q3kv"])
def test_importance_of_each_request_sums_to_one_without_sinks(dtype, page_size, heads):
    seed, (q, k, v, indptr, indices), max_pages = ragged_batch(page_size, heads, dtype)
    _, got = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    sums = got.importance.double().sum(dim=1).cpu()
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-3), f"seed={seed} sums={sums}"
    per_kv_sums = got.importance_per_kv_head.double().sum(dim=1).cpu()
    assert torch.allclose(per_kv_sums, torch.ones_like(per_kv_sums), atol=1e-3), f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "8q2kv"])
def test_sinks_join_the_denominator_so_importance_sums_to_one_minus_sink_probability(dtype, page_size, heads):
    seed, (q, k, v, indptr, indices), max_pages = ragged_batch(page_size, heads, dtype)
    # Each head's sink within one unit of its largest log-sum-exp over the batch, so
    # every request's sink probability is >= sigmoid(-1) whatever the seed (a random
    # scale could leave the sinks negligible and the check below vacuous).
    no_sink = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    gen = torch.Generator().manual_seed(seed + 1)
    offset = torch.rand(heads[0], generator=gen, dtype=torch.float64) * 2.0 - 1.0
    sinks = (no_sink.lse.double().cpu().max(dim=0).values + offset).float().to(DEVICE)
    _, got = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages, sinks=sinks)
    ref = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages, sinks=sinks)
    assert_matches(got, ref, dtype, seed)

    sink_prob = torch.exp(sinks.double().cpu()[None, :] - got.lse.double().cpu()).mean(dim=1)
    sums = got.importance.double().sum(dim=1).cpu()
    assert (sink_prob > 1e-3).all(), f"seed={seed}: sinks too weak to test anything"
    assert torch.allclose(sums, 1.0 - sink_prob, atol=1e-3), f"seed={seed} {sums} vs {1 - sink_prob}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "9q3kv"])
def test_logit_soft_cap_is_applied_before_softmax_and_importance(dtype, page_size, heads):
    seed, (q, k, v, indptr, indices), max_pages = ragged_batch(page_size, heads, dtype)
    cap = 1.5  # below the logit spread, so capping changes the answer
    _, got = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages, logit_cap=cap)
    ref = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages, logit_cap=cap)
    uncapped = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    assert rel_err(uncapped.output, ref.output) > 10 * OUT_RTOL[dtype], "cap too loose to test"
    assert_matches(got, ref, dtype, seed)


def test_soft_cap_and_sinks_together_match_reference():
    seed = _seed()
    q, k, v, indptr, indices = make_batch(
        [70, 3, 129], q_heads=8, kv_heads=2, page_size=16, dtype=torch.float32, seed=seed
    )
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    _, got = run_kernel(q, k, v, indptr, indices, page_size=16, max_pages=9, sinks=sinks, logit_cap=2.0)
    ref = reference(q, k, v, indptr, indices, page_size=16, max_pages=9, sinks=sinks, logit_cap=2.0)
    assert_matches(got, ref, torch.float32, seed)


def test_v_head_dim_may_differ_and_head_dim_need_not_be_a_power_of_two():
    seed = _seed()
    q, k, v, indptr, indices = make_batch(
        [45, 90],
        q_heads=6,
        kv_heads=2,
        head_dim=80,
        v_head_dim=48,
        page_size=16,
        dtype=torch.float32,
        seed=seed,
    )
    _, got = run_kernel(q, k, v, indptr, indices, page_size=16, max_pages=6)
    ref = reference(q, k, v, indptr, indices, page_size=16, max_pages=6)
    assert got.output.shape == (2, 6, 48)
    assert_matches(got, ref, torch.float32, seed)


def test_sm_scale_is_honoured():
    seed = _seed()
    q, k, v, indptr, indices = make_batch([50], q_heads=4, kv_heads=4, page_size=16, dtype=torch.float32, seed=seed)
    _, got = run_kernel(q, k, v, indptr, indices, page_size=16, max_pages=4, sm_scale=0.3)
    ref = reference(q, k, v, indptr, indices, page_size=16, max_pages=4, sm_scale=0.3)
    assert_matches(got, ref, torch.float32, seed)


# ---------------------------------------------------------------------------- splits


@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
def test_split_boundaries_are_page_and_tile_aligned(page_size):
    for heads in HEADS:
        geo = decode_geometry(heads[0], heads[1], 64, 64, page_size)
        for seq_len in (1, page_size + 1, 333, 4097):
            for num_splits in (1, 3, 8):
                bounds = split_bounds(seq_len, num_splits, geo.split_align)
                assert bounds[0][0] == 0 and bounds[-1][1] == seq_len
                assert len(bounds) <= num_splits
                for lo, hi in bounds:
                    assert lo % page_size == 0 and lo % geo.block_n == 0
                    assert lo < hi
                assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_result_does_not_depend_on_the_number_of_splits(page_size):
    seed = _seed()
    lengths = [1, 190, 64]
    q, k, v, indptr, indices = make_batch(
        lengths, q_heads=8, kv_heads=2, page_size=page_size, dtype=torch.float32, seed=seed
    )
    max_pages = -(-190 // page_size)
    results = [
        run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages, num_splits=s)[1]
        for s in (1, 2, 7)
    ]
    for other in results[1:]:
        assert rel_err(other.output, results[0].output) < 1e-5, f"seed={seed}"
        assert max_abs(other.importance, results[0].importance) < 1e-5, f"seed={seed}"


@pytest.mark.parametrize("name", list(TILE_CANDIDATES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_every_tile_shape_the_sweep_may_pick_matches_the_float64_reference(name, page_size):
    seed, (q, k, v, indptr, indices), spanned = ragged_batch(page_size, (8, 2), torch.bfloat16)
    w = DecodeImportanceWrapper(
        q.shape[0],
        8,
        2,
        q.shape[2],
        max_pages=spanned,
        page_size=page_size,
        max_splits=8,
        dtype=q.dtype,
        device=q.device,
        per_kv_head=True,
        tiles=TILE_CANDIDATES[name],
    )
    poison_buffers(w)
    got = w.run(q, k, v, indptr, indices, num_splits=3)
    ref = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=spanned)
    assert_matches(got, ref, torch.bfloat16, seed, what=name)


@pytest.mark.parametrize("resident", [5 * 132, 3 * 132, 2 * 132, 7])
def test_whole_wave_rule_fills_its_last_wave_or_fills_as_well_as_any_count_can(resident):
    max_splits = 32
    for programs_per_split in (1, 3, 8, 24, 64, 256, 512, 1000, 4096):
        fill = {}
        for splits in range(1, max_splits + 1):
            waves = splits * programs_per_split / resident
            fill[splits] = waves / math.ceil(waves)
        chosen = whole_wave_splits(programs_per_split, resident, 1, max_splits)
        assert 1 <= chosen <= max_splits
        if any(f >= WAVE_FILL for f in fill.values()):
            assert fill[chosen] >= WAVE_FILL
            assert all(fill[s] < WAVE_FILL for s in range(1, chosen)), "not the fewest splits that fill"
        else:
            assert fill[chosen] == max(fill.values())


def test_default_splits_stay_within_the_workspace_for_every_rule():
    geo = decode_geometry(32, 8, 128, 128, 16)
    for policy in SPLIT_POLICIES:
        for bs in (1, 2, 8, 32, 64, 512):
            for max_splits in (1, 8, 32):
                splits = default_num_splits(bs, 8, geo, max_splits, "cpu", policy)
                assert 1 <= splits <= max_splits, (policy, bs, max_splits)


# ---------------------------------------------------------------------------- importance switch


@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "9q3kv"])
def test_importance_off_gives_the_same_output_and_touches_no_importance_buffer(heads):
    seed = _seed()
    lengths = [33, 1, 100]
    q, k, v, indptr, indices = make_batch(
        lengths, q_heads=heads[0], kv_heads=heads[1], page_size=16, dtype=torch.bfloat16, seed=seed
    )
    w, on = run_kernel(q, k, v, indptr, indices, page_size=16, max_pages=8)
    on_out = on.output.clone()
    poison_buffers(w)
    off = w.run(q, k, v, indptr, indices, num_splits=3, importance=False)
    assert off.importance is None and off.importance_per_kv_head is None
    assert torch.equal(off.output, on_out) or rel_err(off.output, on_out) < 1e-6, f"seed={seed}"
    assert torch.isnan(w.page_lse).all() and torch.isnan(w.importance).all()
    assert torch.isnan(w.importance_per_kv_head).all()


# ---------------------------------------------------------------------------- padding, page 0, limits


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "8q2kv"])
def test_padding_rows_and_pages_past_a_request_are_written_as_zero(page_size, heads):
    seed = _seed()
    lengths = [0, 5, 0, 40]
    q, k, v, indptr, indices = make_batch(
        lengths, q_heads=heads[0], kv_heads=heads[1], page_size=page_size, dtype=torch.float32, seed=seed
    )
    max_pages = -(-40 // page_size) + 3
    _, got = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    for t in got:
        assert not torch.isnan(t).any(), f"seed={seed}: an entry was never written"
    for b in (0, 2):
        assert (got.output[b] == 0).all() and (got.lse[b] == 0).all()
        assert (got.importance[b] == 0).all() and (got.importance_per_kv_head[b] == 0).all()
    for b, n in enumerate(lengths):
        pages = -(-n // page_size)
        assert (got.importance[b, pages:] == 0).all()
        assert (got.importance_per_kv_head[b, pages:] == 0).all()
    ref = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    assert_matches(got, ref, torch.float32, seed)


def test_wrapper_serves_smaller_batches_from_the_same_static_buffers():
    seed = _seed()
    w = DecodeImportanceWrapper(
        4,
        8,
        2,
        64,
        max_pages=8,
        page_size=16,
        max_splits=4,
        dtype=torch.float32,
        device=DEVICE,
        per_kv_head=True,
    )
    ptrs = None
    for lengths in ([20, 77, 3, 100], [50], [0, 9]):
        q, k, v, indptr, indices = make_batch(
            lengths, q_heads=8, kv_heads=2, page_size=16, dtype=torch.float32, seed=seed + len(lengths)
        )
        poison_buffers(w)
        got = w.run(q, k, v, indptr, indices)
        assert got.output.shape[0] == len(lengths)
        now = tuple(t.data_ptr() for t in got)
        assert ptrs is None or now == ptrs, "run() must return views of the same buffers"
        ptrs = now
        ref = reference(q, k, v, indptr, indices, page_size=16, max_pages=8)
        assert_matches(got, ref, torch.float32, seed)


@pytest.mark.parametrize("page_size", [1, 16])
def test_slots_on_padding_page_zero_contribute_nothing(page_size):
    seed = _seed()
    # request 0's first page is physical page 0; request 1 lives entirely on page 0
    lengths = [3 * page_size + 7, 1]
    q, k, v, indptr, indices = make_batch(
        lengths,
        q_heads=4,
        kv_heads=4,
        page_size=page_size,
        dtype=torch.float32,
        seed=seed,
        first_page_zero=(0, 1),
    )
    _, got = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=5)
    assert (got.output[1] == 0).all() and (got.importance[1] == 0).all()
    assert (got.importance[0, 0] == 0).all()

    # the same request with its page-0 tokens dropped: the rest must be identical
    n0 = lengths[0]
    kept = indices[page_size:n0]
    indptr_kept = torch.tensor([0, n0 - page_size], dtype=torch.int32, device=DEVICE)
    ref = reference(q[:1], k, v, indptr_kept, kept, page_size=page_size, max_pages=5)
    assert rel_err(got.output[:1], ref.output) < 1e-5, f"seed={seed}"
    assert max_abs(got.importance[0, 1:4], ref.importance[0, :3]) < 1e-5, f"seed={seed}"


def test_requests_with_valid_slots_are_unaffected_by_the_page0_mask():
    seed = _seed()
    q, k, v, indptr, indices = make_batch([40, 17], q_heads=8, kv_heads=2, page_size=16, dtype=torch.float32, seed=seed)
    masked = decode_attention_with_importance(q, k, v, indptr, indices, page_size=16, max_pages=3, num_splits=2)
    unmasked = decode_attention_with_importance(
        q, k, v, indptr, indices, page_size=16, max_pages=3, num_splits=2, mask_page0=False
    )
    assert rel_err(masked.output, unmasked.output) < 1e-6
    assert max_abs(masked.importance, unmasked.importance) < 1e-6


def test_pages_beyond_max_pages_get_no_importance_but_attention_stays_exact():
    seed = _seed()
    q, k, v, indptr, indices = make_batch(
        [150, 20], q_heads=8, kv_heads=2, page_size=16, dtype=torch.float32, seed=seed
    )
    _, got = run_kernel(q, k, v, indptr, indices, page_size=16, max_pages=4)
    ref = reference(q, k, v, indptr, indices, page_size=16, max_pages=4)
    assert_matches(got, ref, torch.float32, seed)
    assert got.importance[0].sum() < 1.0 - 1e-6  # the truncated tail's mass is gone


def test_invalid_shapes_are_rejected_with_the_offending_value():
    with pytest.raises(ValueError, match="page_size=3"):
        decode_geometry(8, 2, 64, 64, 3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        decode_geometry(8, 3, 64, 64, 16)


# ---------------------------------------------------------------------------- reference itself


def _naive_reference(q, k, v, indptr, indices, page_size, sm_scale, cap, sinks, max_pages):
    """Token by token in Python floats: an independent check of the torch reference."""
    bs, hq, _ = q.shape
    kvh = k.shape[1]
    group = hq // kvh
    out = torch.zeros(bs, hq, v.shape[2], dtype=torch.float64)
    imp = torch.zeros(bs, max_pages, dtype=torch.float64)
    for b in range(bs):
        slots = indices[indptr[b] : indptr[b + 1]].tolist()
        for h in range(hq):
            logits = []
            for s in slots:
                x = float((q[b, h].double() * k[s, h // group].double()).sum()) * sm_scale
                if cap > 0:
                    x = cap * math.tanh(x / cap)
                logits.append(x if s >= page_size else -math.inf)
            extra = [float(sinks[h])] if sinks is not None else []
            m = max(logits + extra)
            den = sum(math.exp(x - m) for x in logits + extra)
            for t, (s, x) in enumerate(zip(slots, logits)):
                p = math.exp(x - m) / den
                out[b, h] += p * v[s, h // group].double()
                if t // page_size < max_pages:
                    imp[b, t // page_size] += p / hq
    return out, imp


def test_torch_reference_agrees_with_a_token_by_token_softmax():
    seed = _seed()
    page_size = 4
    q, k, v, indptr, indices = make_batch(
        [9, 1, 13],
        q_heads=4,
        kv_heads=2,
        head_dim=8,
        page_size=page_size,
        dtype=torch.float64,
        seed=seed,
        first_page_zero=(2,),
    )
    q, k, v, indptr, indices = (t.cpu() for t in (q, k, v, indptr, indices))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    ref = decode_importance_reference(
        q,
        k,
        v,
        indptr,
        indices,
        page_size=page_size,
        sm_scale=0.4,
        logit_cap=3.0,
        sinks=sinks,
        max_pages=4,
        compute_dtype=torch.float64,
    )
    out, imp = _naive_reference(q, k, v, indptr, indices, page_size, 0.4, 3.0, sinks, 4)
    assert torch.allclose(ref.output, out, atol=1e-12)
    assert torch.allclose(ref.importance.double(), imp, atol=1e-6)  # importance is stored as float32


# ---------------------------------------------------------------------------- page table scatter


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_scatter_writes_each_request_page_to_its_physical_page(use_triton, page_size):
    seed = _seed()
    lengths = [3 * page_size + 1, 0, page_size]
    _, _, _, indptr, indices = make_batch(
        lengths, q_heads=1, kv_heads=1, head_dim=16, page_size=page_size, dtype=torch.float32, seed=seed
    )
    max_pages = 5
    importance = torch.rand(len(lengths), max_pages, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    num_physical = int(indices.max()) // page_size + 3
    table = torch.full((num_physical,), -7.0, device=DEVICE)
    scatter_page_importance(importance, indptr, indices, table, page_size=page_size, use_triton=use_triton)

    expected = torch.full((num_physical,), -7.0)
    bounds = indptr.tolist()
    for b, n in enumerate(lengths):
        for j in range(min(-(-n // page_size), max_pages)):
            phys = int(indices[bounds[b] + j * page_size]) // page_size
            expected[phys] = importance[b, j].item()
    assert torch.equal(table.cpu(), expected), f"seed={seed}"


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_scatter_add_and_max_combine_pages_shared_by_requests(use_triton):
    page_size = 4
    # two requests share physical pages 2 and 5 (a common prefix); request 0 also owns page 7
    indices = torch.tensor(
        [8, 9, 10, 11, 20, 21, 22, 23, 28, 29] + [8, 9, 10, 11, 20, 21], dtype=torch.int64, device=DEVICE
    )
    indptr = torch.tensor([0, 10, 16], dtype=torch.int32, device=DEVICE)
    importance = torch.tensor([[0.5, 0.25, 0.25], [0.75, 0.125, 0.0]], device=DEVICE)
    added = torch.zeros(9, device=DEVICE)
    scatter_page_importance(
        importance, indptr, indices, added, page_size=page_size, reduce="add", use_triton=use_triton
    )
    maxed = torch.zeros(9, device=DEVICE)
    scatter_page_importance(
        importance, indptr, indices, maxed, page_size=page_size, reduce="max", use_triton=use_triton
    )
    assert added.cpu().tolist() == [0, 0, 1.25, 0, 0, 0.375, 0, 0.25, 0]
    assert maxed.cpu().tolist() == [0, 0, 0.75, 0, 0, 0.25, 0, 0.25, 0]


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_scatter_leaves_the_padding_page_and_pages_past_max_pages_alone(use_triton):
    page_size = 2
    indices = torch.tensor([0, 1, 6, 7, 8, 9], dtype=torch.int64, device=DEVICE)  # pages 0, 3, 4
    indptr = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    importance = torch.tensor([[0.25, 0.5]], device=DEVICE)  # max_pages=2: page 4 has no column
    table = torch.full((6,), -1.0, device=DEVICE)
    scatter_page_importance(importance, indptr, indices, table, page_size=page_size, use_triton=use_triton)
    assert table.cpu().tolist() == [-1.0, -1.0, -1.0, 0.5, -1.0, -1.0]


def test_scatter_of_kernel_importance_lands_on_the_pages_the_kernel_read():
    seed = _seed()
    page_size = 16
    q, k, v, indptr, indices = make_batch(
        [70, 33], q_heads=8, kv_heads=2, page_size=page_size, dtype=torch.float32, seed=seed
    )
    _, got = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=5)
    table = torch.zeros(k.shape[0] // page_size, device=DEVICE)
    scatter_page_importance(got.importance, indptr, indices, table, page_size=page_size, reduce="add", use_triton=True)
    # every request's mass lands somewhere on its own pages, and nowhere else
    assert abs(table.sum().item() - 2.0) < 1e-4
    owned = torch.unique(indices // page_size).cpu()
    others = torch.ones(table.numel(), dtype=torch.bool)
    others[owned] = False
    assert (table.cpu()[others] == 0).all()


# ---------------------------------------------------------------------------- long contexts (GPU)


@pytest.mark.skipif(DEVICE != "cuda", reason="long contexts run compiled on a GPU (minutes under the interpreter)")
@pytest.mark.parametrize("lengths", [[32768, 5], [131072]], ids=["32K+short", "128K"])
def test_llama_8b_heads_at_long_context_match_the_reference_with_importance_on_and_off(lengths):
    # Llama-3.1-8B's heads (32 q / 8 kv, d 128), page 16, bf16: the shape the GPU serves.
    seed = _seed()
    page_size, max_pages = 16, -(-max(lengths) // 16)
    q, k, v, indptr, indices = make_batch(
        lengths, q_heads=32, kv_heads=8, head_dim=128, page_size=page_size, dtype=torch.bfloat16, seed=seed
    )
    w, on = run_kernel(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages, num_splits=8)
    on_out = on.output.clone()
    ref = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    assert_matches(on, ref, torch.bfloat16, seed, what=f"lengths={lengths}")
    off = w.run(q, k, v, indptr, indices, num_splits=8, importance=False)
    assert torch.equal(off.output, on_out), f"seed={seed}: importance on and off differ at lengths={lengths}"
