"""The end of a guarded layer in a captured hot-set step as three Triton launches: the
deterministic bound, the choice of the smaller bound, the flag, the pages' estimated
masses and the guard's tally row, the layer's output written where it goes, part 1's
page masses rescaled.

In: the exact part with the selection's reads merged in (``lse``, ``out``), the sampled
estimate of the rest with its bound (``combine``'s five results), the rest pages' logit
intervals (``page_lse``, ``logit_error``, ``value_norm``, ``[n, Hq, P]``), the
selection's masks, each row's threshold, and the part-1 output (the output of a row with
no rest).

1. ``_bound_kernel``, one program per row and head (grid ``(n, Hq)``): the head's term of
   the deterministic bound of leaving the unread rest out (``estimate.negligible_rest``:
   the unread pages' upper mass against the exact part's, their largest value norm), in
   one pass over the pages; head 0's program also counts the row's masks.
2. ``_choose_kernel``, grid ``(n, Hq)``: every program sums its row's terms and takes the
   same decision, the smaller of the two bounds (``guard_layer``'s ``min(B_det, B_stat)``;
   over the threshold the row is flagged), then writes its head's output and exact share
   where the layer's output goes (the part-1 output where the row has no rest) and the
   chosen lse; head 0's program writes the row's flag, its counts, flag and wanted count
   into the guard's tally row, and part 1's per-KV-head page masses (shares of part 1's
   own denominator) scaled by each KV head's mean share that part 1 holds of the chosen
   denominator (``exp(lse_1 - lse)``: not the exact share, which counts the selection's
   reads too), so they become shares of the chosen denominator, and their mean.
3. ``_masses_kernel``, grid ``(n, page blocks)``: each page's estimated share of the chosen
   denominator, largest over heads, and its wanted mark (1 where a layer wanted the page,
   2 where a flagged layer wanted it released), kept (max over layers) in the tally row.

The tally row (float64, one per batch row, for the step's one read-back):
``[mass (P) | wanted (P) | counts (5) | flagged (L) | wanted per layer (L)]``; the counts
are the layer's guard reads, pages read, estimated, missed and estimated-and-sampled
(added). One program per row walked every head's pages in turn until 2026-12-04: 0.64 ms
a layer on an H200 at 32K (45 % of the guarded captured step, ``profile_hot-20-guard``);
the rows' heads and page blocks now run side by side.

The torch code it replaces (``hot_set.guard.layer.weigh_bounds``, ``hot_set.graph.guard``'s
``keep_in_tally`` and the importance scaling of ``GraphGuard.attend``'s torch path) is its
reference in the tests. Reads per request and layer: the rest pages' three interval tensors
once and their log-masses again for the masses (Llama-3.1-8B at 32K, 32 query heads:
1 MiB), the tally row twice.

Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sgl_kernel_ext.guard_select import heads_by_pages
from sgl_kernel_ext.plan import next_power_of_2
from sgl_kernel_ext.scatter import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from sgl_kernel_ext.guard_select import _heads_by_pages

BLOCK_P = 1024  # pages a step of one head's pass covers
BLOCK_L = 64  # listed pages of part 1 a step of the importance scaling covers
# Counts in the tally row, after the masses and the wanted marks.
COUNTS = 5
# The bound kernel leaves each row six mask counts for the choice (``Counts + row * 6``):
# live, read, estimated, missed, estimated-and-sampled, wanted.


if HAS_TRITON:

    @triton.jit
    def _unread_upper(Valid, Read, PageLse, LogitError, flags, base, base_e, cols, pages, stride_p, stride_ep):
        """The rest pages left unread among ``cols`` and their upper log-masses (-inf elsewhere)."""
        inside = cols < pages
        keep = (tl.load(Valid + flags + cols, mask=inside, other=0) != 0) & (
            tl.load(Read + flags + cols, mask=inside, other=1) == 0
        )
        x = tl.load(PageLse + base + cols * stride_p, mask=keep, other=float("-inf")).to(tl.float32)
        e = tl.load(LogitError + base_e + cols * stride_ep, mask=keep, other=0.0).to(tl.float32)
        return keep, tl.where(keep, x + e, float("-inf"))

    @triton.jit
    def _bound_kernel(
        Lse, Out, PageLse, LogitError, ValueNorm, Valid, Read, Wanted, Missed, Sampled, Terms, Counts,
        hq, group, pages, dv,
        stride_n, stride_h, stride_p, stride_en, stride_eh, stride_ep, stride_vn, stride_vh, stride_vp,
        BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        neg_inf = float("-inf")
        offs = tl.arange(0, BLOCK_P)
        flags = row * pages
        base = row * stride_n + h * stride_h
        base_e = row * stride_en + h * stride_eh
        base_v = row * stride_vn + (h // group) * stride_vh
        # The unread rest's upper log-sum-exp (running max and rescaled sum) and largest value norm.
        m = tl.full([], neg_inf, tl.float32)
        den = tl.zeros([], tl.float32)
        largest = tl.zeros([], tl.float32)
        for p0 in range(0, pages, BLOCK_P):
            cols = p0 + offs
            keep, upper = _unread_upper(Valid, Read, PageLse, LogitError, flags, base, base_e, cols, pages,
                                        stride_p, stride_ep)  # fmt: skip
            v = tl.load(ValueNorm + base_v + cols * stride_vp, mask=keep, other=0.0).to(tl.float32)
            largest = tl.maximum(largest, tl.max(tl.where(keep, v, 0.0), axis=0))
            new_m = tl.maximum(m, tl.max(upper, axis=0))
            new_safe = tl.where(new_m > neg_inf, new_m, 0.0)
            den = den * tl.exp(m - new_safe) + tl.sum(tl.where(keep, tl.exp(upper - new_safe), 0.0), axis=0)
            m = new_m
        m_safe = tl.where(m > neg_inf, m, 0.0)
        lse_hi = m_safe + tl.log(tl.where(den > 0, den, 1.0))
        lse_e = tl.load(Lse + row * hq + h).to(tl.float32)
        alpha = tl.where(den > 0, tl.sigmoid(lse_hi - lse_e), 0.0)
        offs_d = tl.arange(0, BLOCK_DV)
        o = tl.load(Out + (row * hq + h) * dv + offs_d, mask=offs_d < dv, other=0.0).to(tl.float32)
        head_sq = tl.sum(o * o, axis=0)
        term = alpha * (largest + tl.sqrt(head_sq))
        tl.store(Terms + (row * hq + h) * 2, term * term)
        tl.store(Terms + (row * hq + h) * 2 + 1, head_sq)
        if h == 0:
            live_n = tl.zeros([], tl.int32)
            read_n = tl.zeros([], tl.int32)
            estimated_n = tl.zeros([], tl.int32)
            missed_n = tl.zeros([], tl.int32)
            sampled_n = tl.zeros([], tl.int32)
            wanted_n = tl.zeros([], tl.int32)
            for p0 in range(0, pages, BLOCK_P):
                cols = p0 + offs
                inside = cols < pages
                live = tl.load(Valid + flags + cols, mask=inside, other=0) != 0
                read = tl.load(Read + flags + cols, mask=inside, other=0) != 0
                estimated = live & ~read
                drawn = tl.load(Sampled + flags + cols, mask=inside, other=0) != 0
                live_n += tl.sum(live.to(tl.int32), axis=0)
                read_n += tl.sum(read.to(tl.int32), axis=0)
                estimated_n += tl.sum(estimated.to(tl.int32), axis=0)
                missed_n += tl.sum((tl.load(Missed + flags + cols, mask=inside, other=0) != 0).to(tl.int32), axis=0)
                sampled_n += tl.sum((estimated & drawn).to(tl.int32), axis=0)
                wanted_n += tl.sum((tl.load(Wanted + flags + cols, mask=inside, other=0) != 0).to(tl.int32), axis=0)
            c = Counts + row * 6
            tl.store(c + 0, live_n)
            tl.store(c + 1, read_n)
            tl.store(c + 2, estimated_n)
            tl.store(c + 3, missed_n)
            tl.store(c + 4, sampled_n)
            tl.store(c + 5, wanted_n)

    @triton.jit
    def _choose_kernel(
        Lse, Out, StatOut, StatLse, StatShare, StatRelative, Terms, Counts, Threshold, Part1, Part1Lse,
        Output, Share, Chosen, Flagged, Tally, PerKv, Importance,
        hq, group, dv, stride_threshold, stride_part1_n, stride_part1_h, stride_part1_lse, stride_tally,
        stride_out_n, stride_out_h, listed, stride_kn, stride_kl, stride_kh, pages, layer, layers,
        BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_KV: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        neg_inf = float("-inf")
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < hq
        # The row's decision, the same in each of its programs.
        terms = Terms + (row * hq + offs_h) * 2
        bound = tl.sqrt(tl.sum(tl.load(terms, mask=mask_h, other=0.0), axis=0))
        size = tl.sqrt(tl.sum(tl.load(terms + 1, mask=mask_h, other=0.0), axis=0))
        det = tl.where(bound < size, bound / (size - bound), float("inf"))
        det = tl.where(bound == 0, 0.0, det)
        stat = tl.load(StatRelative + row).to(tl.float32)
        use_det = det <= stat
        relative = tl.where(use_det, det, stat)
        flagged = relative > tl.load(Threshold + row * stride_threshold).to(tl.float32)
        has_rest = tl.load(Counts + row * 6) > 0
        # This head's output, exact share and chosen lse.
        rh = row * hq + h
        offs_d = tl.arange(0, BLOCK_DV)
        mask_d = offs_d < dv
        lse_e = tl.load(Lse + rh).to(tl.float32)
        lse_c = tl.where(use_det, tl.where(lse_e > neg_inf, lse_e, 0.0), tl.load(StatLse + rh).to(tl.float32))
        o = tl.where(
            use_det,
            tl.load(Out + rh * dv + offs_d, mask=mask_d, other=0.0),
            tl.load(StatOut + rh * dv + offs_d, mask=mask_d, other=0.0),
        ).to(tl.float32)
        first = tl.load(Part1 + row * stride_part1_n + h * stride_part1_h + offs_d, mask=mask_d, other=0.0)
        o = tl.where(has_rest, o, first.to(tl.float32))
        tl.store(Output + row * stride_out_n + h * stride_out_h + offs_d, o.to(Output.dtype.element_ty), mask=mask_d)
        share = tl.where(use_det, 1.0, tl.load(StatShare + rh).to(tl.float32))
        tl.store(Share + rh, tl.where(has_rest, share, 1.0))
        tl.store(Chosen + rh, lse_c)
        if h == 0:
            tl.store(Flagged + row, flagged)
            # The counts, the flag and the wanted count of this layer.
            counts = Counts + row * 6
            read_n = tl.load(counts + 1)
            c = Tally + row * stride_tally + 2 * pages
            tl.store(c + 0, tl.load(c + 0) + (read_n > 0).to(tl.float64))
            tl.store(c + 1, tl.load(c + 1) + read_n.to(tl.float64))
            tl.store(c + 2, tl.load(c + 2) + tl.load(counts + 2).to(tl.float64))
            tl.store(c + 3, tl.load(c + 3) + tl.load(counts + 3).to(tl.float64))
            tl.store(c + 4, tl.load(c + 4) + tl.load(counts + 4).to(tl.float64))
            f = c + 5 + layer
            tl.store(f, tl.maximum(tl.load(f), flagged.to(tl.float64)))
            tl.store(c + 5 + layers + layer, tl.load(counts + 5).to(tl.float64))
            # Part 1's share of the chosen denominator per head (its lse -inf: none), each KV
            # head's mean over its group, and part 1's per-KV-head masses scaled by it.
            lse_v = tl.load(Lse + row * hq + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            stat_v = tl.load(StatLse + row * hq + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            chosen_v = tl.where(use_det, tl.where(lse_v > neg_inf, lse_v, 0.0), stat_v)
            lse_1 = tl.load(Part1Lse + row * stride_part1_lse + offs_h, mask=mask_h, other=neg_inf).to(tl.float32)
            own = tl.where(lse_1 > neg_inf, tl.minimum(tl.exp(lse_1 - chosen_v), 1.0), 0.0)
            own = tl.where(mask_h, tl.where(has_rest, own, 1.0), 0.0)
            offs_kv = tl.arange(0, BLOCK_KV)
            in_group = (offs_h[None, :] // group) == offs_kv[:, None]
            kv_share = tl.sum(tl.where(in_group, own[None, :], 0.0), axis=1) / group
            kv_heads = hq // group
            offs_l = tl.arange(0, BLOCK_L)
            for l0 in range(0, listed, BLOCK_L):
                cols = l0 + offs_l
                tile = (cols[:, None] < listed) & (offs_kv[None, :] < kv_heads)
                ptr = PerKv + row * stride_kn + cols[:, None] * stride_kl + offs_kv[None, :] * stride_kh
                scaled = tl.load(ptr, mask=tile, other=0.0).to(tl.float32) * kv_share[None, :]
                tl.store(ptr, scaled.to(PerKv.dtype.element_ty), mask=tile)
                tl.store(Importance + row * listed + cols, tl.sum(scaled, axis=1) / kv_heads, mask=cols < listed)

    @triton.jit
    def _masses_kernel(
        PageLse, Valid, Wanted, Missed, Chosen, Flagged, Tally,
        hq, pages, stride_n, stride_h, stride_p, stride_tally,
        BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        inside = cols < pages
        flags = row * pages
        t_row = Tally + row * stride_tally
        # The wanted marks: 1 wanted, 2 wanted released by a flagged layer (max over layers).
        want = tl.load(Wanted + flags + cols, mask=inside, other=0) != 0
        miss = tl.load(Missed + flags + cols, mask=inside, other=0) != 0
        flagged = tl.load(Flagged + row).to(tl.int32)
        mark = want.to(tl.float64) + (miss.to(tl.int32) * flagged).to(tl.float64)
        old = tl.load(t_row + pages + cols, mask=inside, other=0.0)
        tl.store(t_row + pages + cols, tl.maximum(old, mark), mask=inside)
        # Each live page's share of the chosen denominator, largest over heads.
        live = tl.load(Valid + flags + cols, mask=inside, other=0) != 0
        offs_h = tl.arange(0, BLOCK_H)
        chosen = tl.load(Chosen + row * hq + offs_h, mask=offs_h < hq, other=0.0)
        x, tile = _heads_by_pages(PageLse, row, cols, live, hq, stride_n, stride_h, stride_p, BLOCK_H)
        mass = tl.max(tl.where(tile, tl.exp(x - chosen[:, None]), 0.0), axis=0).to(tl.float64)
        old = tl.load(t_row + cols, mask=inside, other=0.0)
        tl.store(t_row + cols, tl.maximum(old, mass), mask=inside)


def guard_finish_triton(
    lse: torch.Tensor,
    out: torch.Tensor,
    statistical: Sequence[torch.Tensor],
    intervals: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    threshold: torch.Tensor,
    part1: torch.Tensor,
    part1_lse: torch.Tensor,
    tally: torch.Tensor,
    output: torch.Tensor,
    per_kv: torch.Tensor,
    *,
    layer: int,
    layers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three Triton launches (GPU; CPU tensors under ``TRITON_INTERPRET=1``): see the module docstring.

    Args:
        lse, out: ``[n, Hq]``, ``[n, Hq, Dv]`` the exact part with the reads merged in.
        statistical: ``combine``'s ``(output, lse, exact_share, bound, relative)``.
        intervals: ``(page_lse, logit_error, value_norm)``, ``[n, Hq, P]``, ``[n, Hq, P]``,
            ``[n, Hkv, P]`` (any strides; ``estimate.Outside``).
        masks: bool ``(valid, read, wanted, missed, sampled)``, ``[n, P]`` each.
        threshold: ``[n]`` each row's guard threshold (any stride).
        part1: ``[n, Hq, Dv]`` the part-1 output (the output of a row with no rest);
        part1_lse: ``[n, Hq]`` its lse (unit stride over heads).
        tally: float64 ``[n, >= 2P + 5 + 2L]``, updated in place (its rows' stride any).
        output: ``[n, Hq, Dv]`` where the layer's output goes (SGLang's; any float dtype,
            unit stride in its last dimension), written.
        per_kv: ``[n, pages listed, Hkv]`` part 1's per-KV-head page masses, scaled in place
            by each KV head's mean share part 1 holds of the chosen denominator (they become
            shares of it).

    Returns:
        (exact share ``[n, Hq]`` float32, flagged bool ``[n]``, part 1's page masses, the
        mean of ``per_kv`` over KV heads ``[n, pages listed]`` float32).
    """
    if not HAS_TRITON:
        raise RuntimeError("guard_finish_triton needs Triton")
    n, hq, dv = out.shape
    page_lse, logit_error, value_norm = intervals
    pages = page_lse.shape[-1]
    same = logit_error.shape == page_lse.shape and value_norm.shape[::2] == page_lse.shape[::2]
    heads = lse.shape == (n, hq) and page_lse.shape[:2] == (n, hq) and hq % value_norm.shape[1] == 0
    if not (same and heads) or any(m.shape != (n, pages) for m in masks):
        raise ValueError(
            f"shapes do not match: out {tuple(out.shape)}, lse {tuple(lse.shape)}, page_lse {tuple(page_lse.shape)}, "
            f"masks {[tuple(m.shape) for m in masks]}"
        )
    if tally.dtype != torch.float64 or tally.shape[1] < 2 * pages + COUNTS + 2 * layers or tally.stride(1) != 1:
        raise ValueError(f"the tally must be float64 [n, >= {2 * pages + COUNTS + 2 * layers}] with unit column stride")
    kv_heads = per_kv.shape[2]
    if output.shape != out.shape or output.stride(-1) != 1 or per_kv.shape[0] != n or hq % kv_heads:
        raise ValueError(f"output {tuple(output.shape)}, per_kv {tuple(per_kv.shape)}: out is {tuple(out.shape)}")
    dev = out.device
    share = torch.empty(n, hq, dtype=torch.float32, device=dev)
    flagged = torch.empty(n, dtype=torch.bool, device=dev)
    listed = per_kv.shape[1]
    importance = torch.empty(n, listed, dtype=torch.float32, device=dev)
    if n == 0:
        return share, flagged, importance
    lse, out, stat_out, stat_lse, stat_share, _, stat_relative, *masks = [
        t.contiguous() for t in (lse, out, *statistical, *masks)
    ]  # each already is as the step calls it
    valid, read, wanted, missed, sampled = masks
    if part1.stride(-1) != 1:
        part1 = part1.contiguous()
    if part1_lse.shape != (n, hq) or part1_lse.stride(1) != 1:
        raise ValueError(f"part1_lse must be [{n}, {hq}] with unit stride over heads, got {tuple(part1_lse.shape)}")
    terms = torch.empty(n, hq, 2, dtype=torch.float32, device=dev)
    counts = torch.empty(n, 6, dtype=torch.int32, device=dev)
    chosen = torch.empty(n, hq, dtype=torch.float32, device=dev)
    group = hq // value_norm.shape[1]
    block_dv, block_h = next_power_of_2(dv), next_power_of_2(hq)
    _bound_kernel[(n, hq)](
        lse, out, page_lse, logit_error, value_norm, valid, read, wanted, missed, sampled, terms, counts,
        hq, group, pages, dv, *page_lse.stride(), *logit_error.stride(), *value_norm.stride(),
        BLOCK_P=min(BLOCK_P, next_power_of_2(pages)), BLOCK_DV=block_dv,
    )  # fmt: skip
    _choose_kernel[(n, hq)](
        lse, out, stat_out, stat_lse, stat_share, stat_relative, terms, counts, threshold, part1, part1_lse,
        output, share, chosen, flagged, tally, per_kv, importance,
        hq, group, dv, threshold.stride(0), part1.stride(0), part1.stride(1), part1_lse.stride(0), tally.stride(0),
        output.stride(0), output.stride(1), listed, *per_kv.stride(), pages, layer, layers,
        BLOCK_H=block_h, BLOCK_DV=block_dv, BLOCK_L=BLOCK_L, BLOCK_KV=next_power_of_2(kv_heads),
    )  # fmt: skip
    grid, _, block_p = heads_by_pages(n, hq, pages)  # one program with nothing to do when no page is listed
    _masses_kernel[grid](
        page_lse, valid, wanted, missed, chosen, flagged, tally, hq, pages, *page_lse.stride(), tally.stride(0),
        BLOCK_H=block_h, BLOCK_P=block_p,
    )  # fmt: skip
    return share, flagged, importance
