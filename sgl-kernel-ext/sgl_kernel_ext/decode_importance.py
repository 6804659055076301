"""Split-K decode attention over SGLang's KV layout that also returns page importance.

Layout (what SGLang's token-to-KV pool hands a decode backend):

- ``k_buffer`` ``[num_slots, kv_heads, D]``, ``v_buffer`` ``[num_slots, kv_heads, Dv]``;
  slot ``s`` lives on physical page ``s // page_size``. Page 0 is SGLang's padding
  page: slots on it are masked (``mask_page0``).
- ``q`` ``[bs, q_heads, D]``; ``kv_indptr`` int32 ``[bs + 1]``; ``kv_indices`` int64,
  the token slots of each request concatenated.

Two launches, both over fixed-size buffers so a CUDA graph can capture them:

1. stage 1, grid ``(bs, kv_heads * head_tiles, num_splits)``: one program walks one
   split of one request for the query heads of one KV head, keeping an online
   softmax. When importance is on it also reduces the tile's ``exp(qk - max)`` (the
   same values the P.V product consumes) per page and stores one partial
   log-sum-exp per (request, query head, page). Split boundaries are multiples of
   the page, so every page is finished by exactly one program.
2. stage 2, grid ``(bs, q_heads + page_blocks)``: programs ``[0, q_heads)`` merge the
   splits into the output and the global log-sum-exp (sinks join the denominator
   here); with importance on, each further program takes a block of pages and
   computes ``mass = exp(page_lse - lse)`` per query head, mean over each KV group,
   mean over KV heads. Those programs rebuild every head's log-sum-exp from the
   split log-sum-exps (a few floats per head, with the same arithmetic the head
   programs use) instead of waiting for them, which is what lets importance share
   stage 2's launch instead of paying a third.

All log-sum-exps inside the kernels are base 2 (``exp2`` is the native instruction;
the literals 1.4426950408889634 = log2(e) and 0.6931471805599453 = ln(2) convert);
the ``lse`` handed back is natural log.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .output import DecodeImportanceOutput
from .plan import (
    SUPPORTED_DTYPES,
    DecodeGeometry,
    DecodeTiles,
    cdiv,
    decode_geometry,
    default_num_splits,
    next_power_of_2,
)


def _interpreting() -> bool:
    # Triton's CPU interpreter computes bf16 dots wrongly (Triton 3.8), so under it the
    # bf16 path runs its dots in fp32; compiled kernels keep native bf16 dots.
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _soft_cap_tanh(x):
    # tanh through exp: exp overflowing to inf still yields the right limit (+-1),
    # and it needs nothing beyond tl.exp on every Triton version we support.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _split_chunk(seq_len, num_splits, SPLIT_ALIGN: tl.constexpr):
    # Tokens per split, rounded up to SPLIT_ALIGN (a multiple of page and tile).
    # Stage 1 and stage 2 must agree on this to the token, so both call this.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return tl.maximum(chunk, SPLIT_ALIGN)


@triton.jit
def _decode_importance_stage1(
    Q,
    K,
    V,
    KvIndptr,
    KvIndices,
    MidO,
    MidLse,
    PageLse,
    sm_scale,
    logit_cap,
    num_splits,
    max_pages,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_plb,
    stride_plh,
    GROUP: tl.constexpr,
    HEAD_TILES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    HAS_CAP: tl.constexpr,
    MASK_PAGE0: tl.constexpr,
    IMPORTANCE: tl.constexpr,
    PAGE_PER_WARP: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)

    kv_head = pid_h // HEAD_TILES
    in_group = (pid_h % HEAD_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < GROUP
    heads = kv_head * GROUP + in_group

    kv_start = tl.load(KvIndptr + req)
    seq_len = tl.load(KvIndptr + req + 1) - kv_start
    kv_start = kv_start.to(tl.int64)
    chunk = _split_chunk(seq_len, num_splits, SPLIT_ALIGN)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    if lo < hi:
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_d = offs_d < HEAD_DIM
        mask_dv = offs_dv < V_HEAD_DIM

        if USE_DOT:
            q = tl.load(
                Q + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :],
                other=0.0,
            )
        else:
            # one query head per program: keep q a vector
            q_vec = tl.load(Q + req * stride_qb + kv_head * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)

        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        # running sum of the current page when a page spans several tiles
        page_l = tl.zeros([BLOCK_H], dtype=tl.float32)

        k_head = K + kv_head * stride_kh
        v_head = V + kv_head * stride_vh
        plse_row = PageLse + req * stride_plb + heads * stride_plh

        PAGES_PER_TILE: tl.constexpr = BLOCK_N // PAGE_SIZE if PAGE_SIZE < BLOCK_N else 1
        if PAGE_PER_WARP:
            # The tensor-core layout gives warp w the tile's columns 8w..8w+7, then the
            # same run every 8 * num_warps columns. Putting page w's tokens in exactly
            # those columns keeps each page's sum inside one warp (shuffles, no shared
            # memory round trip and barrier). With importance off the tile keeps the
            # same order, so the output is bitwise the same on and off.
            col = tl.arange(0, BLOCK_N)
            offs_tile = PAGE_SIZE * ((col // 8) % PAGES_PER_TILE) + 8 * (col // (8 * PAGES_PER_TILE)) + col % 8
        else:
            offs_tile = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + offs_tile
            mask_n = offs_n < hi
            slot = tl.load(KvIndices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            valid = mask_n
            if MASK_PAGE0:
                valid = valid & (slot >= PAGE_SIZE)

            if USE_DOT:
                # Page 0 is allocated memory, so its K rows are read like any other and
                # only their logits are dropped below: masking this load by the slot
                # values cost 18 registers per thread (ptxas, sm_90: 114 -> 96), one
                # resident program per SM.
                k = tl.load(
                    k_head + slot[None, :] * stride_ks + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None],
                    other=0.0,
                )
                if IEEE_DOT:
                    qk = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
                else:
                    qk = tl.dot(q, k)
            else:
                k = tl.load(
                    k_head + slot[:, None] * stride_ks + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :],
                    other=0.0,
                )
                qk = tl.sum(q_vec[None, :] * k.to(tl.float32), 1)[None, :]

            qk = qk * sm_scale
            if HAS_CAP:
                qk = logit_cap * _soft_cap_tanh(qk / logit_cap)
            # Rows of padding heads (mask_h false) hold finite logits of a zero query;
            # nothing of theirs is stored.
            qk = tl.where(valid[None, :], qk * 1.4426950408889634, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # a row with no valid token so far keeps -inf; shift by 0 so exp2 gives 0, not NaN
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(qk - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)

            if USE_DOT:
                # V rows of page 0 must read as zeros: p is 0 there, but 0 * inf is NaN.
                v = tl.load(
                    v_head + slot[:, None] * stride_vs + offs_dv[None, :],
                    mask=valid[:, None] & mask_dv[None, :],
                    other=0.0,
                )
                if IEEE_DOT:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
            else:
                v = tl.load(
                    v_head + slot[:, None] * stride_vs + offs_dv[None, :],
                    mask=valid[:, None] & mask_dv[None, :],
                    other=0.0,
                )
                p_vec = tl.sum(p, 0)  # squeeze the single head
                acc = acc * alpha[:, None] + tl.sum(p_vec[:, None] * v.to(tl.float32), 0)[None, :]
            m_i = m_new

            if IMPORTANCE:
                if PAGE_SIZE == 1:
                    # a one-token page's log-sum-exp is its logit
                    tl.store(
                        plse_row[:, None] + offs_n[None, :],
                        qk,
                        mask=mask_h[:, None] & (mask_n & (offs_n < max_pages))[None, :],
                    )
                elif PAGE_SIZE < BLOCK_N:
                    # tiles start page-aligned: the tile is BLOCK_N // PAGE_SIZE whole pages
                    if PAGE_PER_WARP:
                        # column (r * PAGES_PER_TILE + w) * 8 + j holds token 8r + j of page w
                        page_sum = tl.sum(tl.sum(tl.reshape(p, [BLOCK_H, PAGE_SIZE // 8, PAGES_PER_TILE, 8]), 3), 1)
                        # m_ref reduced the same way lands in page_sum's layout, so the
                        # sum below needs no layout conversion of its own
                        m_tile = tl.broadcast_to(m_ref[:, None], [BLOCK_H, BLOCK_N])
                        m_tile = tl.reshape(m_tile, [BLOCK_H, PAGE_SIZE // 8, PAGES_PER_TILE, 8])
                        m_page = tl.max(tl.max(m_tile, 3), 1)
                    else:
                        page_sum = tl.sum(tl.reshape(p, [BLOCK_H, PAGES_PER_TILE, PAGE_SIZE]), 2)
                        m_page = m_ref[:, None]
                    pages = start // PAGE_SIZE + tl.arange(0, PAGES_PER_TILE)
                    tl.store(
                        plse_row[:, None] + pages[None, :],
                        m_page + tl.log2(page_sum),
                        mask=mask_h[:, None] & ((pages * PAGE_SIZE < hi) & (pages < max_pages))[None, :],
                    )
                else:
                    # the page spans PAGE_SIZE // BLOCK_N tiles: carry its sum across them
                    page_l = page_l * alpha + tl.sum(p, 1)
                    page_done = ((start + BLOCK_N) % PAGE_SIZE == 0) | (start + BLOCK_N >= hi)
                    page = start // PAGE_SIZE
                    tl.store(
                        plse_row + page,
                        m_ref + tl.log2(page_l),
                        mask=mask_h & page_done & (page < max_pages),
                    )
                    page_l = tl.where(page_done, 0.0, page_l)

        has_mass = l_i > 0.0
        tl.store(
            MidO + req * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_dv[None, :],
            acc / tl.where(has_mass, l_i, 1.0)[:, None],
            mask=mask_h[:, None] & mask_dv[None, :],
        )
        tl.store(
            MidLse + req * stride_mlb + heads * stride_mlh + split,
            tl.where(has_mass, m_i + tl.log2(l_i), float("-inf")),
            mask=mask_h,
        )


@triton.jit
def _merged_lse(split_lse, sink2, HAS_SINK: tl.constexpr, AXIS: tl.constexpr):
    """Merge split log-sum-exps (base 2) along ``AXIS`` with the sink in the denominator.

    Returns ``(weights, denominator, has_token, lse)``: ``weights`` are each split's
    share before division, ``lse`` the natural-log total (0 where no split saw a valid
    token). Both stage-2 roles call this, so the importance is normalised by exactly
    the log-sum-exp the output gets.
    """
    m = tl.max(split_lse, AXIS)
    if HAS_SINK:
        # the sink joins the denominator only; shift by the larger of the two maxima
        m_all = tl.maximum(m, sink2)
        m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
        w = tl.exp2(split_lse - tl.expand_dims(m_ref, AXIS))
        denom = tl.sum(w, AXIS) + tl.exp2(sink2 - m_ref)
    else:
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(split_lse - tl.expand_dims(m_ref, AXIS))
        denom = tl.sum(w, AXIS)
    # a request with no valid token (empty, or only page-0 slots) is written as zeros
    has_token = m > float("-inf")
    denom = tl.where(has_token, denom, 1.0)
    lse = tl.where(has_token, (m_ref + tl.log2(denom)) * 0.6931471805599453, 0.0)
    return w, denom, has_token, lse


@triton.jit
def _decode_importance_stage2(
    MidO,
    MidLse,
    Sinks,
    KvIndptr,
    Out,
    Lse,
    PageLse,
    Importance,
    ImportanceKv,
    num_splits,
    max_pages,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_plb,
    stride_plh,
    stride_ib,
    stride_kvb,
    stride_kvp,
    NUM_Q_HEADS: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    HAS_SINK: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    WRITE_PER_KV_HEAD: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    role = tl.program_id(1)

    seq_len = tl.load(KvIndptr + req + 1) - tl.load(KvIndptr + req)
    chunk = _split_chunk(seq_len, num_splits, SPLIT_ALIGN)
    used = tl.cdiv(seq_len, chunk)
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < used

    if role < NUM_Q_HEADS:
        # one query head: merge its splits into the output and the log-sum-exp
        head = role
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < V_HEAD_DIM
        split_lse = tl.load(MidLse + req * stride_mlb + head * stride_mlh + offs_s, mask=mask_s, other=float("-inf"))
        sink2 = 0.0
        if HAS_SINK:
            sink2 = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        w, denom, has_token, lse = _merged_lse(split_lse, sink2, HAS_SINK, 0)
        mid = tl.load(
            MidO + req * stride_mob + head * stride_moh + offs_s[:, None] * stride_mos + offs_dv[None, :],
            mask=mask_s[:, None] & mask_dv[None, :],
            other=0.0,
        )
        out = tl.where(has_token, tl.sum(w[:, None] * mid, 0) / denom, 0.0)
        tl.store(
            Out + req * stride_ob + head * stride_oh + offs_dv,
            out.to(Out.dtype.element_ty),
            mask=mask_dv,
        )
        tl.store(Lse + req * stride_lb + head, lse)
    else:
        # a block of pages: every head's log-sum-exp again, then the page masses
        pages = (role - NUM_Q_HEADS) * BLOCK_P + tl.arange(0, BLOCK_P)
        in_request = pages < tl.cdiv(seq_len, PAGE_SIZE)
        in_table = pages < max_pages
        kv = tl.arange(0, KV_PAD)
        g = tl.arange(0, GROUP_PAD)
        mask_kv = kv < NUM_KV_HEADS
        mask_hg = mask_kv[:, None] & (g < GROUP)[None, :]
        heads = kv[:, None] * GROUP + g[None, :]

        # names differ from the other branch's: a compiled `if` needs one type per name
        heads_split_lse = tl.load(
            MidLse + req * stride_mlb + heads[:, :, None] * stride_mlh + offs_s[None, None, :],
            mask=mask_hg[:, :, None] & mask_s[None, None, :],
            other=float("-inf"),
        )
        heads_sink2 = tl.zeros([KV_PAD, GROUP_PAD], dtype=tl.float32)
        if HAS_SINK:
            heads_sink2 = tl.load(Sinks + heads, mask=mask_hg, other=0.0).to(tl.float32) * 1.4426950408889634
        heads_lse = _merged_lse(heads_split_lse, heads_sink2, HAS_SINK, 2)[3]
        lse2 = tl.where(mask_hg, heads_lse, 0.0) * 1.4426950408889634
        page_lse = tl.load(
            PageLse + req * stride_plb + heads[:, :, None] * stride_plh + pages[None, None, :],
            mask=mask_hg[:, :, None] & in_request[None, None, :],
            other=float("-inf"),
        )
        mass = tl.exp2(page_lse - lse2[:, :, None])
        per_kv = tl.sum(mass, 1) * (1.0 / GROUP)
        if WRITE_PER_KV_HEAD:
            tl.store(
                ImportanceKv + req * stride_kvb + pages[None, :] * stride_kvp + kv[:, None],
                per_kv,
                mask=mask_kv[:, None] & in_table[None, :],
            )
        tl.store(
            Importance + req * stride_ib + pages,
            tl.sum(per_kv, 0) * (1.0 / NUM_KV_HEADS),
            mask=in_table,
        )


def _check_inputs(q, k_buffer, v_buffer, kv_indptr, kv_indices):
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3:
        raise ValueError("expected q [bs, q_heads, D], k_buffer [slots, kv_heads, D], v_buffer [slots, kv_heads, Dv]")
    if q.dtype not in SUPPORTED_DTYPES or k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise ValueError(
            f"q/k/v dtypes {q.dtype}/{k_buffer.dtype}/{v_buffer.dtype} must match and be one of {SUPPORTED_DTYPES}"
        )
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the last dim of q, k_buffer and v_buffer must be contiguous")
    if kv_indptr.dtype != torch.int32 or kv_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError("kv_indptr must be int32 and kv_indices int32/int64")
    if kv_indptr.numel() < q.shape[0] + 1:
        raise ValueError(f"kv_indptr has {kv_indptr.numel()} entries for bs={q.shape[0]}")


def decode_importance_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    page_size: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    num_splits: int,
    sm_scale: Optional[float] = None,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    page_lse: Optional[torch.Tensor] = None,
    importance: Optional[torch.Tensor] = None,
    importance_per_kv_head: Optional[torch.Tensor] = None,
    mask_page0: bool = True,
    geometry: Optional[DecodeGeometry] = None,
) -> None:
    """Launch the kernels into caller-owned buffers (no allocation, no host sync).

    Args:
        q: ``[bs, q_heads, D]``.
        k_buffer, v_buffer: ``[num_slots, kv_heads, D]`` / ``[num_slots, kv_heads, Dv]``.
        kv_indptr: int32 ``[>= bs + 1]``; kv_indices: int64 token slots.
        page_size: SGLang page size (power of two).
        out: ``[>= bs, q_heads, Dv]`` written with the output (its dtype).
        lse: float32 ``[>= bs, q_heads]``.
        mid_o: float32 ``[>= bs, q_heads, >= num_splits, Dv]`` split partial outputs.
        mid_lse: float32 ``[>= bs, q_heads, >= num_splits]``.
        num_splits: splits per request (short requests use fewer).
        sm_scale: defaults to ``1 / sqrt(D)``.
        logit_cap: soft-cap ``cap * tanh(s / cap)`` when > 0.
        sinks: optional ``[q_heads]`` per-head sink logits (denominator only).
        page_lse: float32 ``[>= bs, q_heads, max_pages]`` workspace; with ``importance``
            (``[>= bs, max_pages]``) it switches importance on. ``None`` for both runs the
            same kernel with importance compiled out.
        importance_per_kv_head: optional ``[>= bs, max_pages, kv_heads]``.
        mask_page0: slots on physical page 0 (SGLang's padding page) contribute nothing.
        geometry: precomputed tiles (the wrapper passes its own).
    """
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    v_head_dim = v_buffer.shape[2]
    if geometry is None:
        geometry = decode_geometry(num_q_heads, num_kv_heads, head_dim, v_head_dim, page_size)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    want_importance = importance is not None
    if want_importance and page_lse is None:
        raise ValueError("importance needs the page_lse workspace")
    if mid_o.shape[2] < num_splits or mid_lse.shape[2] < num_splits:
        raise ValueError(f"num_splits={num_splits} exceeds the split workspace ({mid_o.shape[2]})")
    if bs == 0:
        return
    max_pages = page_lse.shape[2] if want_importance else 0
    plse = page_lse if want_importance else mid_lse  # any fp32 tensor; never touched when off

    grid1 = (bs, num_kv_heads * geometry.head_tiles, num_splits)
    _decode_importance_stage1[grid1](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        mid_o,
        mid_lse,
        plse,
        float(sm_scale),
        float(logit_cap),
        num_splits,
        max_pages,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        plse.stride(0),
        plse.stride(1),
        GROUP=geometry.group_size,
        HEAD_TILES=geometry.head_tiles,
        BLOCK_H=geometry.block_h,
        BLOCK_N=geometry.block_n,
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        BLOCK_D=geometry.block_d,
        BLOCK_DV=geometry.block_dv,
        PAGE_SIZE=page_size,
        SPLIT_ALIGN=geometry.split_align,
        USE_DOT=geometry.use_dot,
        IEEE_DOT=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreting()),
        HAS_CAP=logit_cap > 0,
        MASK_PAGE0=mask_page0,
        IMPORTANCE=want_importance,
        PAGE_PER_WARP=geometry.page_per_warp,
        num_warps=geometry.num_warps,
        num_stages=geometry.num_stages,
    )

    has_sink = sinks is not None
    group_pad = next_power_of_2(geometry.group_size)
    kv_pad = next_power_of_2(num_kv_heads)
    # a [kv, group, pages] tile of about 4K floats per importance program
    block_p = max(16, min(128, 4096 // (group_pad * kv_pad)))
    page_blocks = cdiv(max_pages, block_p) if want_importance else 0
    per_kv = want_importance and importance_per_kv_head is not None
    imp = importance if want_importance else mid_lse  # any fp32 tensors; never touched when off
    imp_kv = importance_per_kv_head if per_kv else imp
    _decode_importance_stage2[(bs, num_q_heads + page_blocks)](
        mid_o,
        mid_lse,
        sinks if has_sink else mid_lse,
        kv_indptr,
        out,
        lse,
        plse,
        imp,
        imp_kv,
        num_splits,
        max_pages,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        plse.stride(0),
        plse.stride(1),
        imp.stride(0),
        imp_kv.stride(0),
        imp_kv.stride(1) if per_kv else 0,
        NUM_Q_HEADS=num_q_heads,
        V_HEAD_DIM=v_head_dim,
        BLOCK_DV=geometry.block_dv,
        SPLITS_PAD=next_power_of_2(mid_o.shape[2]),
        SPLIT_ALIGN=geometry.split_align,
        HAS_SINK=has_sink,
        GROUP=geometry.group_size,
        NUM_KV_HEADS=num_kv_heads,
        GROUP_PAD=group_pad,
        KV_PAD=kv_pad,
        PAGE_SIZE=page_size,
        BLOCK_P=block_p,
        WRITE_PER_KV_HEAD=per_kv,
        num_warps=4,
    )


class DecodeImportanceWrapper:
    """Decode attention with page importance over preallocated, address-stable buffers.

    Mirrors FlashInfer's wrapper shape: the constructor fixes the model shape and
    allocates every buffer once for ``max_batch_size``; ``run()`` only launches, so it
    can be captured in a CUDA graph (one graph per batch size, as SGLang does). The
    tensors ``run()`` returns are views of the wrapper's buffers and are overwritten
    by the next call.

    Args:
        max_batch_size: largest ``bs`` ``run()`` will see.
        num_q_heads, num_kv_heads, head_dim: model shape per rank.
        max_pages: importance columns per request; pages past it get no importance
            (attention itself is unaffected), so size it for ``max_context / page_size``.
        v_head_dim: defaults to ``head_dim``.
        page_size: SGLang page size (power of two).
        max_splits: split workspace depth (upper bound on ``num_splits``).
        dtype: output dtype (must match q).
        per_kv_head: also keep ``[bs, max_pages, kv_heads]`` importance.
        importance: allocate the importance buffers at all; ``False`` gives a plain
            decode attention with the same kernel.
        tiles: stage-1 shape of the grouped path (``plan.TILE_CANDIDATES``); the
            default is ``plan.GROUPED_TILES``. For the benchmark's sweeps.
    """

    def __init__(
        self,
        max_batch_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_pages: int,
        v_head_dim: Optional[int] = None,
        page_size: int = 1,
        max_splits: int = 32,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        per_kv_head: bool = False,
        importance: bool = True,
        mask_page0: bool = True,
        tiles: Optional[DecodeTiles] = None,
    ):
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if max_batch_size < 1 or max_splits < 1 or max_pages < 1:
            raise ValueError(
                f"max_batch_size={max_batch_size}, max_splits={max_splits}, max_pages={max_pages} must be >= 1"
            )
        self.geometry = decode_geometry(num_q_heads, num_kv_heads, head_dim, v_head_dim, page_size, tiles)
        self.max_batch_size = max_batch_size
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.page_size = page_size
        self.max_pages = max_pages
        self.max_splits = max_splits
        self.dtype = dtype
        self.device = torch.device(device)
        self.mask_page0 = mask_page0
        self.has_importance = importance

        f32 = dict(dtype=torch.float32, device=self.device)
        self.out = torch.zeros(max_batch_size, num_q_heads, v_head_dim, dtype=dtype, device=self.device)
        self.lse = torch.zeros(max_batch_size, num_q_heads, **f32)
        self.mid_o = torch.empty(max_batch_size, num_q_heads, max_splits, v_head_dim, **f32)
        self.mid_lse = torch.empty(max_batch_size, num_q_heads, max_splits, **f32)
        if importance:
            self.page_lse = torch.empty(max_batch_size, num_q_heads, max_pages, **f32)
            self.importance = torch.zeros(max_batch_size, max_pages, **f32)
            self.importance_per_kv_head = (
                torch.zeros(max_batch_size, max_pages, num_kv_heads, **f32) if per_kv_head else None
            )
        else:
            self.page_lse = self.importance = self.importance_per_kv_head = None

    def num_splits_for(self, batch_size: int) -> int:
        """The split count ``run()`` uses by default for this batch size."""
        return default_num_splits(batch_size, self.num_kv_heads, self.geometry, self.max_splits, self.device)

    def run(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        *,
        sm_scale: Optional[float] = None,
        logit_cap: float = 0.0,
        sinks: Optional[torch.Tensor] = None,
        num_splits: Optional[int] = None,
        importance: bool = True,
        out: Optional[torch.Tensor] = None,
    ) -> DecodeImportanceOutput:
        """One decode step for ``bs = q.shape[0]`` requests.

        Args:
            q: ``[bs, q_heads, D]``; k_buffer/v_buffer ``[slots, kv_heads, D|Dv]``;
            kv_indptr: int32 ``[bs + 1]``; kv_indices: int64 slots.
            importance: ``False`` runs the baseline kernel (importance compiled out)
                and returns ``importance=None``.
            out: optional ``[bs, q_heads, Dv]`` destination instead of the wrapper's.

        Returns:
            DecodeImportanceOutput of views into static buffers.
        """
        _check_inputs(q, k_buffer, v_buffer, kv_indptr, kv_indices)
        bs = q.shape[0]
        if bs > self.max_batch_size:
            raise ValueError(f"bs={bs} exceeds max_batch_size={self.max_batch_size}")
        if (q.shape[1], k_buffer.shape[1], q.shape[2], v_buffer.shape[2]) != (
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
        ):
            raise ValueError("q/k/v shapes do not match the wrapper's model shape")
        importance = importance and self.has_importance
        if num_splits is None:
            num_splits = self.num_splits_for(bs)
        out = self.out[:bs] if out is None else out
        decode_importance_fwd(
            q,
            k_buffer,
            v_buffer,
            kv_indptr,
            kv_indices,
            page_size=self.page_size,
            out=out,
            lse=self.lse,
            mid_o=self.mid_o,
            mid_lse=self.mid_lse,
            num_splits=num_splits,
            sm_scale=sm_scale,
            logit_cap=logit_cap,
            sinks=sinks,
            page_lse=self.page_lse if importance else None,
            importance=self.importance if importance else None,
            importance_per_kv_head=self.importance_per_kv_head if importance else None,
            mask_page0=self.mask_page0,
            geometry=self.geometry,
        )
        return DecodeImportanceOutput(
            output=out[:bs],
            lse=self.lse[:bs],
            importance=self.importance[:bs] if importance else None,
            importance_per_kv_head=(
                self.importance_per_kv_head[:bs] if importance and self.importance_per_kv_head is not None else None
            ),
        )


def decode_attention_with_importance(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    page_size: int,
    max_pages: int,
    sm_scale: Optional[float] = None,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    max_splits: int = 32,
    importance: bool = True,
    per_kv_head: bool = False,
    mask_page0: bool = True,
) -> DecodeImportanceOutput:
    """One-shot convenience: allocates a wrapper for this call (not for CUDA graphs)."""
    wrapper = DecodeImportanceWrapper(
        q.shape[0],
        q.shape[1],
        k_buffer.shape[1],
        q.shape[2],
        max_pages=max_pages,
        v_head_dim=v_buffer.shape[2],
        page_size=page_size,
        max_splits=max(max_splits, num_splits or 1),
        dtype=q.dtype,
        device=q.device,
        per_kv_head=per_kv_head,
        importance=importance,
        mask_page0=mask_page0,
    )
    return wrapper.run(
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        sm_scale=sm_scale,
        logit_cap=logit_cap,
        sinks=sinks,
        num_splits=num_splits,
        importance=importance,
    )
