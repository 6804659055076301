"""The hot-set guard's selection as three Triton launches, with no sort: the GPU form of
``sgl_importance.hot_set.guard.layer``'s ``wanted_pages`` and ``capped``.

Per request, over its ``P`` rest pages and their log-masses estimated from the key codes:

- **top-p** (grid ``(n, Hq)``): each query head wants the fewest pages, largest first,
  that with the exact part's share reach ``top_p`` of the total. A page of share ``s``
  is wanted while the exact share and every larger page's fall short of ``top_p``; that
  sum only grows as ``s`` falls, so the wanted pages are those at or above one threshold.
  The threshold is found by bisection on the pages' log-masses read as ordered integers
  (a float32's bits, the negative ones flipped, sort as the floats do): 34 passes over
  the head's pages, each summing the shares above the midpoint; exact, with no sort and
  no data-dependent shape. Out: each head's threshold and log total.
- **wanted** (grid ``(n, page blocks)``, every head of a block of pages at once): a page
  any head wants; those released are *missed*; the others are the candidates, ranked by
  their largest log-mass over the heads. (One program per row walked the heads in turn
  until 2026-12-04: 65 us a layer on an H200 at 32K.)
- **the cap** (grid ``(n,)``): the ``cap`` candidates of largest rank, by the same
  bisection on a count (ties at the last place go to the lower column).

Pages within rounding of the top-p boundary may land on either side of it against a
sort's cumulative sum (the sums run in another order); otherwise the sets are the
torch code's (``hot_set/guard/layer.py``, the reference the tests hold this to). What it reads per
request and layer (Llama-3.1-8B at 32K: 2,048 pages, 32 query heads): each head's page
log-masses four times (1 MiB; dense reads 128 MiB of KV there), the flags, and the ranks
a few times (8 KiB); up to
``MAX_SINGLE`` pages a program holds its row in registers through the 34 bisection steps,
which are then reductions, not reads. On an H200 at 32K (2026-12-04, in the captured step):
top-p 15 us, wanted 65 us (before the page blocks), the cap 21 us a layer.

Nothing here imports SGLang.
"""

from __future__ import annotations

import torch

from sgl_kernel_ext.plan import cdiv, next_power_of_2
from sgl_kernel_ext.scatter import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

# Pages one program reads at a time; a row of up to MAX_SINGLE pages (128K tokens at
# page 16) is read once and held in registers through the bisection.
BLOCK_P = 256
MAX_SINGLE = 8192
TILE = 4096  # heads x pages a program holds at once (the wanted pages, guard_finish's masses)


def heads_by_pages(n: int, hq: int, pages: int) -> tuple[tuple[int, int], int, int]:
    """The grid and blocks of a kernel that holds every head of a block of pages at once
    (``_heads_by_pages``): ``((n, page blocks), BLOCK_H, BLOCK_P)``; at least one block."""
    block_h = next_power_of_2(hq)
    block_p = max(16, min(TILE // block_h, next_power_of_2(pages)))
    return (n, max(1, cdiv(pages, block_p))), block_h, block_p


# Bisection steps: the ordered-integer range of a float32 is 2^32 wide (+2 sentinels).
STEPS = 34


if HAS_TRITON:

    @triton.jit
    def _ordered(x):
        """A float32's bits as an int64 that sorts as the floats do (negatives flipped)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)

    @triton.jit
    def _top_p_kernel(
        Lse,
        PageLse,
        Valid,
        TopP,
        Threshold,
        Total,
        hq,
        pages,
        stride_n,
        stride_h,
        stride_p,
        stride_top_p,
        STEPS: tl.constexpr,
        BLOCK_P: tl.constexpr,
        SINGLE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        neg_inf = float("-inf")
        offs = tl.arange(0, BLOCK_P)
        base = PageLse + row * stride_n + head * stride_h
        # Pass 1: the largest log-mass and the ordered range of the valid pages.
        m = tl.full([], neg_inf, tl.float32)
        lo = tl.full([], 2**31, tl.int64)
        hi = tl.full([], -(2**31) - 1, tl.int64)
        for p0 in range(0, pages, BLOCK_P):
            cols = p0 + offs
            live = tl.load(Valid + row * pages + cols, mask=cols < pages, other=0) != 0
            x = tl.load(base + cols * stride_p, mask=live, other=neg_inf).to(tl.float32)
            m = tl.maximum(m, tl.max(x, axis=0))
            key = _ordered(x)
            lo = tl.minimum(lo, tl.min(tl.where(live, key, 2**31), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(live, key, -(2**31) - 1), axis=0))
        # Pass 2: the rest's denominator, then the total with the exact part's.
        m_safe = tl.where(m > neg_inf, m, 0.0)
        den = tl.zeros([], tl.float32)
        for p0 in range(0, pages, BLOCK_P):
            cols = p0 + offs
            live = tl.load(Valid + row * pages + cols, mask=cols < pages, other=0) != 0
            x = tl.load(base + cols * stride_p, mask=live, other=neg_inf).to(tl.float32)
            den += tl.sum(tl.where(live, tl.exp(x - m_safe), 0.0), axis=0)
        lse_e = tl.load(Lse + row * hq + head).to(tl.float32)
        lse_r = tl.where(den > 0, m_safe + tl.log(tl.where(den > 0, den, 1.0)), neg_inf)
        big = tl.maximum(lse_e, lse_r)
        big_safe = tl.where(big > neg_inf, big, 0.0)
        total = big_safe + tl.log(tl.exp(lse_e - big_safe) + tl.exp(lse_r - big_safe))
        total = tl.where(big > neg_inf, total, 0.0)
        held = tl.where(lse_e > neg_inf, tl.exp(lse_e - total), 0.0)
        top_p = tl.load(TopP + row * stride_top_p).to(tl.float32)
        # Bisection: the smallest t whose pages above it leave the head short of top_p
        # (held plus their shares < top_p); hi + 1 stands for "no page at all".
        lo = lo - 1
        hi = hi + 1
        if SINGLE:  # the head's pages held in registers across the steps
            live = tl.load(Valid + row * pages + offs, mask=offs < pages, other=0) != 0
            x = tl.load(base + offs * stride_p, mask=live, other=neg_inf).to(tl.float32)
            key = _ordered(x)
            share = tl.where(live, tl.exp(x - total), 0.0)
            for _ in range(STEPS):
                mid = lo + (hi - lo) // 2
                short = held + tl.sum(tl.where(key > mid, share, 0.0), axis=0) < top_p
                go = lo < hi
                hi = tl.where(go & short, mid, hi)
                lo = tl.where(go & ~short, mid + 1, lo)
        else:
            for _ in range(STEPS):
                mid = lo + (hi - lo) // 2
                above = tl.zeros([], tl.float32)
                for p0 in range(0, pages, BLOCK_P):
                    cols = p0 + offs
                    live = tl.load(Valid + row * pages + cols, mask=cols < pages, other=0) != 0
                    x = tl.load(base + cols * stride_p, mask=live, other=neg_inf).to(tl.float32)
                    above += tl.sum(tl.where(live & (_ordered(x) > mid), tl.exp(x - total), 0.0), axis=0)
                short = held + above < top_p
                go = lo < hi
                hi = tl.where(go & short, mid, hi)
                lo = tl.where(go & ~short, mid + 1, lo)
        tl.store(Threshold + row * hq + head, lo)
        tl.store(Total + row * hq + head, total)

    @triton.jit
    def _heads_by_pages(PageLse, row, cols, live, hq, stride_n, stride_h, stride_p, BLOCK_H: tl.constexpr):
        """Every head's log-masses of the live pages among ``cols`` (-inf elsewhere), heads x
        pages, and where they are."""
        offs_h = tl.arange(0, BLOCK_H)
        tile = (offs_h < hq)[:, None] & live[None, :]
        ptr = PageLse + row * stride_n + offs_h[:, None] * stride_h + cols[None, :] * stride_p
        return tl.load(ptr, mask=tile, other=float("-inf")).to(tl.float32), tile

    @triton.jit
    def _wanted_kernel(
        PageLse, Valid, Released, Threshold, Total, Wanted, Missed, Rank,
        hq, pages, stride_n, stride_h, stride_p,
        BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        neg_inf = float("-inf")
        inside = cols < pages
        live = tl.load(Valid + row * pages + cols, mask=inside, other=0) != 0
        gone = tl.load(Released + row * pages + cols, mask=inside, other=0) != 0
        x, tile = _heads_by_pages(PageLse, row, cols, live, hq, stride_n, stride_h, stride_p, BLOCK_H)
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < hq
        t = tl.load(Threshold + row * hq + offs_h, mask=mask_h, other=0)
        total = tl.load(Total + row * hq + offs_h, mask=mask_h, other=0.0)
        wants = tile & (_ordered(x) >= t[:, None]) & (tl.exp(x - total[:, None]) > 0)
        want = tl.max(wants.to(tl.int32), axis=0) != 0
        rank = tl.max(x, axis=0)
        tl.store(Wanted + row * pages + cols, want, mask=inside)
        tl.store(Missed + row * pages + cols, want & gone, mask=inside)
        tl.store(Rank + row * pages + cols, tl.where(want & ~gone, rank, neg_inf), mask=inside)

    @triton.jit
    def _candidates(Rank, row, pages, cols):
        """The candidates among ``cols`` and their ranks as ordered integers: the wanted
        kernel leaves a rank only on a wanted page still on the device (a wanted page has a
        finite log-mass in some head), -inf elsewhere."""
        rank = tl.load(Rank + row * pages + cols, mask=cols < pages, other=float("-inf"))
        return rank > float("-inf"), _ordered(rank)

    @triton.jit
    def _cap_kernel(
        Rank,
        Cap,
        Read,
        pages,
        stride_cap,
        STEPS: tl.constexpr,
        BLOCK_P: tl.constexpr,
        SINGLE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_P)
        cap = tl.load(Cap + row * stride_cap).to(tl.int64)
        # The ordered range of the candidates' ranks.
        lo = tl.full([], 2**31, tl.int64)
        hi = tl.full([], -(2**31) - 1, tl.int64)
        for p0 in range(0, pages, BLOCK_P):
            chosen, key = _candidates(Rank, row, pages, p0 + offs)
            lo = tl.minimum(lo, tl.min(tl.where(chosen, key, 2**31), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(chosen, key, -(2**31) - 1), axis=0))
        # Bisection: the largest t with at least ``cap`` candidates at or above it (the
        # cap-th largest rank); lo - 1 when there are fewer: every candidate is read.
        lo = lo - 1
        if SINGLE:  # the row's candidates held in registers across the steps
            chosen, key = _candidates(Rank, row, pages, offs)
            for _ in range(STEPS):
                mid = lo + (hi - lo + 1) // 2
                enough = tl.sum((chosen & (key >= mid)).to(tl.int64), axis=0) >= cap
                go = lo < hi
                lo = tl.where(go & enough, mid, lo)
                hi = tl.where(go & ~enough, mid - 1, hi)
        else:
            for _ in range(STEPS):
                mid = lo + (hi - lo + 1) // 2
                count = tl.zeros([], tl.int64)
                for p0 in range(0, pages, BLOCK_P):
                    chosen, key = _candidates(Rank, row, pages, p0 + offs)
                    count += tl.sum((chosen & (key >= mid)).to(tl.int64), axis=0)
                enough = count >= cap
                go = lo < hi
                lo = tl.where(go & enough, mid, lo)
                hi = tl.where(go & ~enough, mid - 1, hi)
        # Read: every candidate above the cut, and at the cut the lowest columns up to the cap.
        above = tl.zeros([], tl.int64)
        for p0 in range(0, pages, BLOCK_P):
            chosen, key = _candidates(Rank, row, pages, p0 + offs)
            above += tl.sum((chosen & (key > lo)).to(tl.int64), axis=0)
        room = cap - above
        taken = tl.zeros([], tl.int64)
        for p0 in range(0, pages, BLOCK_P):
            cols = p0 + offs
            chosen, key = _candidates(Rank, row, pages, cols)
            tie = chosen & (key == lo)
            order = taken + tl.cumsum(tie.to(tl.int64), axis=0)  # 1-based among the ties
            read = chosen & ((key > lo) | (tie & (order <= room)))
            tl.store(Read + row * pages + cols, read, mask=cols < pages)
            taken += tl.sum(tie.to(tl.int64), axis=0)


def guard_select_triton(
    lse: torch.Tensor,
    page_lse: torch.Tensor,
    valid: torch.Tensor,
    released: torch.Tensor,
    top_p: torch.Tensor,
    cap: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The guard's selection in three Triton launches (GPU; CPU tensors under
    ``TRITON_INTERPRET=1``): ``(wanted, missed, read)``, bool ``[n, P]`` each, as
    ``guard.wanted_pages`` then ``guard.capped`` choose them (their torch code is the reference).

    Args:
        lse: ``[n, Hq]`` the exact part's log denominator.
        page_lse: ``[n, Hq, P]`` the rest pages' estimated log-masses (any strides).
        valid, released: bool ``[n, P]``; top_p: ``[n]``; cap: int ``[n]`` (any
            stride: a column of a wider buffer).
    """
    if not HAS_TRITON:
        raise RuntimeError("guard_select_triton needs Triton")
    n, hq, pages = page_lse.shape
    if lse.shape != (n, hq) or valid.shape != (n, pages) or released.shape != (n, pages):
        raise ValueError(
            f"shapes do not match: lse {tuple(lse.shape)}, page_lse {tuple(page_lse.shape)}, "
            f"valid {tuple(valid.shape)}, released {tuple(released.shape)}"
        )
    lse, valid, released = lse.contiguous(), valid.contiguous(), released.contiguous()  # no-ops as the step calls it
    dev = page_lse.device
    wanted = torch.empty(n, pages, dtype=torch.bool, device=dev)
    missed = torch.empty_like(wanted)
    read = torch.empty_like(wanted)
    if n == 0 or pages == 0:
        return wanted.zero_(), missed.zero_(), read.zero_()
    threshold = torch.empty(n, hq, dtype=torch.int64, device=dev)
    total = torch.empty(n, hq, dtype=torch.float32, device=dev)
    rank = torch.empty(n, pages, dtype=torch.float32, device=dev)
    strides = page_lse.stride()
    # A row of up to MAX_SINGLE pages is held in registers through the bisection.
    single = pages <= MAX_SINGLE
    block = next_power_of_2(pages) if single else BLOCK_P
    warps = 8 if block >= 2048 else 4
    _top_p_kernel[(n, hq)](
        lse, page_lse, valid, top_p, threshold, total, hq, pages, *strides, top_p.stride(0),
        STEPS=STEPS, BLOCK_P=block, SINGLE=single, num_warps=warps,
    )  # fmt: skip
    grid, block_h, block_p = heads_by_pages(n, hq, pages)
    _wanted_kernel[grid](
        page_lse, valid, released, threshold, total, wanted, missed, rank, hq, pages, *strides,
        BLOCK_H=block_h, BLOCK_P=block_p,
    )  # fmt: skip
    _cap_kernel[(n,)](
        rank, cap, read, pages, cap.stride(0), STEPS=STEPS, BLOCK_P=block, SINGLE=single,
        num_warps=warps,
    )  # fmt: skip
    return wanted, missed, read
