"""Two softmax parts over disjoint tokens, merged into one: the hot-set guard's merge.

A part is its log-sum-exp ``lse`` (its log denominator, ``-inf`` for a part with no
tokens) and its own softmax output ``out``. Over the union of the two token sets the
denominator is ``exp(lse_a) + exp(lse_b)`` and the output each part's output weighted
by its share of it; the merge is exact, whatever order the parts come in.

Two implementations of one contract: :func:`merge_parts_triton` (one launch of fixed
grid, no host sync; GPU, or CPU tensors under ``TRITON_INTERPRET=1``) and
:func:`merge_parts_torch` (any device; the reference). :func:`merge_parts` picks
Triton for CUDA tensors and torch otherwise.

Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_kernel_ext.plan import next_power_of_2
from sgl_kernel_ext.scatter import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

# Output channels one program merges at a time.
MAX_BLOCK_DV = 256


def merge_parts(
    lse_a: torch.Tensor,
    out_a: torch.Tensor,
    lse_b: torch.Tensor,
    out_b: torch.Tensor,
    *,
    use_triton: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax parts over disjoint tokens, as one.

    Args:
        lse_a, lse_b: ``[...]`` each part's log denominator (``-inf``: no tokens).
        out_a, out_b: ``[..., Dv]`` each part's softmax output.
        use_triton: None: Triton for CUDA tensors, torch otherwise.

    Returns:
        (lse, out) of the union: ``[...]`` and ``[..., Dv]``; where both parts are
        empty, lse ``-inf`` and output 0.
    """
    if use_triton is None:
        use_triton = HAS_TRITON and out_a.device.type == "cuda"
    if use_triton:
        return merge_parts_triton(lse_a, out_a, lse_b, out_b)
    return merge_parts_torch(lse_a, out_a, lse_b, out_b)


def merge_parts_torch(
    lse_a: torch.Tensor, out_a: torch.Tensor, lse_b: torch.Tensor, out_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_parts` in torch (any device, broadcasting shapes; the reference)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    wa = torch.where(torch.isfinite(lse_a), torch.exp(lse_a - safe), 0.0)[..., None]
    wb = torch.where(torch.isfinite(lse_b), torch.exp(lse_b - safe), 0.0)[..., None]
    return lse, wa * out_a + wb * out_b


if HAS_TRITON:

    @triton.jit
    def _merge_parts_kernel(
        LseA,
        OutA,
        LseB,
        OutB,
        Lse,
        Out,
        dv,
        BLOCK_DV: tl.constexpr,
    ):
        # One program per row (a request's query head); rows and channels are dense.
        row = tl.program_id(0).to(tl.int64)
        a = tl.load(LseA + row).to(tl.float32)
        b = tl.load(LseB + row).to(tl.float32)
        top = tl.maximum(a, b)
        # -inf on both sides would make exp(a - top) NaN: an empty union has weight 0.
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        wa = tl.where(a == float("-inf"), 0.0, tl.exp(a - top_safe))
        wb = tl.where(b == float("-inf"), 0.0, tl.exp(b - top_safe))
        # total is at least 1 where either part has tokens (the larger weight is 1).
        total = wa + wb
        live = total > 0.0
        total = tl.where(live, total, 1.0)
        lse = tl.where(live, top_safe + tl.log(total), float("-inf"))
        scale = tl.where(live, 1.0 / total, 0.0)
        wa = wa * scale
        wb = wb * scale
        tl.store(Lse + row, lse)
        offs = tl.arange(0, BLOCK_DV)
        for d0 in range(0, dv, BLOCK_DV):
            cols = d0 + offs
            mask = cols < dv
            x = tl.load(OutA + row * dv + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(OutB + row * dv + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(Out + row * dv + cols, wa * x + wb * y, mask=mask)


def merge_parts_triton(
    lse_a: torch.Tensor, out_a: torch.Tensor, lse_b: torch.Tensor, out_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_parts` as one Triton launch over its ``lse.numel()`` rows.

    Both parts must have the same shapes (no broadcasting) and lie on one device. The
    arithmetic is float32; results take the parts' promoted dtypes, as in torch.
    Per row it reads the two lse and the two outputs and writes one of each: for the
    guard's ``[n, 32, 128]`` float32 parts (Llama-3.1-8B), 2 x 4 + 2 x 512 B read and
    4 + 512 B written per request and query head.
    """
    if not HAS_TRITON:
        raise RuntimeError("merge_parts_triton needs Triton")
    if lse_a.shape != lse_b.shape or out_a.shape != out_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"parts of shapes lse {tuple(lse_a.shape)}/{tuple(lse_b.shape)}, "
            f"out {tuple(out_a.shape)}/{tuple(out_b.shape)} do not match"
        )
    devices = {t.device for t in (lse_a, out_a, lse_b, out_b)}
    if len(devices) != 1:
        raise ValueError(f"the parts lie on several devices: {sorted(map(str, devices))}")
    lse_dtype = torch.promote_types(lse_a.dtype, lse_b.dtype)
    out_dtype = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), lse_dtype)
    lse = torch.empty(lse_a.shape, dtype=lse_dtype, device=lse_a.device)
    out = torch.empty(out_a.shape, dtype=out_dtype, device=out_a.device)
    rows, dv = lse.numel(), out_a.shape[-1]
    if rows == 0 or dv == 0:
        if rows:
            lse.copy_(torch.logaddexp(lse_a, lse_b))
        return lse, out
    _merge_parts_kernel[(rows,)](
        lse_a.contiguous(), out_a.contiguous(), lse_b.contiguous(), out_b.contiguous(), lse, out,
        dv,
        BLOCK_DV=min(next_power_of_2(dv), MAX_BLOCK_DV),
    )  # fmt: skip
    return lse, out
