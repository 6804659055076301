"""The hot-set guard's sampled estimate folded into the exact pages' softmax, with its
bound, as two Triton launches: the GPU form of ``sgl_importance.hot_set.guard.estimate.combine``.

Per request: the exact part (``lse_exact``, ``out_exact``), the sampled rest pages
(each page's own lse and output; ``-inf`` lse where a page is not estimated) and the
sample's inclusion probability ``pi``. The sampled pages stand for the rest with weight
``1 / pi`` (Horvitz-Thompson); the estimate's variance comes from the sampled pages'
spread around the combined output, floored by what the key codes' masses of every rest
page imply, and the bound is a Student's t quantile (by the count of sampled pages)
times its square root. The math, and the torch reference the tests compare against, is
``estimate.combine``'s; its constants (the quantile table, ``Z``, ``MIN_SAMPLED``) come
in as arguments, so this module needs nothing of the caller.

- stage 1, grid ``(n, Hq)``: one query head's combined output, lse and exact share, and
  its per-head sums (the sampled pages' ``sum ||y_p||^2``, the key codes' squared shares
  of the rest and of the sample, ``||o_h||^2``) into a small workspace;
- stage 2, grid ``(n,)``: the request's variance, quantile, bound and relative bound.

Both grids come from the input shapes; nothing is read back to the host.

Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from sgl_kernel_ext.plan import next_power_of_2
from sgl_kernel_ext.scatter import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

# Sampled pages (stage 1) or rest pages one program reads at a time.
BLOCK_S = 16
BLOCK_P = 64

# Quantile tables already on a device, by (device, table): built once, not per layer.
_tables: dict[tuple[str, tuple[tuple[int, float], ...]], tuple[torch.Tensor, torch.Tensor]] = {}


def _on(t: torch.Tensor, dev: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t`` on ``dev`` (in ``dtype``), moved only from another device: the callers' tensors are
    already there, where a ``.to(dev)`` is no copy (but one a CPU's host-sync counter cannot
    tell from a read back, ``test/support/host_syncs.py``)."""
    if t.device != dev:
        t = t.to(dev)
    return t if dtype is None else t.to(dtype)


def _table(quantiles: Mapping[int, float], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    items = tuple(sorted((int(k), float(v)) for k, v in quantiles.items()))
    key = (str(device), items)
    if key not in _tables:
        dfs = torch.tensor([k for k, _ in items], dtype=torch.int32, device=device)
        values = torch.tensor([v for _, v in items], dtype=torch.float32, device=device)
        _tables[key] = (dfs, values)
    return _tables[key]


# Dense lookups (a value for every df up to the table's last, then ``z``), by (device, table, z).
_lookups: dict[tuple[str, tuple[tuple[int, float], ...], float], torch.Tensor] = {}


def t_quantile(count: torch.Tensor, quantiles: Mapping[int, float], z: float) -> torch.Tensor:
    """float32 ``[n]`` the quantile for estimates from ``count`` samples: ``count - 1``
    degrees of freedom, the next smaller tabled one (df < 1 takes df 1's), ``z`` past the
    table. One gather from a lookup built once per device (torch, any device)."""
    items = tuple(sorted((int(k), float(v)) for k, v in quantiles.items()))
    key = (str(count.device), items, float(z))
    lookup = _lookups.get(key)
    if lookup is None:
        table = dict(items)
        last = items[-1][0]
        values = [table[max(k for k in table if k <= max(df, 1))] for df in range(last + 1)] + [float(z)]
        lookup = _lookups[key] = torch.tensor(values, dtype=torch.float32, device=count.device)
    return lookup[(count - 1).clamp(0, lookup.numel() - 1).long()]


if HAS_TRITON:

    @triton.jit
    def _still(Valid, Read, row, cols, limit, num_rest):
        """Columns (below ``limit``) still estimated: listed and not read ([n, P] masks)."""
        inside = cols < limit
        listed = tl.load(Valid + row * num_rest + cols, mask=inside, other=0) != 0
        return listed & (tl.load(Read + row * num_rest + cols, mask=inside, other=1) == 0)

    @triton.jit
    def _kept(Valid, Read, InSample, row, cols, num_sampled, num_rest):
        """Sampled columns still estimated: listed, not read, in the sample."""
        inside = cols < num_sampled
        keep = _still(Valid, Read, row, cols, num_sampled, num_rest)
        return keep & (tl.load(InSample + row * num_rest + cols, mask=inside, other=0) != 0)

    @triton.jit
    def _sampled_lse(SLse, Valid, Read, InSample, row, rh, cols, num_sampled, num_rest, MASKED: tl.constexpr):
        """The sampled pages' lse, -inf where a page is not estimated (masked here where ``MASKED``)."""
        x = tl.load(SLse + rh * num_sampled + cols, mask=cols < num_sampled, other=float("-inf"))
        if MASKED:
            x = tl.where(_kept(Valid, Read, InSample, row, cols, num_sampled, num_rest), x, float("-inf"))
        return x

    @triton.jit
    def _combine_heads_kernel(
        LseE,
        OutE,
        LseB,
        OutB,
        ExactLse,
        ExactOut,
        SLse,
        SOut,
        Pi,
        RestLse,
        RestS,
        Valid,
        Read,
        InSample,
        Out,
        Lse,
        Share,
        Work,
        hq,
        num_sampled,
        num_rest,
        dv,
        stride_pi,
        stride_rn,
        stride_rh,
        stride_rp,
        HAS_CODES: tl.constexpr,
        MASKED: tl.constexpr,
        TWO_PARTS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        rest = RestLse + row * stride_rn + head * stride_rh
        rh = row * hq + head
        neg_inf = float("-inf")
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_DV)
        mask_d = offs_d < dv
        pi = tl.load(Pi + row * stride_pi).to(tl.float32)
        # The exact part: one, or two over disjoint pages merged here (and written out).
        lse_e = tl.load(LseE + rh).to(tl.float32)
        out_e = tl.load(OutE + rh * dv + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        if TWO_PARTS:
            lse_b = tl.load(LseB + rh).to(tl.float32)
            out_b = tl.load(OutB + rh * dv + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            big = tl.maximum(lse_e, lse_b)
            big_safe = tl.where(big > neg_inf, big, 0.0)
            both = tl.where(lse_e > neg_inf, tl.exp(lse_e - big_safe), 0.0) + tl.where(
                lse_b > neg_inf, tl.exp(lse_b - big_safe), 0.0
            )
            merged = tl.where(both > 0.0, big_safe + tl.log(tl.where(both > 0.0, both, 1.0)), neg_inf)
            safe = tl.where(merged > neg_inf, merged, 0.0)
            out_e = (
                tl.where(lse_e > neg_inf, tl.exp(lse_e - safe), 0.0) * out_e
                + tl.where(lse_b > neg_inf, tl.exp(lse_b - safe), 0.0) * out_b
            )
            lse_e = merged
            tl.store(ExactLse + rh, lse_e)
            tl.store(ExactOut + rh * dv + offs_d, out_e, mask=mask_d)

        # Pass 1: the sampled pages' own softmax (online over page blocks).
        m = tl.full([], neg_inf, tl.float32)
        den = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_DV], tl.float32)
        for s0 in range(0, num_sampled, BLOCK_S):
            cols = s0 + offs_s
            x = _sampled_lse(SLse, Valid, Read, InSample, row, rh, cols, num_sampled, num_rest, MASKED)
            live = x > neg_inf
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_safe = tl.where(m_new > neg_inf, m_new, 0.0)
            p = tl.where(live, tl.exp(x - m_safe), 0.0)
            o = tl.load(
                SOut + (rh * num_sampled + cols[:, None]) * dv + offs_d[None, :],
                mask=live[:, None] & mask_d[None, :],
                other=0.0,
            )
            scale = tl.where(m > neg_inf, tl.exp(m - m_safe), 0.0)
            den = den * scale + tl.sum(p, axis=0)
            acc = acc * scale + tl.sum(p[:, None] * o, axis=0)
            m = m_new
        any_sampled = den > 0.0
        den_safe = tl.where(any_sampled, den, 1.0)
        out_s = acc / den_safe
        # Weighted by 1 / pi: the sample stands for the whole remaining rest.
        lse_s = tl.where(any_sampled, tl.where(m > neg_inf, m, 0.0) + tl.log(den_safe) - tl.log(pi), neg_inf)

        top = tl.maximum(lse_e, lse_s)
        top_safe = tl.where(top > neg_inf, top, 0.0)
        wa = tl.where(lse_e > neg_inf, tl.exp(lse_e - top_safe), 0.0)
        wb = tl.where(lse_s > neg_inf, tl.exp(lse_s - top_safe), 0.0)
        total = wa + wb
        live_total = total > 0.0
        # The combined lse is 0 where both parts are empty (estimate.combine's convention).
        lse = tl.where(live_total, top_safe + tl.log(tl.where(live_total, total, 1.0)), 0.0)
        a = tl.where(lse_e > neg_inf, tl.exp(lse_e - lse), 0.0)
        b = tl.where(lse_s > neg_inf, tl.exp(lse_s - lse), 0.0)
        output = a * out_e + b * out_s
        tl.store(Out + rh * dv + offs_d, output, mask=mask_d)
        tl.store(Lse + rh, lse)
        tl.store(Share + rh, a)

        # Pass 2: each sampled page's y_p / D_hat around the combined output.
        spread = tl.zeros([], tl.float32)
        x_sampled = tl.zeros([], tl.float32)
        for s0 in range(0, num_sampled, BLOCK_S):
            cols = s0 + offs_s
            mask_s = cols < num_sampled
            x = _sampled_lse(SLse, Valid, Read, InSample, row, rh, cols, num_sampled, num_rest, MASKED)
            live = x > neg_inf
            share = tl.where(live, tl.exp(x - lse), 0.0)
            o = tl.load(
                SOut + (rh * num_sampled + cols[:, None]) * dv + offs_d[None, :],
                mask=live[:, None] & mask_d[None, :],
                other=0.0,
            )
            y = share[:, None] * (o - output[None, :])
            y = tl.where(live[:, None] & mask_d[None, :], y, 0.0)
            spread += tl.sum(tl.sum(y * y, axis=1), axis=0)
            if HAS_CODES:
                if MASKED:  # the sampled pages' own codes, where still estimated
                    c = tl.load(rest + cols * stride_rp, mask=mask_s, other=neg_inf)
                    c = tl.where(_kept(Valid, Read, InSample, row, cols, num_sampled, num_rest), c, neg_inf)
                else:
                    c = tl.load(RestS + rh * num_sampled + cols, mask=mask_s, other=neg_inf)
                xc = tl.where(c > neg_inf, tl.exp(c - lse), 0.0)
                x_sampled += tl.sum(xc * xc, axis=0)
        # Pass 3: the key codes' squared shares of every rest page still estimated.
        x_rest = tl.zeros([], tl.float32)
        if HAS_CODES:
            offs_p = tl.arange(0, BLOCK_P)
            for p0 in range(0, num_rest, BLOCK_P):
                cols = p0 + offs_p
                c = tl.load(rest + cols * stride_rp, mask=cols < num_rest, other=neg_inf)
                if MASKED:
                    c = tl.where(_still(Valid, Read, row, cols, num_rest, num_rest), c, neg_inf)
                xc = tl.where(c > neg_inf, tl.exp(c - lse), 0.0)
                x_rest += tl.sum(xc * xc, axis=0)
        norm_sq = tl.sum(output * output, axis=0)
        tl.store(Work + rh * 4 + 0, spread)
        tl.store(Work + rh * 4 + 1, x_sampled)
        tl.store(Work + rh * 4 + 2, x_rest)
        tl.store(Work + rh * 4 + 3, norm_sq)

    @triton.jit
    def _combine_bound_kernel(
        SLse,
        Pi,
        Uncovered,
        Valid,
        Read,
        InSample,
        Work,
        Dfs,
        Quantiles,
        Bound,
        Relative,
        hq,
        num_sampled,
        num_rest,
        stride_pi,
        z,
        min_sampled,
        HAS_CODES: tl.constexpr,
        MASKED: tl.constexpr,
        NUM_QUANTILES: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        neg_inf = float("-inf")
        inf = float("inf")
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < hq
        pi = tl.load(Pi + row * stride_pi).to(tl.float32)
        work = Work + (row * hq + offs_h) * 4
        spread = tl.load(work + 0, mask=mask_h, other=0.0)
        norm_sq = tl.load(work + 3, mask=mask_h, other=0.0)
        variance = (1.0 - pi) / (pi * pi) * tl.sum(spread, axis=0)
        if HAS_CODES:
            x_sampled = tl.load(work + 1, mask=mask_h, other=0.0)
            x_rest = tl.load(work + 2, mask=mask_h, other=0.0)
            ratio = tl.where(x_sampled > 0.0, spread / tl.maximum(x_sampled, 1e-30), 0.0)
            variance = tl.maximum(variance, (1.0 - pi) / pi * tl.sum(x_rest * ratio, axis=0))

        # Sampled pages still estimated: a page counts where any query head reads it.
        count = tl.zeros([], tl.int32)
        offs_s = tl.arange(0, BLOCK_S)
        for s0 in range(0, num_sampled, BLOCK_S):
            cols = s0 + offs_s
            x = tl.load(
                SLse + (row * hq + offs_h[:, None]) * num_sampled + cols[None, :],
                mask=mask_h[:, None] & (cols[None, :] < num_sampled),
                other=neg_inf,
            )
            if MASKED:
                x = tl.where(_kept(Valid, Read, InSample, row, cols, num_sampled, num_rest)[None, :], x, neg_inf)
            seen = tl.max(tl.where(x > neg_inf, 1, 0), axis=0)
            count += tl.sum(seen, axis=0)

        # Student's t for count - 1 degrees of freedom: the largest tabled df not above it.
        df = count - 1
        t = tl.load(Quantiles)
        for i in range(NUM_QUANTILES):
            t = tl.where(df >= tl.load(Dfs + i), tl.load(Quantiles + i), t)
        t = tl.where(df > tl.load(Dfs + NUM_QUANTILES - 1), z, t)
        t = tl.where(df < 1, tl.load(Quantiles), t)
        bound = t * tl.sqrt(tl.maximum(variance, 0.0))

        size = tl.sqrt(tl.sum(norm_sq, axis=0))
        gap = tl.where(bound < size, size - bound, 1.0)
        relative = tl.where(bound < size, bound / gap, inf)
        relative = tl.where(bound == 0.0, 0.0, relative)
        too_few = (count < min_sampled) & (pi < 1.0) & (count > 0)
        if MASKED:  # rest pages remain, none of them sampled
            left = tl.zeros([], tl.int32)
            offs_p = tl.arange(0, BLOCK_P)
            for p0 in range(0, num_rest, BLOCK_P):
                cols = p0 + offs_p
                left += tl.sum(_still(Valid, Read, row, cols, num_rest, num_rest).to(tl.int32))
            sampled_left = tl.zeros([], tl.int32)
            for s0 in range(0, num_sampled, BLOCK_S):
                cols = s0 + offs_s
                sampled_left += tl.sum(_kept(Valid, Read, InSample, row, cols, num_sampled, num_rest).to(tl.int32))
            uncovered = (left > 0) & (sampled_left == 0)
        else:
            uncovered = tl.load(Uncovered + row) != 0
        relative = tl.where(uncovered | too_few, inf, relative)
        tl.store(Bound + row, bound)
        tl.store(Relative + row, relative)


def combine_triton(
    lse_exact: torch.Tensor,
    out_exact: torch.Tensor,
    sampled_lse: torch.Tensor,
    sampled_output: torch.Tensor,
    inclusion: torch.Tensor,
    uncovered: torch.Tensor,
    codes: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    *,
    quantiles: Mapping[int, float],
    z: float,
    min_sampled: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``estimate.combine`` in two Triton launches (GPU; CPU tensors under ``TRITON_INTERPRET=1``).

    Args:
        lse_exact, out_exact: ``[n, Hq]``, ``[n, Hq, Dv]`` over every page read exactly.
        sampled_lse, sampled_output: ``[n, Hq, S]``, ``[n, Hq, S, Dv]`` the sampled rest
            pages still estimated (-inf lse elsewhere).
        inclusion: ``[n]`` ``pi``; uncovered: bool ``[n]``.
        codes: the key codes' log-masses of the rest still estimated ``[n, Hq, P]`` and
            of the sampled pages ``[n, Hq, S]`` (-inf elsewhere), or None.
        quantiles: Student's t quantile by degrees of freedom (ascending ``df`` from 1);
            z: the normal's, past the table; min_sampled: fewer sampled pages cannot vouch.

    Returns:
        (output ``[n, Hq, Dv]``, lse ``[n, Hq]``, exact share ``[n, Hq]``, bound ``[n]``,
        relative ``[n]``), float32.

    Reads per request and query head (Llama-3.1-8B: Dv 128, float32): each sampled page's
    lse and output twice (2 x 516 B), the exact part (516 B), each rest page's code lse
    (4 B); the stage-2 pass reads 16 B per head and the sampled lse again.
    """
    if not HAS_TRITON:
        raise RuntimeError("combine_triton needs Triton")
    n, hq = lse_exact.shape
    if codes is not None and (codes[1].shape != sampled_lse.shape or codes[0].shape[:2] != (n, hq)):
        raise ValueError(f"codes {tuple(codes[0].shape)} / {tuple(codes[1].shape)} do not match")
    dev = out_exact.device
    dense = lambda t: _on(t, dev, torch.float32).contiguous()  # noqa: E731
    sampled_lse = dense(sampled_lse)
    rest_lse, rest_sampled = (sampled_lse, sampled_lse) if codes is None else (dense(codes[0]), dense(codes[1]))
    flags = _on(uncovered, dev, torch.uint8).contiguous()
    masks = None, None, None
    return _run(lse_exact, out_exact, sampled_lse, sampled_output, inclusion, (rest_lse, rest_sampled), flags, masks,
                has_codes=codes is not None, quantiles=quantiles, z=z, min_sampled=min_sampled)  # fmt: skip


def combine_rest_triton(
    lse_exact: torch.Tensor,
    out_exact: torch.Tensor,
    read_part: tuple[torch.Tensor, torch.Tensor],
    sampled_lse: torch.Tensor,
    sampled_output: torch.Tensor,
    inclusion: torch.Tensor,
    page_lse: torch.Tensor,
    valid: torch.Tensor,
    read: torch.Tensor,
    in_sample: torch.Tensor,
    *,
    quantiles: Mapping[int, float],
    z: float,
    min_sampled: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    """:func:`combine_triton` over the rest pages still estimated, masked inside the two
    launches: what ``hot_set.guard.layer``'s ``_combine`` builds with torch before it (the
    sampled lse and the key codes' log-masses masked, ``uncovered``), a captured step's
    guarded layer passes unmasked; and the exact part given in two (part 1 and the pages
    the selection read) merged in the first launch, as ``merge_parts`` would.

    Returns:
        ``((lse, output)`` of the merged exact part, float32 ``[n, Hq]``, ``[n, Hq, Dv]``;
        :func:`combine_triton`'s five results``)``.

    Args:
        lse_exact, out_exact, read_part: the two exact parts (``[n, Hq]``, ``[n, Hq, Dv]`` each).
        sampled_lse, sampled_output: ``[n, Hq, S]``, ``[n, Hq, S, Dv]`` the sampled pages
            (the plan's first ``S`` columns), unmasked.
        page_lse: ``[n, Hq, P]`` every listed rest page's key-code log-mass (any strides).
        valid, read, in_sample: bool ``[n, P]``: the listed pages, those read exactly (the
            rest are still estimated), those sampled.
        The rest as :func:`combine_triton`'s.
    """
    if not HAS_TRITON:
        raise RuntimeError("combine_rest_triton needs Triton")
    n, hq, pages = page_lse.shape
    masks = valid, read, in_sample
    if any(m.shape != (n, pages) for m in masks) or sampled_lse.shape[-1] > pages:
        raise ValueError(
            f"masks {[tuple(m.shape) for m in masks]} do not match page_lse {tuple(page_lse.shape)} "
            f"and {sampled_lse.shape[-1]} sampled columns"
        )
    dev = out_exact.device
    sampled_lse = _on(sampled_lse, dev, torch.float32).contiguous()
    masks = tuple(m.contiguous() for m in masks)
    if read_part[0].shape != lse_exact.shape or read_part[1].shape != out_exact.shape:
        raise ValueError(f"the read part {tuple(read_part[1].shape)} does not match {tuple(out_exact.shape)}")
    merged = (torch.empty(lse_exact.shape, dtype=torch.float32, device=dev),
              torch.empty(out_exact.shape, dtype=torch.float32, device=dev))  # fmt: skip
    results = _run(
        lse_exact,
        out_exact,
        sampled_lse,
        sampled_output,
        inclusion,
        (page_lse, sampled_lse),
        None,
        masks,
        has_codes=True,
        quantiles=quantiles,
        z=z,
        min_sampled=min_sampled,
        second=(*read_part, *merged),
    )
    return merged, results


def _run(lse_exact, out_exact, sampled_lse, sampled_output, inclusion, codes, uncovered, masks, *, has_codes,
         quantiles, z, min_sampled, second=None):  # fmt: skip
    """The two launches; ``masks`` ``(valid, read, in_sample)`` or ``(None, None, None)`` (then
    ``uncovered``); ``second``: a second exact part and the merged part's buffers, or None."""
    n, hq = lse_exact.shape
    dv = out_exact.shape[-1]
    num_sampled = sampled_lse.shape[-1]
    if sampled_output.shape != (n, hq, num_sampled, dv) or out_exact.shape != (n, hq, dv):
        raise ValueError(
            f"shapes do not match: lse_exact {tuple(lse_exact.shape)}, out_exact {tuple(out_exact.shape)}, "
            f"sampled {tuple(sampled_lse.shape)} / {tuple(sampled_output.shape)}"
        )
    if 1 not in quantiles:
        raise ValueError("the quantile table must start at 1 degree of freedom")
    dev = out_exact.device
    f32 = torch.float32
    output = torch.empty(n, hq, dv, dtype=f32, device=dev)
    lse = torch.empty(n, hq, dtype=f32, device=dev)
    share = torch.empty(n, hq, dtype=f32, device=dev)
    bound = torch.empty(n, dtype=f32, device=dev)
    relative = torch.empty(n, dtype=f32, device=dev)
    if n == 0 or hq == 0:
        return output, lse, share, bound, relative
    work = torch.empty(n, hq, 4, dtype=f32, device=dev)
    dense = lambda t: _on(t, dev, f32).contiguous()  # noqa: E731
    rest_lse, rest_sampled = codes
    num_rest = rest_lse.shape[-1] if has_codes else 0
    valid, read, in_sample = masks
    masked = valid is not None
    if masked:
        num_rest = valid.shape[1]  # the masks' row stride, codes or not
    else:
        valid = read = in_sample = work  # never read
    pi = _on(inclusion, dev, f32)  # read through its stride (a column of the step's parameters)
    dfs, values = _table(quantiles, dev)
    # The exact parts in their own float dtype (a bfloat16 part 1 is read as it is, cast in the kernel).
    lse_exact, out_exact = dense(lse_exact), _on(out_exact, dev).contiguous()
    two = second is not None
    lse_b, out_b, merged_lse, merged_out = (
        (dense(second[0]), _on(second[1], dev).contiguous(), *second[2:]) if two else (lse_exact, out_exact) * 2
    )
    _combine_heads_kernel[(n, hq)](
        lse_exact, out_exact, lse_b, out_b, merged_lse, merged_out, sampled_lse, dense(sampled_output), pi,
        rest_lse, rest_sampled,
        valid, read, in_sample, output, lse, share, work,
        hq, num_sampled, num_rest, dv, pi.stride(0), *(rest_lse.stride() if has_codes else (0, 0, 0)),
        HAS_CODES=has_codes,
        MASKED=masked,
        TWO_PARTS=two,
        BLOCK_S=BLOCK_S,
        BLOCK_P=BLOCK_P,
        BLOCK_DV=next_power_of_2(dv),
    )  # fmt: skip
    _combine_bound_kernel[(n,)](
        sampled_lse, pi, work if uncovered is None else uncovered, valid, read, in_sample, work, dfs, values, bound,
        relative, hq, num_sampled, num_rest, pi.stride(0), float(z), int(min_sampled),
        HAS_CODES=has_codes,
        MASKED=masked,
        NUM_QUANTILES=dfs.numel(),
        BLOCK_H=next_power_of_2(hq),
        BLOCK_S=BLOCK_S,
        BLOCK_P=BLOCK_P,
    )  # fmt: skip
    return output, lse, share, bound, relative
