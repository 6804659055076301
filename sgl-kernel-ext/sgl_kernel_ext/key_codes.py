"""Page log-masses from 4-bit key codes: the hot-set guard's pass over unread pages.

For each listed page of each request, every token's logit is estimated from its
packed 4-bit key codes (channel ``j`` in the low nibble, ``j + D/2`` in the high one)
against the page's per-channel range, ``k_hat = low + code * step``; the page's
estimated log-mass ``log sum_t exp(q . k_hat_t)`` and the bound on every token's logit
error ``sum_j |q_j| step_j / 2`` (plus a float32 rounding margin) come back per query
head. On a CPU the C kernel (``csrc/paged_decode.c``, ``sgl_key_code_pages``) reads the
codes straight from the pool, half a byte per channel; elsewhere, or without a
compiler, :func:`key_code_pages_torch` (the reference the tests compare against).

Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_kernel_ext import native

LEVELS = 15


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def key_code_pages(
    q: torch.Tensor,
    codes: torch.Tensor,
    ids: torch.Tensor,
    low: torch.Tensor,
    step: torch.Tensor,
    valid: torch.Tensor,
    *,
    logit_cap: float = 0.0,
    margin: float = 0.0,
    use_native: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Estimated log-mass and logit error of each listed page, per query head.

    Args:
        q: float32 ``[Hkv, n, g, D]``, scaled by ``sm_scale``.
        codes: uint8 ``[Hkv, rows, page_size, D / 2]``, one layer's code pool.
        ids: int64 ``[n, P]`` rows of ``codes`` listed per request.
        low, step: float32 ``[n, P, Hkv, D]`` each listed page's range.
        valid: bool ``[n, P]``; invalid entries get lse ``-inf`` and error 0.
        use_native: None: the C kernel where it can run; False: the torch path.

    Returns:
        (lse, err), float32 ``[Hkv, n, P, g]`` each.
    """
    kv, n, g, d = q.shape
    listed = ids.shape[1]
    lib = None
    if use_native is not False and q.device.type == "cpu" and g <= 16 and d <= 256 and d % 2 == 0:
        lib = native.library()
    if lib is None:
        if use_native:
            raise RuntimeError("use_native=True, but the C kernel is not built or does not take these inputs")
        return key_code_pages_torch(q, codes, ids, low, step, valid, logit_cap=logit_cap, margin=margin)
    q, codes = q.contiguous().float(), codes.contiguous()
    ids, valid = ids.contiguous().to(torch.int64), valid.contiguous().to(torch.uint8)
    low, step = low.contiguous().float(), step.contiguous().float()
    lse = torch.empty(kv, n, listed, g, dtype=torch.float32)
    err = torch.empty(kv, n, listed, g, dtype=torch.float32)
    if lse.numel() == 0:
        return lse, err
    status = lib.sgl_key_code_pages(
        _ptr(q), _ptr(codes), _ptr(ids), _ptr(low), _ptr(step), _ptr(valid),
        kv, n, g, d, listed, codes.shape[2], codes.shape[1], float(logit_cap), float(margin),
        _ptr(lse), _ptr(err), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"sgl_key_code_pages failed ({status})")
    return lse, err


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """float32 codes ``[..., D]`` of packed ``[..., D / 2]`` (low nibbles first)."""
    half = packed.shape[-1]
    out = torch.empty((*packed.shape[:-1], 2 * half), dtype=torch.float32, device=packed.device)
    out[..., :half].copy_(packed & LEVELS)
    out[..., half:].copy_(packed >> 4)
    return out


def key_code_pages_torch(
    q: torch.Tensor,
    codes: torch.Tensor,
    ids: torch.Tensor,
    low: torch.Tensor,
    step: torch.Tensor,
    valid: torch.Tensor,
    *,
    logit_cap: float = 0.0,
    margin: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`key_code_pages` in torch (any device; the reference)."""
    kv, n, g, d = q.shape
    dev = q.device
    packed = codes.index_select(1, ids.reshape(-1).to(codes.device)).to(dev)
    packed = packed.view(kv, n, ids.shape[1], codes.shape[2], d // 2)
    unpacked = unpack(packed)
    lo = low.to(dev).float().permute(2, 0, 1, 3)  # [Hkv, n, P, D]
    st = step.to(dev).float().permute(2, 0, 1, 3)
    qf = q.float()
    base = torch.einsum("hngd,hnpd->hnpg", qf, lo)
    scaled_q = qf[:, :, None] * st[:, :, :, None]  # [Hkv, n, P, g, D]
    logits = torch.matmul(scaled_q, unpacked.transpose(-1, -2)) + base[..., None]  # [Hkv, n, P, g, ps]
    if logit_cap > 0:
        logits = torch.tanh(logits / logit_cap) * logit_cap
    lse = torch.logsumexp(logits, dim=-1)
    magnitude = torch.maximum(lo.abs(), (lo + st * LEVELS).abs()).amax(-1)  # [Hkv, n, P]
    qa = qf.abs()
    err = torch.einsum("hngd,hnpd->hnpg", qa, st) * 0.5 + qa.sum(-1)[:, :, None, :] * magnitude[..., None] * margin
    pad = ~valid.to(dev)[None, :, :, None]
    return lse.masked_fill(pad, float("-inf")), err.masked_fill(pad, 0.0)
