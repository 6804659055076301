"""The end of a captured guarded layer in three launches (``guard_finish_triton``) against the
torch code it replaces: ``guard.weigh_bounds`` (the deterministic bound, the smaller
bound's output, the flag, the masses), ``step_tally.keep_in_tally`` and the part-1
output of a row with no rest.

Under TRITON_INTERPRET=1 on a CPU (conftest.py): rows where each bound wins, a row with no
rest, flagged and unflagged rows, released pages wanted by a flagged row, pages tiled over
three blocks (the bound's running log-sum-exp, the masses' page blocks), the value norms per
KV head as the estimate passes them (a transposed view), a bfloat16 part 1 and output buffer,
a tally already holding earlier layers, part 1's per-KV-head page masses rescaled in place
(listed pages over two blocks). Fresh random numbers each run
(seed in every failure message; pin one with KERNEL_TEST_SEED).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton guard kernels cannot run")

from sgl_importance.hot_set.guard.estimate import Combined, Outside  # noqa: E402
from sgl_importance.hot_set.guard.layer import GuardReads, part_share, weigh_bounds  # noqa: E402
from sgl_importance.hot_set.plan.step_tally import keep_in_tally, kv_group_share  # noqa: E402
from sgl_kernel_ext import guard_finish_triton  # noqa: E402
from support.kernel_device import DEVICE  # noqa: E402

LAYERS = 3


def _seed() -> int:
    return int(os.environ.get("KERNEL_TEST_SEED", random.randrange(2**31)))


def case(n, hq, kv, pages, dv, *, seed, part1_dtype=torch.float32, listed=7, rest_shift=None):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    valid = rand(n, pages) < 0.85
    valid[2] = False  # a row with no rest
    released = (rand(n, pages) < 0.2) & valid
    wanted = (rand(n, pages) < 0.4) & valid
    valid[0, 0] = released[0, 0] = wanted[0, 0] = True  # row 0 wants a released page
    missed = wanted & released
    read = wanted & ~released & (rand(n, pages) < 0.7)
    sampled = (rand(n, pages) < 0.3) & valid & ~released
    lse = torch.randn(n, hq, generator=gen) + 2.0
    out = torch.randn(n, hq, dv, generator=gen)
    page_lse = torch.randn(n, hq, pages, generator=gen) - 1.0
    if rest_shift is not None:  # [P] added to every row's and head's page log-masses
        page_lse += rest_shift
    error = rand(n, hq, pages) * 0.5
    # One value norm per KV head (a transposed view, as estimate_outside passes it).
    value_norm = (rand(kv, n, pages) * 3).transpose(0, 1)
    relative = rand(n) * 0.3
    relative[0] = float("inf")  # the deterministic bound wins
    relative[1] = 0.0  # the statistical one wins
    statistical = Combined(torch.randn(n, hq, dv, generator=gen), torch.randn(n, hq, generator=gen) + 2.5,
                           rand(n, hq), rand(n), relative)  # fmt: skip
    thresholds = torch.where(rand(n) < 0.5, 0.0, 10.0)
    thresholds[0] = 0.0  # row 0 flagged (its bound is > 0): its released wanted pages are marked 2
    part1 = torch.randn(n, hq, dv, generator=gen).to(part1_dtype)
    part1_lse = lse - rand(n, hq) * 2  # part 1 alone: at most the exact part with the reads
    part1_lse[3, 0] = float("-inf")  # a head whose part 1 holds nothing
    tally = torch.zeros(n, 2 * pages + 5 + 2 * LAYERS, dtype=torch.float64)
    tally[:, :pages] = rand(n, pages).double() * 0.1  # earlier layers' masses
    tally[:, 2 * pages : 2 * pages + 5] = torch.randint(0, 4, (n, 5), generator=gen).double()
    reads = GuardReads(wanted, missed, read, lse, out, statistical)
    per_kv = rand(n, listed, kv)  # part 1's per-KV-head masses of its listed pages
    return reads, Outside(page_lse, error, value_norm), valid, sampled, thresholds, part1, part1_lse, tally, per_kv


def reference(reads, outside, valid, sampled, thresholds, part1, part1_lse, tally, per_kv, layer, out_dtype):
    outcome = weigh_bounds(reads, outside, valid, thresholds)
    tally = tally.clone()
    keep_in_tally(tally, outcome, sampled, layer, LAYERS)
    has_rest = valid.any(dim=1)
    output = torch.where(has_rest[:, None, None], outcome.combined.output, part1.float()).to(out_dtype)
    share = torch.where(has_rest[:, None], outcome.combined.exact_share, 1.0)
    own = torch.where(has_rest[:, None], part_share(part1_lse, outcome.combined.lse), 1.0)
    per_kv = per_kv * kv_group_share(own, per_kv.shape[2])[:, None, :]
    return output, share, outcome.flagged, tally, per_kv, per_kv.mean(dim=-1), outcome


def run_kernel(reads, outside, valid, sampled, thresholds, part1, part1_lse, tally, per_kv, layer, out_dtype):
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    tally, per_kv = dev(tally.clone()), dev(per_kv.clone())
    out = torch.full(reads.out.shape, float("nan"), dtype=out_dtype, device=DEVICE)  # SGLang's output buffer
    share, flagged, importance = guard_finish_triton(
        dev(reads.lse), dev(reads.out), tuple(dev(t) for t in vars(reads.statistical).values()),
        tuple(dev(t) for t in vars(outside).values()),
        tuple(dev(t) for t in (valid, reads.read, reads.wanted, reads.missed, sampled)),
        dev(thresholds), dev(part1), dev(part1_lse), tally, out, per_kv, layer=layer, layers=LAYERS,
    )  # fmt: skip
    return tuple(t.cpu() for t in (out, share, flagged, tally, per_kv, importance))


@pytest.mark.parametrize(
    "n,hq,kv,pages,dv,part1_dtype",
    [(4, 4, 2, 20, 16, torch.float32), (5, 8, 2, 300, 64, torch.bfloat16), (4, 4, 2, 2100, 16, torch.float32)],
    ids=["small", "bf16", "pages-over-three-blocks"],
)
def test_the_finish_kernel_ends_the_layer_as_the_torch_code(n, hq, kv, pages, dv, part1_dtype):
    seed = _seed()
    args = case(n, hq, kv, pages, dv, seed=seed, part1_dtype=part1_dtype, listed=70)
    want = reference(*args, layer=1, out_dtype=part1_dtype)
    got = run_kernel(*args, layer=1, out_dtype=part1_dtype)
    msg = f"seed={seed}"
    tol = dict(rtol=1e-5, atol=1e-5) if part1_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[0], want[0], **tol, msg=msg)  # written into the output buffer, its dtype
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6, msg=msg)
    assert torch.equal(got[2], want[2]), msg
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-9, msg=msg)
    torch.testing.assert_close(got[4], want[4], rtol=1e-5, atol=1e-7, msg=msg)  # part 1's masses, scaled in place
    torch.testing.assert_close(got[5], want[5], rtol=1e-5, atol=1e-7, msg=msg)
    # The case covers what it says: each bound chosen somewhere, a flagged row with a miss.
    outcome = want[6]
    det = outcome.deterministic.relative <= outcome.statistical.relative
    assert det[0] and not det[1], msg
    assert want[2][0] and (want[3][0, pages : 2 * pages] == 2).any(), msg


def test_the_finish_kernel_refuses_mismatched_masks_and_a_narrow_tally():
    reads, outside, valid, sampled, thresholds, part1, part1_lse, tally, per_kv = case(4, 4, 2, 10, 8, seed=0)
    f32 = torch.float32
    with pytest.raises(ValueError, match="do not match"):
        run_kernel(reads, outside, valid[:, :9], sampled, thresholds, part1, part1_lse, tally, per_kv, 0, f32)
    with pytest.raises(ValueError, match="tally"):
        run_kernel(reads, outside, valid, sampled, thresholds, part1, part1_lse, tally[:, :-1], per_kv, 0, f32)


def test_the_bound_over_many_pages_decides_as_the_torch_code():
    """The deterministic bound's running log-sum-exp over three page blocks, tested through the
    choice it makes: a rest small enough for a finite bound, its largest pages in the last block
    (the running maximum moves), and each row's statistical bound set 1 % above (even rows) or
    below (odd rows) the reference's deterministic one, so a bound off by more picks the other
    output."""
    seed = _seed()
    pages = 2100
    ramp = torch.linspace(-16.0, -10.0, pages)
    args = case(4, 4, 2, pages, 16, seed=seed, listed=9, rest_shift=ramp)
    reads, outside, valid, _, thresholds = args[:5]
    det = weigh_bounds(reads, outside, valid, thresholds).deterministic.relative
    has_rest = valid.any(dim=1)
    assert torch.isfinite(det).all() and (det[has_rest] > 0).all(), f"seed={seed}: {det}"
    above = torch.arange(len(det)) % 2 == 0
    reads.statistical.relative.copy_(torch.where(above, det * 1.01, det * 0.99))
    want = reference(*args, layer=0, out_dtype=torch.float32)
    got = run_kernel(*args, layer=0, out_dtype=torch.float32)
    msg = f"seed={seed}"
    chose_det = want[6].deterministic.relative <= want[6].statistical.relative
    assert torch.equal(chose_det[has_rest], above[has_rest]), msg
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, msg=msg)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6, msg=msg)
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-9, msg=msg)
