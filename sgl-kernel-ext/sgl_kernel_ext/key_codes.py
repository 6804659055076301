"""Page log-masses from 4-bit key codes: the hot-set guard's pass over unread pages.

For each listed page of each request, every token's logit is estimated from its
packed 4-bit key codes (channel ``j`` in the low nibble, ``j + D/2`` in the high one)
against the page's per-channel range, ``k_hat = low + code * step``; the page's
estimated log-mass ``log sum_t exp(q . k_hat_t)`` and the bound on every token's logit
error ``sum_j |q_j| step_j / 2`` (plus a float32 rounding margin) come back per query
head. On a CPU the C kernel (``csrc/paged_decode.c``, ``sgl_key_code_pages``) reads the
codes straight from the pool, half a byte per channel; on a GPU the Triton kernel
(:func:`key_code_pages_triton`) does the same in one launch per layer; elsewhere, or
without a compiler, :func:`key_code_pages_torch` (the reference the tests compare
against).

Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_kernel_ext import native
from sgl_kernel_ext.plan import next_power_of_2
from sgl_kernel_ext.scatter import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from sgl_kernel_ext.decode_importance import _soft_cap_tanh

LEVELS = 15
# Tokens of a page one Triton program scores at a time ([group, tokens, D / 2] in
# registers: 4 x 16 x 64 floats per nibble for a Llama-3.1-8B shape).
TRITON_BLOCK_T = 16


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
        codes: uint8 ``[Hkv, rows, page_size, D / 2]``, one layer's code rows (any strides of
            heads and rows: a view of the KV pool's bytes).
        ids: int64 ``[n, P]`` rows of ``codes`` listed per request.
        low, step: float32 ``[n, P, Hkv, D]`` each listed page's range.
        valid: bool ``[n, P]``; invalid entries get lse ``-inf`` and error 0.
        use_native: None: the C kernel on a CPU where it can run, the Triton kernel
            on a GPU; False: the torch path; True: the C or Triton kernel, or an error.

    Returns:
        (lse, err), float32 ``[Hkv, n, P, g]`` each.
    """
    kv, n, g, d = q.shape
    listed = ids.shape[1]
    if q.device.type == "cuda" and use_native is not False:
        if HAS_TRITON and d % 2 == 0:
            return key_code_pages_triton(q, codes, ids, low, step, valid, logit_cap=logit_cap, margin=margin)
        if use_native:
            raise RuntimeError("use_native=True, but Triton is not installed or D is odd")
    lib = None
    if use_native is not False and q.device.type == "cpu" and g <= 16 and d <= 256 and d % 2 == 0:
        lib = native.library()
    if lib is None:
        if use_native:
            raise RuntimeError("use_native=True, but the C kernel is not built or does not take these inputs")
        return key_code_pages_torch(q, codes, ids, low, step, valid, logit_cap=logit_cap, margin=margin)
    q = q.contiguous().float()
    if codes.stride(3) != 1 or codes.stride(2) != d // 2:
        codes = codes.contiguous()  # a row's tokens d / 2 bytes apart (the pool's own rows are)
    ids, valid = ids.contiguous().to(torch.int64), valid.contiguous().to(torch.uint8)
    low, step = low.contiguous().float(), step.contiguous().float()
    lse = torch.empty(kv, n, listed, g, dtype=torch.float32)
    err = torch.empty(kv, n, listed, g, dtype=torch.float32)
    if lse.numel() == 0:
        return lse, err
    status = lib.sgl_key_code_pages(
        _ptr(q), _ptr(codes), _ptr(ids), _ptr(low), _ptr(step), _ptr(valid),
        kv, n, g, d, listed, codes.shape[2], codes.stride(0), codes.stride(1), float(logit_cap), float(margin),
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


if HAS_TRITON:

    @triton.jit
    def _key_code_pages_kernel(
        Q,
        Codes,
        Ids,
        Low,
        Step,
        RangeIds,
        Valid,
        Lse,
        Err,
        Norms,
        NormOut,
        logit_cap,
        margin,
        q_scale,
        stride_qh,
        stride_qn,
        stride_qg,
        stride_ch,
        stride_cr,
        stride_ct,
        stride_in,
        stride_ln,
        stride_lp,
        stride_lh,
        stride_sn,
        stride_sp,
        stride_sh,
        stride_vn,
        stride_oh,
        stride_on,
        stride_op,
        stride_og,
        stride_ri,
        norm_rows_per_half,
        norm_row_floats,
        stride_non,
        stride_noh,
        GROUP: tl.constexpr,
        HALF: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_T: tl.constexpr,
        HAS_CAP: tl.constexpr,
        RANGED: tl.constexpr,
        HAS_NORMS: tl.constexpr,
        NORM_HALVES: tl.constexpr = 1,
        NORM_PER_PAGE: tl.constexpr = 1,
        NORM_ROWS: tl.constexpr = 1,
    ):
        # One program per (listed page, request, KV head): the page's codes are read
        # once for every query head of the group. RANGED: Low and Step are the range
        # tables' min and max, rows picked by RangeIds, the step computed here.
        col = tl.program_id(0).to(tl.int64)
        row = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2).to(tl.int64)
        offs_g = tl.arange(0, BLOCK_G)
        offs_j = tl.arange(0, BLOCK_HALF)
        offs_t = tl.arange(0, BLOCK_T)
        mask_g = offs_g < GROUP
        mask_j = offs_j < HALF
        live = tl.load(Valid + row * stride_vn + col) != 0

        # Channel j's code is in the low nibble, channel j + D/2's in the high one:
        # each half of q, low and step pairs with one nibble.
        q_ptr = Q + head * stride_qh + row * stride_qn + offs_g[:, None] * stride_qg + offs_j[None, :]
        q_mask = mask_g[:, None] & mask_j[None, :]
        q_a = tl.load(q_ptr, mask=q_mask, other=0.0).to(tl.float32) * q_scale
        q_b = tl.load(q_ptr + HALF, mask=q_mask, other=0.0).to(tl.float32) * q_scale
        range_mask = mask_j & live
        if RANGED:
            rid = tl.load(RangeIds + row * stride_ri + col, mask=live, other=0).to(tl.int64)
            low_ptr = Low + rid * stride_ln + head * stride_lh + offs_j
            high_ptr = Step + rid * stride_sn + head * stride_sh + offs_j
            low_a = tl.load(low_ptr, mask=range_mask, other=0.0).to(tl.float32)
            low_b = tl.load(low_ptr + HALF, mask=range_mask, other=0.0).to(tl.float32)
            high_a = tl.load(high_ptr, mask=range_mask, other=0.0).to(tl.float32)
            high_b = tl.load(high_ptr + HALF, mask=range_mask, other=0.0).to(tl.float32)
            step_a = tl.maximum(high_a - low_a, 0.0) / 15.0  # LEVELS, as steps() computes it
            step_b = tl.maximum(high_b - low_b, 0.0) / 15.0
        else:
            low_ptr = Low + row * stride_ln + col * stride_lp + head * stride_lh + offs_j
            step_ptr = Step + row * stride_sn + col * stride_sp + head * stride_sh + offs_j
            low_a = tl.load(low_ptr, mask=range_mask, other=0.0).to(tl.float32)
            low_b = tl.load(low_ptr + HALF, mask=range_mask, other=0.0).to(tl.float32)
            step_a = tl.load(step_ptr, mask=range_mask, other=0.0).to(tl.float32)
            step_b = tl.load(step_ptr + HALF, mask=range_mask, other=0.0).to(tl.float32)

        base = tl.sum(q_a * low_a[None, :] + q_b * low_b[None, :], axis=1)  # [BLOCK_G]
        qs_a = q_a * step_a[None, :]
        qs_b = q_b * step_b[None, :]
        # The logit error: half a step per channel, plus float32 rounding in proportion
        # to the largest key magnitude the page's range allows.
        half_steps = tl.sum(tl.abs(q_a) * step_a[None, :] + tl.abs(q_b) * step_b[None, :], axis=1)
        magnitude = tl.maximum(
            tl.max(tl.maximum(tl.abs(low_a), tl.abs(low_a + step_a * 15.0)), axis=0),
            tl.max(tl.maximum(tl.abs(low_b), tl.abs(low_b + step_b * 15.0)), axis=0),
        )
        q_abs = tl.sum(tl.abs(q_a) + tl.abs(q_b), axis=1)
        err = 0.5 * half_steps + q_abs * magnitude * margin

        page = tl.load(Ids + row * stride_in + col, mask=live, other=0).to(tl.int64)
        code_base = Codes + head * stride_ch + page * stride_cr
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_G], tl.float32)
        for t0 in range(0, PAGE_SIZE, BLOCK_T):
            tokens = t0 + offs_t
            mask_t = tokens < PAGE_SIZE
            packed = tl.load(
                code_base + tokens[:, None] * stride_ct + offs_j[None, :],
                mask=(mask_t[:, None] & mask_j[None, :]) & live,
                other=0,
            )  # [BLOCK_T, BLOCK_HALF] uint8
            code_a = (packed & 15).to(tl.float32)
            code_b = (packed >> 4).to(tl.float32)
            logits = tl.sum(qs_a[:, None, :] * code_a[None, :, :] + qs_b[:, None, :] * code_b[None, :, :], axis=2)
            logits = logits + base[:, None]  # [BLOCK_G, BLOCK_T]
            if HAS_CAP:
                logits = logit_cap * _soft_cap_tanh(logits / logit_cap)
            logits = tl.where(mask_t[None, :], logits, float("-inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
            m = m_new
        lse = m + tl.log(s)
        lse = tl.where(live, lse, float("-inf"))
        err = tl.where(live, err, 0.0)
        out = head * stride_oh + row * stride_on + col * stride_op + offs_g * stride_og
        tl.store(Lse + out, lse, mask=mask_g)
        if HAS_NORMS:  # the page's largest value norm for this KV head, in its code row's norm block
            half = page // norm_rows_per_half
            local = page - half * norm_rows_per_half
            block = (NORM_HALVES - 1) * norm_rows_per_half + (local // NORM_PER_PAGE + 1) * NORM_PER_PAGE - NORM_ROWS
            slot = local % NORM_PER_PAGE + half * NORM_PER_PAGE
            norm = tl.load(Norms + block * norm_row_floats + slot * tl.num_programs(2) + head, mask=live, other=0.0)
            tl.store(NormOut + row * stride_non + head * stride_noh + col, norm)
        tl.store(Err + out, err, mask=mask_g)


def key_code_pages_triton(
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
    """:func:`key_code_pages` as one Triton launch (GPU; CPU tensors under ``TRITON_INTERPRET=1``).

    The grid is ``(P, n, Hkv)``, all known from the input shapes: nothing is read back
    to the host, so it runs inside a captured graph. Each program reads its page's id,
    then the page's codes straight from the pool by that id (``D / 2`` bytes a token)
    and its range, and scores every query head of its KV head's group.

    Bytes read per listed page (Llama-3.1-8B: D 128, 8 KV heads, 32 query heads, page
    16), over its 8 KV heads: the codes 8 x 16 x 64 = 8,192 B and the float32 range
    ``low`` + ``step`` 8 x 2 x 128 x 4 = 8,192 B, plus its id and valid flag (9 B);
    written: lse and error, 2 x 32 x 4 = 256 B. About 16.4 KB, against 64 KiB for the
    page's bf16 K and V (32 KiB for its K alone). The queries (2 KiB per request and
    KV head) are read by every page's program, from cache after the first.

    Args and returns as :func:`key_code_pages`; outputs are float32 on ``q``'s device.
    """
    if not HAS_TRITON:
        raise RuntimeError("key_code_pages_triton needs Triton")
    kv, n, g, d = q.shape
    listed = ids.shape[1]
    if d % 2:
        raise ValueError(f"D={d} must be even (two channels a byte)")
    if codes.dtype != torch.uint8 or codes.shape[0] != kv or codes.shape[3] != d // 2:
        raise ValueError(f"codes {tuple(codes.shape)} {codes.dtype} do not hold D/2 bytes for {kv} KV heads")
    dev = q.device
    if codes.device != dev:
        raise ValueError(f"the code pool is on {codes.device}, q on {dev}: the kernel reads both")
    lse = torch.empty(kv, n, listed, g, dtype=torch.float32, device=dev)
    err = torch.empty(kv, n, listed, g, dtype=torch.float32, device=dev)
    if lse.numel() == 0:
        return lse, err
    # Views where the caller's tensors already fit; the innermost dims must be dense.
    q = q.contiguous()
    codes = codes if codes.stride(3) == 1 else codes.contiguous()
    ids = ids.to(dev, torch.int64).contiguous()
    low = low.to(dev, torch.float32).contiguous()
    step = step.to(dev, torch.float32).contiguous()
    valid = valid.to(dev).contiguous()
    valid = valid.view(torch.uint8) if valid.dtype == torch.bool else valid.to(torch.uint8)
    page_size = codes.shape[2]
    half = d // 2
    _key_code_pages_kernel[(listed, n, kv)](
        q, codes, ids, low, step, ids, valid, lse, err, lse, lse,
        float(logit_cap), float(margin), 1.0,
        q.stride(0), q.stride(1), q.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2),
        ids.stride(0),
        low.stride(0), low.stride(1), low.stride(2),
        step.stride(0), step.stride(1), step.stride(2),
        valid.stride(0),
        lse.stride(0), lse.stride(1), lse.stride(2), 1, 0, 1, 0, 0, 0,
        **_meta(g, half, page_size, logit_cap, ranged=False),
    )  # fmt: skip
    return lse, err


def _meta(g: int, half: int, page_size: int, logit_cap: float, *, ranged: bool) -> dict:
    """The key-code kernel's compile-time arguments (``ranged``: range tables and norms)."""
    return dict(
        GROUP=g,
        HALF=half,
        PAGE_SIZE=page_size,
        BLOCK_G=next_power_of_2(g),
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_T=min(next_power_of_2(page_size), TRITON_BLOCK_T),
        HAS_CAP=logit_cap > 0,
        RANGED=ranged,
        HAS_NORMS=ranged,
        num_warps=4,
    )


def key_code_pages_ranged(
    q: torch.Tensor,
    codes: torch.Tensor,
    ids: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    range_ids: torch.Tensor,
    valid: torch.Tensor,
    norms: torch.Tensor,
    norm_layout: tuple,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
    margin: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`key_code_pages_triton` for a captured step, with nothing prepared around the
    launch: the queries unscaled in their own layout, each page's range read from the range
    tables by its row (the step ``(max - min) / 15`` computed in the kernel, as ``steps`` does
    on the host), the results in query-head order.

    Args:
        q: ``[n, Hq, D]`` the queries (scaled by ``sm_scale`` in the kernel).
        codes, ids, valid: as :func:`key_code_pages`.
        key_min, key_max: ``[rows, Hkv, D]`` one layer's range tables (any float dtype).
        range_ids: int ``[n, P]`` each listed page's row in them.
        norms: float32, one layer's bytes as floats, where each code row's value norms are.
        norm_layout: ``(halves, rows_per_half, per_page, row_floats, kv_heads, norm_rows)``:
            code rows ``per_page`` to a page in each of ``halves``, ``rows_per_half`` a half,
            ``row_floats`` floats each; the last ``norm_rows`` of a page in its last half hold
            the norms of its other rows (K rows first), ``kv_heads`` floats a row.

    Returns:
        (lse, err), float32 ``[n, Hq, P]`` each (query head ``h`` of KV head ``h // (Hq / Hkv)``),
        and each listed page's value norms ``[n, Hkv, P]`` in ``norms``' dtype (0 where not valid).
    """
    if not HAS_TRITON:
        raise RuntimeError("key_code_pages_ranged needs Triton")
    n, hq, d = q.shape
    kv = codes.shape[0]
    g = hq // kv
    listed = ids.shape[1]
    if d % 2 or hq % kv or codes.shape[3] != d // 2 or key_min.shape[1:] != (kv, d) or key_max.shape != key_min.shape:
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, codes {tuple(codes.shape)}, ranges {tuple(key_min.shape)}"
        )
    if range_ids.shape != ids.shape or valid.shape != ids.shape:
        raise ValueError(f"range_ids {tuple(range_ids.shape)} / valid {tuple(valid.shape)} / ids {tuple(ids.shape)}")
    if ids.stride(1) != 1 or range_ids.stride(1) != 1 or valid.stride(1) != 1:
        raise ValueError("ids, range_ids and valid must be contiguous along their pages")
    if q.stride(-1) != 1 or codes.stride(3) != 1 or key_min.stride(-1) != 1 or key_max.stride(-1) != 1:
        raise ValueError("q, codes and the range tables must be contiguous in their last dimension")
    halves, rows_per_half, per_page, row_floats, heads, norm_rows = norm_layout
    if heads != kv or norms.dim() != 1:
        raise ValueError(f"norms: one layer's floats, {kv} KV heads a row; not {tuple(norms.shape)} / {heads}")
    dev = q.device
    lse = torch.empty(n, hq, listed, dtype=torch.float32, device=dev)
    err = torch.empty(n, hq, listed, dtype=torch.float32, device=dev)
    norm_out = torch.empty(n, kv, listed, dtype=norms.dtype, device=dev)
    if lse.numel() == 0:
        return lse, err, norm_out
    page_size = codes.shape[2]
    half = d // 2
    # Output [n, Hq, P] written as [Hkv, n, P, g]: KV head h's query heads are rows h * g ...
    _key_code_pages_kernel[(listed, n, kv)](
        q, codes, ids, key_min, key_max, range_ids, valid, lse, err, norms, norm_out,
        float(logit_cap), float(margin), float(sm_scale),
        g * q.stride(1), q.stride(0), q.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2),
        ids.stride(0),
        key_min.stride(0), 0, key_min.stride(1),
        key_max.stride(0), 0, key_max.stride(1),
        valid.stride(0),
        g * lse.stride(1), lse.stride(0), lse.stride(2), lse.stride(1), range_ids.stride(0),
        rows_per_half, row_floats, norm_out.stride(0), norm_out.stride(1),
        **_meta(g, half, page_size, logit_cap, ranged=True),
        NORM_HALVES=halves, NORM_PER_PAGE=per_page, NORM_ROWS=norm_rows,
    )  # fmt: skip
    return lse, err, norm_out
