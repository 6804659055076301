"""The end of a guarded layer in a captured hot-set step as one Triton launch: the
deterministic bound, the choice of the smaller bound, the flag, the pages' estimated
masses and the guard's tally row, the layer's output written where it goes, part 1's
page masses rescaled.

In: the exact part with the selection's reads merged in (``lse``, ``out``), the sampled
estimate of the rest with its bound (``combine``'s five results), the rest pages' logit
intervals (``page_lse``, ``logit_error``, ``value_norm``, ``[n, Hq, P]``), the
selection's masks, each row's threshold, and the part-1 output (the output of a row with
no rest). One program per row (grid ``(n,)``):

1. the deterministic bound of leaving the unread rest out (``estimate.negligible_rest``:
   the unread pages' upper mass against the exact part's, their largest value norm);
2. the smaller of the two bounds chooses the output, its lse and the exact share
   (``guard_layer``'s ``min(B_det, B_stat)``); over the threshold the row is flagged;
3. the row's output and exact share written where the layer's output goes (the part-1
   output where the row has no rest);
4. the guard's tally row (float64, one per batch row, for the step's one read-back):
   ``[mass (P) | wanted (P) | counts (5) | flagged (L) | wanted per layer (L)]``: the
   pages' estimated share of the chosen denominator, largest over heads (max over
   layers); 1 where a layer wanted the page, 2 where a flagged layer wanted it released
   (max); the layer's guard reads, pages read, estimated, missed and estimated-and-sampled
   (added); the layer's flag; its wanted count;
5. part 1's per-KV-head page masses (shares of part 1's own denominator) scaled by each KV
   head's mean share that part 1 holds of the chosen denominator (``exp(lse_1 - lse)``: not the
   exact share, which counts the selection's reads too), so they become shares of the chosen
   denominator, for the importance table and the step's tally; and their mean.

The torch code it replaces (``hot_set.guard.layer.weigh_bounds``, ``hot_set.graph.guard``'s
``keep_in_tally`` and the importance scaling of ``GraphGuard.attend``'s torch path) is its
reference in the tests. Reads per
request and layer: the rest pages' three interval tensors once and their log-masses
again for the masses (Llama-3.1-8B at 32K, 32 query heads: 1 MiB), the tally row twice.

Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sgl_kernel_ext.plan import next_power_of_2
from sgl_kernel_ext.scatter import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

BLOCK_P = 128
BLOCK_L = 64  # listed pages of part 1 a step of the importance scaling covers
# Counts in the tally row, after the masses and the wanted marks.
COUNTS = 5


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
    def _finish_kernel(
        Lse,
        Out,
        StatOut,
        StatLse,
        StatShare,
        StatBound,
        StatRelative,
        PageLse,
        LogitError,
        ValueNorm,
        Valid,
        Read,
        Wanted,
        Missed,
        Sampled,
        Threshold,
        Part1,
        Part1Lse,
        Output,
        Share,
        Flagged,
        Tally,
        PerKv,
        Importance,
        hq,
        group,
        pages,
        dv,
        stride_n,
        stride_h,
        stride_p,
        stride_en,
        stride_eh,
        stride_ep,
        stride_vn,
        stride_vh,
        stride_vp,
        stride_threshold,
        stride_part1_n,
        stride_part1_h,
        stride_part1_lse,
        stride_tally,
        stride_out_n,
        stride_out_h,
        listed,
        stride_kn,
        stride_kl,
        stride_kh,
        layer,
        layers,
        BLOCK_P: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_KV: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        neg_inf = float("-inf")
        offs = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_DV)
        mask_d = offs_d < dv
        flags = row * pages
        # 1. The deterministic bound: per head, the unread rest's upper mass and largest value norm.
        bound_sq = tl.zeros([], tl.float32)
        size_sq = tl.zeros([], tl.float32)
        for h in range(hq):
            base = row * stride_n + h * stride_h
            base_e = row * stride_en + h * stride_eh
            base_v = row * stride_vn + (h // group) * stride_vh
            m = tl.full([], neg_inf, tl.float32)
            largest = tl.zeros([], tl.float32)
            for p0 in range(0, pages, BLOCK_P):
                cols = p0 + offs
                keep, upper = _unread_upper(Valid, Read, PageLse, LogitError, flags, base, base_e, cols, pages,
                                            stride_p, stride_ep)  # fmt: skip
                m = tl.maximum(m, tl.max(upper, axis=0))
                v = tl.load(ValueNorm + base_v + cols * stride_vp, mask=keep, other=0.0).to(tl.float32)
                largest = tl.maximum(largest, tl.max(tl.where(keep, v, 0.0), axis=0))
            m_safe = tl.where(m > neg_inf, m, 0.0)
            den = tl.zeros([], tl.float32)
            for p0 in range(0, pages, BLOCK_P):
                cols = p0 + offs
                keep, upper = _unread_upper(Valid, Read, PageLse, LogitError, flags, base, base_e, cols, pages,
                                            stride_p, stride_ep)  # fmt: skip
                den += tl.sum(tl.where(keep, tl.exp(upper - m_safe), 0.0), axis=0)
            lse_hi = m_safe + tl.log(tl.where(den > 0, den, 1.0))
            lse_e = tl.load(Lse + row * hq + h).to(tl.float32)
            alpha = tl.where(den > 0, tl.sigmoid(lse_hi - lse_e), 0.0)
            o = tl.load(Out + (row * hq + h) * dv + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            head_sq = tl.sum(o * o, axis=0)
            term = alpha * (largest + tl.sqrt(head_sq))
            bound_sq += term * term
            size_sq += head_sq
        bound = tl.sqrt(bound_sq)
        size = tl.sqrt(size_sq)
        det = tl.where(bound < size, bound / (size - bound), float("inf"))
        det = tl.where(bound == 0, 0.0, det)
        # 2. The smaller bound chooses; over the threshold the row is flagged.
        stat = tl.load(StatRelative + row).to(tl.float32)
        use_det = det <= stat
        relative = tl.where(use_det, det, stat)
        flagged = relative > tl.load(Threshold + row * stride_threshold).to(tl.float32)
        tl.store(Flagged + row, flagged)
        # The row's rest, and its masks' counts (the tally's wanted marks on the way).
        has_rest = tl.zeros([], tl.int32)
        counts_read = tl.zeros([], tl.int32)
        counts_estimated = tl.zeros([], tl.int32)
        counts_missed = tl.zeros([], tl.int32)
        counts_sampled = tl.zeros([], tl.int32)
        counts_wanted = tl.zeros([], tl.int32)
        t_row = Tally + row * stride_tally
        for p0 in range(0, pages, BLOCK_P):
            cols = p0 + offs
            inside = cols < pages
            live = tl.load(Valid + flags + cols, mask=inside, other=0) != 0
            read = tl.load(Read + flags + cols, mask=inside, other=0) != 0
            want = tl.load(Wanted + flags + cols, mask=inside, other=0) != 0
            miss = tl.load(Missed + flags + cols, mask=inside, other=0) != 0
            drawn = tl.load(Sampled + flags + cols, mask=inside, other=0) != 0
            estimated = live & ~read
            has_rest += tl.sum(live.to(tl.int32), axis=0)
            counts_read += tl.sum(read.to(tl.int32), axis=0)
            counts_estimated += tl.sum(estimated.to(tl.int32), axis=0)
            counts_missed += tl.sum(miss.to(tl.int32), axis=0)
            counts_sampled += tl.sum((estimated & drawn).to(tl.int32), axis=0)
            counts_wanted += tl.sum(want.to(tl.int32), axis=0)
            mark = want.to(tl.float64) + (miss.to(tl.int32) * flagged.to(tl.int32)).to(tl.float64)
            old = tl.load(t_row + pages + cols, mask=inside, other=0.0)
            tl.store(t_row + pages + cols, tl.maximum(old, mark), mask=inside)
        # 3. The output, the exact share, and the pages' masses of the chosen denominator.
        offs_kv = tl.arange(0, BLOCK_KV)
        kv_share = tl.zeros([BLOCK_KV], tl.float32)  # each KV head's mean part-1 share over its group
        for h in range(hq):
            rh = row * hq + h
            lse_e = tl.load(Lse + rh).to(tl.float32)
            lse_c = tl.where(use_det, tl.where(lse_e > neg_inf, lse_e, 0.0), tl.load(StatLse + rh).to(tl.float32))
            share = tl.where(use_det, 1.0, tl.load(StatShare + rh).to(tl.float32))
            o = tl.where(
                use_det,
                tl.load(Out + rh * dv + offs_d, mask=mask_d, other=0.0),
                tl.load(StatOut + rh * dv + offs_d, mask=mask_d, other=0.0),
            ).to(tl.float32)
            first = tl.load(Part1 + row * stride_part1_n + h * stride_part1_h + offs_d, mask=mask_d, other=0.0)
            o = tl.where(has_rest > 0, o, first.to(tl.float32))
            out_ptr = Output + row * stride_out_n + h * stride_out_h + offs_d
            tl.store(out_ptr, o.to(Output.dtype.element_ty), mask=mask_d)
            share = tl.where(has_rest > 0, share, 1.0)
            tl.store(Share + rh, share)
            # Part 1's own share of the chosen denominator (its lse -inf: none).
            lse_1 = tl.load(Part1Lse + row * stride_part1_lse + h).to(tl.float32)
            own = tl.where(lse_1 > neg_inf, tl.minimum(tl.exp(lse_1 - lse_c), 1.0), 0.0)
            own = tl.where(has_rest > 0, own, 1.0)
            kv_share = tl.where(offs_kv == h // group, kv_share + own / group, kv_share)
            base = row * stride_n + h * stride_h
            for p0 in range(0, pages, BLOCK_P):
                cols = p0 + offs
                inside = cols < pages
                live = tl.load(Valid + flags + cols, mask=inside, other=0) != 0
                x = tl.load(PageLse + base + cols * stride_p, mask=live, other=neg_inf).to(tl.float32)
                mass = tl.where(live, tl.exp(x - lse_c), 0.0).to(tl.float64)
                old = tl.load(t_row + cols, mask=inside, other=0.0)
                tl.store(t_row + cols, tl.maximum(old, mass), mask=inside)
        # 4. The counts, the flag and the wanted count of this layer.
        c = t_row + 2 * pages
        tl.store(c + 0, tl.load(c + 0) + (counts_read > 0).to(tl.float64))
        tl.store(c + 1, tl.load(c + 1) + counts_read.to(tl.float64))
        tl.store(c + 2, tl.load(c + 2) + counts_estimated.to(tl.float64))
        tl.store(c + 3, tl.load(c + 3) + counts_missed.to(tl.float64))
        tl.store(c + 4, tl.load(c + 4) + counts_sampled.to(tl.float64))
        f = c + 5 + layer
        tl.store(f, tl.maximum(tl.load(f), flagged.to(tl.float64)))
        tl.store(c + 5 + layers + layer, counts_wanted.to(tl.float64))
        # 5. Part 1's per-KV-head masses as shares of the chosen denominator, and their mean.
        kv_heads = hq // group
        offs_l = tl.arange(0, BLOCK_L)
        for l0 in range(0, listed, BLOCK_L):
            cols = l0 + offs_l
            tile = (cols[:, None] < listed) & (offs_kv[None, :] < kv_heads)
            ptr = PerKv + row * stride_kn + cols[:, None] * stride_kl + offs_kv[None, :] * stride_kh
            scaled = tl.load(ptr, mask=tile, other=0.0).to(tl.float32) * kv_share[None, :]
            tl.store(ptr, scaled.to(PerKv.dtype.element_ty), mask=tile)
            tl.store(Importance + row * listed + cols, tl.sum(scaled, axis=1) / kv_heads, mask=cols < listed)


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
    """One Triton launch (GPU; CPU tensors under ``TRITON_INTERPRET=1``): see the module docstring.

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
    dense = [t.contiguous() for t in (lse, out, *statistical, *masks)]  # each already is as the step calls it
    if part1.stride(-1) != 1:
        part1 = part1.contiguous()
    if part1_lse.shape != (n, hq) or part1_lse.stride(1) != 1:
        raise ValueError(f"part1_lse must be [{n}, {hq}] with unit stride over heads, got {tuple(part1_lse.shape)}")
    _finish_kernel[(n,)](
        *dense[:7], page_lse, logit_error, value_norm, *dense[7:], threshold, part1, part1_lse, output, share,
        flagged, tally,
        per_kv, importance,
        hq, hq // value_norm.shape[1], pages, dv, *page_lse.stride(), *logit_error.stride(), *value_norm.stride(),
        threshold.stride(0), part1.stride(0), part1.stride(1), part1_lse.stride(0), tally.stride(0),
        output.stride(0), output.stride(1),
        listed, *per_kv.stride(), layer, layers,
        BLOCK_P=BLOCK_P, BLOCK_DV=next_power_of_2(dv), BLOCK_L=BLOCK_L, BLOCK_KV=next_power_of_2(per_kv.shape[2]),
    )  # fmt: skip
    return share, flagged, importance
