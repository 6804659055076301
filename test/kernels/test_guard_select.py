"""The guard's selection kernels (``guard_select_triton``: top-p by bisection, the wanted and
missed pages, the cap) against the torch code they replace in a captured step
(``guard.select_pages``' torch code: ``wanted_pages`` then ``capped``).

Under TRITON_INTERPRET=1 on a CPU (conftest.py): small shapes, one that tiles the pages
twice, invalid and released pages, caps of 0, inside and past the candidates, top-p of
1, exact parts that alone reach top-p, strided views as the captured step passes them.
Where a page's cumulative share lies within rounding of top-p the two may differ (the
sums run in other orders); the draws nudge top-p off such points and say so. Fresh
random numbers each run (seed in every failure message; pin one with KERNEL_TEST_SEED).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton guard kernels cannot run")

from sgl_importance.hot_set.guard.layer import select_pages  # noqa: E402
from sgl_kernel_ext import guard_select, guard_select_triton  # noqa: E402
from support.kernel_device import DEVICE  # noqa: E402

CLEARANCE = 1e-5  # a page's cumulative share this near top-p may land either side


def _seed() -> int:
    return int(os.environ.get("KERNEL_TEST_SEED", random.randrange(2**31)))


def reference(*args):
    return select_pages(*args, use_triton=False)


def boundary_gap(lse, page_lse, valid, top_p) -> torch.Tensor:
    """``[n]`` how near any head's cumulative share (held + larger pages, per page) comes to top-p."""
    rest = page_lse.masked_fill(~valid[:, None, :], float("-inf"))
    total = torch.logaddexp(lse, torch.logsumexp(rest, dim=-1))
    total = torch.where(torch.isfinite(total), total, 0.0)
    share = torch.exp(rest - total[..., None])
    held = torch.exp(lse - total).nan_to_num(0.0)
    ordered = share.sort(dim=-1, descending=True).values
    before = held[..., None] + ordered.cumsum(dim=-1) - ordered
    gap = (before - top_p[:, None, None]).abs().masked_fill(ordered <= 0, float("inf"))
    return gap.flatten(1).amin(dim=1)


def draw(n, hq, pages, *, seed, top_p=None, spread=2.0, released=0.2, invalid=0.15):
    gen = torch.Generator().manual_seed(seed)
    page_lse = torch.randn(n, hq, pages, generator=gen) * spread
    lse = torch.randn(n, hq, generator=gen) * spread + 1.0
    valid = torch.rand(n, pages, generator=gen) >= invalid
    gone = (torch.rand(n, pages, generator=gen) < released) & valid
    if top_p is None:
        top_p = 0.5 + 0.45 * torch.rand(n, generator=gen)
    else:
        top_p = torch.full((n,), float(top_p))
    for _ in range(50):  # off the rounding points (top-p of 1 is kept: its draws stay clear)
        near = boundary_gap(lse, page_lse, valid, top_p) < CLEARANCE
        if not near.any() or (top_p >= 1.0).all():
            break
        top_p = torch.where(near & (top_p < 1.0), top_p - 3e-4, top_p)
    cap = torch.randint(0, pages + 2, (n,), generator=gen)
    return lse, page_lse, valid, gone, top_p, cap


def check(args, seed, what):
    lse, page_lse, valid, gone, top_p, cap = args
    assert (boundary_gap(lse, page_lse, valid, top_p) >= CLEARANCE).all(), f"seed={seed} {what}: a draw on a boundary"
    got = guard_select_triton(*(t.to(DEVICE) for t in args))
    want = reference(*args)
    for name, g, w in zip(("wanted", "missed", "read"), got, want):
        assert g.dtype == torch.bool and g.shape == w.shape, f"seed={seed} {what} {name}"
        assert torch.equal(g.cpu(), w), f"seed={seed} {what} {name}: {g.cpu().int()} != {w.int()}"
    read = got[2].cpu()
    assert (read.sum(dim=1) <= cap).all() and not (read & gone).any(), f"seed={seed} {what}"


@pytest.fixture(params=["held-in-registers", "read-by-blocks"])
def rows_by_blocks(request, monkeypatch):
    """Both forms of the bisection: a row held whole, and (rows past ``MAX_SINGLE`` pages,
    lowered here so that small rows take it) one read block by block every step; in the
    second the wanted kernel's page blocks are narrowed too (``TILE``), so rows span several."""
    if request.param == "read-by-blocks":
        monkeypatch.setattr(guard_select, "MAX_SINGLE", 4)
        monkeypatch.setattr(guard_select, "TILE", 64)
    return request.param


@pytest.mark.parametrize(
    "n,hq,pages",
    [(3, 2, 5), (2, 8, 70), (2, 4, 300)],
    ids=["few-pages", "gqa-heads", "pages-tiled-twice"],
)
def test_the_selection_kernels_choose_the_torch_selections_pages(n, hq, pages, rows_by_blocks):
    seed = _seed()
    check(draw(n, hq, pages, seed=seed), seed, f"n={n} hq={hq} pages={pages}")


def test_at_top_p_one_every_page_with_mass_is_wanted_and_the_cap_still_holds():
    seed = _seed()
    args = draw(3, 4, 40, seed=seed, top_p=1.0, spread=0.5)
    check(args, seed, "top-p 1")
    wanted = guard_select_triton(*(t.to(DEVICE) for t in args))[0].cpu()
    assert torch.equal(wanted, args[2]), f"seed={seed}: every valid page is wanted at top-p 1"


def test_an_exact_part_that_reaches_top_p_alone_wants_nothing_and_empty_rows_read_nothing():
    seed = _seed()
    lse, page_lse, valid, gone, top_p, cap = draw(3, 2, 20, seed=seed)
    lse[0] = 50.0  # the exact part holds every head's mass
    valid[1] = False  # no rest at all
    cap[:] = 20
    args = (lse, page_lse, valid, gone, top_p, cap)
    wanted, missed, read = (t.cpu() for t in guard_select_triton(*(t.to(DEVICE) for t in args)))
    assert not wanted[:2].any() and not missed[:2].any() and not read[:2].any(), f"seed={seed}"
    assert wanted[2].any(), f"seed={seed}"


def test_the_cap_takes_the_largest_pages_and_breaks_ties_to_the_lower_column(rows_by_blocks):
    # Every page wanted (top-p 1); columns 1, 3, 4, 6 tie at the largest mass, 0 released.
    page_lse = torch.zeros(1, 2, 8)
    page_lse[0, 0] = torch.tensor([5.0, 3.0, -1.0, 3.0, 3.0, 0.0, 3.0, 1.0])
    valid = torch.ones(1, 8, dtype=torch.bool)
    gone = torch.zeros(1, 8, dtype=torch.bool)
    gone[0, 0] = True
    lse, top_p = torch.full((1, 2), -30.0), torch.ones(1)
    for cap, want in ((0, []), (2, [1, 3]), (3, [1, 3, 4]), (5, [1, 3, 4, 6, 7]), (9, [1, 2, 3, 4, 5, 6, 7])):
        args = (lse, page_lse, valid, gone, top_p, torch.tensor([cap]))
        _, missed, read = (t.cpu() for t in guard_select_triton(*(t.to(DEVICE) for t in args)))
        assert read[0].nonzero().flatten().tolist() == want, f"cap {cap}"
        assert torch.equal(read, reference(*args)[2]), f"cap {cap}: the torch code's ties"
        assert missed[0].nonzero().flatten().tolist() == [0]


def test_the_selection_kernels_read_strided_views_as_the_captured_step_passes_them():
    # page_lse from the estimate's head reshape (not contiguous), top-p and the cap columns of
    # the step's per-layer buffers.
    seed = _seed()
    lse, page_lse, valid, gone, top_p, cap = draw(3, 4, 33, seed=seed)
    heads_first = page_lse.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    params = torch.zeros(3, 5)
    params[:, 2] = top_p
    caps = torch.zeros(3, 4, dtype=torch.int64)
    caps[:, 1] = cap
    assert not heads_first.is_contiguous()
    check((lse, heads_first, valid, gone, params[:, 2], caps[:, 1]), seed, "strided")


def test_the_selection_kernels_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        guard_select_triton(
            torch.zeros(2, 3), torch.zeros(2, 3, 5), torch.ones(2, 4, dtype=torch.bool),
            torch.zeros(2, 5, dtype=torch.bool), torch.ones(2), torch.ones(2, dtype=torch.int64),
        )  # fmt: skip
