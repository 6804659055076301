"""Exact attention over a fixed page list, restricted by a page mask: the guard's reads.

A guarded hot-set layer reads some of a request's unread pages exactly, in rounds, and
which ones depends on that layer's estimates (device values). So that no round waits on
the host, the list is fixed for the whole step, ``pages`` ``[n, P]`` (physical page ids,
padded), and a round names its pages with a bool ``mask`` ``[n, P]``: nothing is planned
per round and the shapes never depend on the mask. Every listed page is full (the guard
lists full pages only); a row with no page chosen gets lse ``-inf`` and output 0, which
merges with another part of the softmax as nothing.

- :func:`masked_page_attention` (Triton, CUDA): reads only the chosen pages (a masked
  page costs its mask load), split over the list (split-K) and merged on the device;
  :func:`masked_page_parts`, the same kernel a split a page: each chosen page's own part
  (the guard's sampled pages in a captured step);
- :func:`page_parts` and :func:`merge_page_parts` (torch, any device): every listed
  page's own log-sum-exp and output once, then any mask's pages as one softmax part.
  This reads every listed page once, whatever the masks; it is the CPU's path and the
  reference (:func:`masked_page_attention_reference`).

Log-sum-exps are natural logs at the interface (base 2 inside the kernel). Knows
nothing of SGLang.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the CPU path runs without Triton
    HAS_TRITON = False

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634
# Pages a split of the kernel walks at least, and the programs a launch aims at (the splits
# per request shrink as rows and KV heads grow): a split walks its columns one by one, a mask
# load each, so short splits keep that chain short. On an H200 at 32K, batch 1, 16 pages a
# split and at most 32 splits took ~230 us a guarded layer (~2,000 listed, ~60 a split).
PAGES_PER_SPLIT = 4
PROGRAMS = 4096
# Splits the merge folds at a time.
MERGE_BLOCK = 32


class PageParts(NamedTuple):
    """Every listed page's own softmax part, per query head.

    Attributes:
        lse: float32 ``[n, Hq, P]`` each page's log-sum-exp.
        output: float32 ``[n, Hq, P, Dv]`` each page's own softmax output.
    """

    lse: torch.Tensor
    output: torch.Tensor


def page_parts(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> PageParts:
    """Each listed page's exact log-sum-exp and output, on its own.

    Args:
        q: ``[n, Hq, D]``.
        keys, values: ``[n, P, page_size, Hkv, D]`` the listed pages' K and V (e.g.
            ``k_pages[pages]``; a caller may put pages from elsewhere, host copies, in).
    """
    n, hq, d = q.shape
    hkv = keys.shape[3]
    g = hq // hkv
    qf = (q.float() * sm_scale).view(n, hkv, g, d).transpose(0, 1)  # [Hkv, n, g, D]
    k = keys.float().permute(3, 0, 1, 2, 4)  # [Hkv, n, P, ps, D]
    v = values.float().permute(3, 0, 1, 2, 4)
    logits = torch.matmul(qf[:, :, None], k.transpose(-1, -2))  # [Hkv, n, P, g, ps]
    if logit_cap > 0:
        logits = torch.tanh(logits / logit_cap) * logit_cap
    lse = torch.logsumexp(logits, dim=-1)  # [Hkv, n, P, g]
    out = torch.matmul(torch.exp(logits - lse[..., None]), v)  # [Hkv, n, P, g, Dv]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [Hkv, n, P, g, ...] -> [n, Hq, P, ...]
        x = x.transpose(2, 3)
        return x.transpose(0, 1).reshape(n, hq, *x.shape[3:])

    return PageParts(heads(lse), heads(out))


def merge_page_parts(parts: PageParts, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``mask``-ed pages' parts as one: ``(lse [n, Hq], output [n, Hq, Dv])``, float32.

    Args:
        mask: bool ``[n, P]``.
    """
    lse_pages = parts.lse.masked_fill(~mask[:, None, :], NEG_INF)
    return _merge(lse_pages, parts.output)


def _merge(lse_parts: torch.Tensor, out_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts ``[n, Hq, S]`` / ``[n, Hq, S, Dv]`` over disjoint tokens, as one part."""
    lse = torch.logsumexp(lse_parts, dim=-1)  # -inf where no part has a token
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    weight = torch.where(torch.isfinite(lse_parts), torch.exp(lse_parts - safe[..., None]), 0.0)
    return lse, (weight[..., None] * out_parts).sum(dim=2)


def masked_page_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    pages: torch.Tensor,
    mask: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`masked_page_attention` in torch (any device)."""
    parts = page_parts(q, k_pages[pages], v_pages[pages], sm_scale=sm_scale, logit_cap=logit_cap)
    return merge_page_parts(parts, mask)


def masked_page_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    pages: torch.Tensor,
    mask: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
    num_splits: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over each request's chosen listed pages, in one softmax part.

    Args:
        q: ``[n, Hq, D]``.
        k_pages, v_pages: ``[num_pages, page_size, Hkv, D]`` the pool viewed as pages.
        pages: int64 ``[n, P]`` physical page ids; entries not in ``mask`` are never read.
        mask: bool ``[n, P]`` the pages to read.
        num_splits: splits of the list per request (tests); None: one per
            ``PAGES_PER_SPLIT`` pages, at most ``PROGRAMS`` over rows x KV heads.

    Returns:
        ``(lse [n, Hq], output [n, Hq, Dv])`` float32; lse -inf and output 0 where a
        row reads nothing.
    """
    listed = pages.shape[1]
    room = max(1, PROGRAMS // max(1, q.shape[0] * v_pages.shape[2]))
    splits = num_splits or max(1, min(room, -(-listed // PAGES_PER_SPLIT)))
    return _merge_splits(*_launch(q, k_pages, v_pages, pages, mask, sm_scale, logit_cap, splits))


def masked_page_parts(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    pages: torch.Tensor,
    mask: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> PageParts:
    """Each chosen listed page's own softmax part, in one Triton launch (one split a page):
    :func:`page_parts` of ``k_pages[pages]``, read straight from the pool, with lse -inf
    and output 0 where ``mask`` is False (those pages are never read). The arguments are
    :func:`masked_page_attention`'s."""
    return PageParts(*_launch(q, k_pages, v_pages, pages, mask, sm_scale, logit_cap, pages.shape[1]))


def _merge_splits(lse_parts: torch.Tensor, out_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_merge`` of the kernel's splits in one Triton launch (grid ``(n, Hq)``)."""
    n, hq, splits, dv = out_parts.shape
    lse = torch.empty(n, hq, dtype=torch.float32, device=out_parts.device)
    out = torch.empty(n, hq, dv, dtype=torch.float32, device=out_parts.device)
    if n and hq:
        _merge_splits_kernel[(n, hq)](
            lse_parts, out_parts, lse, out, splits, dv,
            BLOCK_S=min(MERGE_BLOCK, triton.next_power_of_2(splits)), BLOCK_DV=triton.next_power_of_2(dv),
        )  # fmt: skip
    return lse, out


def _launch(q, k_pages, v_pages, pages, mask, sm_scale, logit_cap, splits) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over ``splits`` even runs of each row's list: ``(lse [n, Hq, splits],
    output [n, Hq, splits, Dv])``, each split's own part."""
    if not HAS_TRITON:
        raise RuntimeError("masked_page_attention needs Triton")
    if q.stride(-1) != 1 or k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("q, k_pages and v_pages must be contiguous in their last dimension")
    n, hq, d = q.shape
    _, ps, hkv, dv = v_pages.shape
    listed = pages.shape[1]
    g = hq // hkv
    lse_parts = torch.empty(n, hq, splits, dtype=torch.float32, device=q.device)
    out_parts = torch.empty(n, hq, splits, dv, dtype=torch.float32, device=q.device)
    if n == 0 or listed == 0:
        return lse_parts.fill_(NEG_INF), out_parts.zero_()
    q = q.contiguous()
    # Read where they lie (the step's buffers: a column slice keeps its rows' stride).
    chosen = mask if mask.stride(-1) == 1 else mask.contiguous()
    pages = pages if pages.stride(-1) == 1 else pages.contiguous()
    _masked_pages_kernel[(n, hkv, splits)](
        q, k_pages, v_pages, pages, chosen, lse_parts, out_parts,
        float(sm_scale), float(logit_cap),
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        pages.stride(0), chosen.stride(0),
        lse_parts.stride(0), lse_parts.stride(1),
        out_parts.stride(0), out_parts.stride(1), out_parts.stride(2),
        listed, -(-listed // splits),
        G=g, D=d, DV=dv, PAGE_SIZE=ps,
        BLOCK_G=triton.next_power_of_2(g), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_DV=triton.next_power_of_2(dv), BLOCK_T=triton.next_power_of_2(ps),
        HAS_CAP=logit_cap > 0,
    )  # fmt: skip
    return lse_parts, out_parts


if HAS_TRITON:

    @triton.jit
    def _soft_cap_tanh(x):
        # tanh through exp: exp overflowing to inf still yields the right limit (+-1).
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _masked_pages_kernel(
        Q, K, V, Pages, Mask, LseParts, OutParts,
        sm_scale, logit_cap,
        stride_qn, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_pn, stride_mn,
        stride_ln, stride_lh,
        stride_on, stride_oh, stride_os,
        listed, chunk,
        G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
        HAS_CAP: tl.constexpr,
    ):  # fmt: skip
        """One (request, KV head, split): an online softmax over the split's chosen pages."""
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_t = tl.arange(0, BLOCK_T)
        mask_g = offs_g < G
        mask_d = offs_d < D
        mask_dv = offs_dv < DV
        mask_t = offs_t < PAGE_SIZE
        heads = kv_head * G + offs_g
        q = tl.load(
            Q + row * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)
        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, listed)
        for col in range(lo, hi):
            chosen = tl.load(Mask + row * stride_mn + col)
            if chosen != 0:
                page = tl.load(Pages + row * stride_pn + col).to(tl.int64)
                k = tl.load(
                    K + page * stride_kp + offs_t[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=mask_t[:, None] & mask_d[None, :],
                    other=0.0,
                ).to(tl.float32)  # [T, D]
                qk = tl.sum(q[:, None, :] * k[None, :, :], 2) * sm_scale  # [G, T]
                if HAS_CAP:
                    qk = logit_cap * _soft_cap_tanh(qk / logit_cap)
                qk = qk * 1.4426950408889634  # base 2 from here
                qk = tl.where(mask_g[:, None] & mask_t[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_ref)
                p = tl.exp2(qk - m_ref[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    V + page * stride_vp + offs_t[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                    mask=mask_t[:, None] & mask_dv[None, :],
                    other=0.0,
                ).to(tl.float32)  # [T, DV]
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
                m_i = m_new
        has = l_i > 0
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(LseParts + row * stride_ln + heads * stride_lh + split, lse, mask=mask_g)
        tl.store(
            OutParts + row * stride_on + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :],
            out,
            mask=mask_g[:, None] & mask_dv[None, :],
        )

    @triton.jit
    def _merge_splits_kernel(LseParts, OutParts, Lse, Out, splits, dv, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
        """One (request, query head): its splits' parts (contiguous) as one, ``BLOCK_S`` at a time
        (a running maximum); -inf and 0 where none has a token."""
        rh = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_DV)
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_DV], tl.float32)
        for s0 in range(0, splits, BLOCK_S):
            s = s0 + offs_s
            x = tl.load(LseParts + rh * splits + s, mask=s < splits, other=float("-inf"))
            new_m = tl.maximum(m, tl.max(x, 0))
            ref = tl.where(new_m == float("-inf"), 0.0, new_m)
            keep = tl.exp(m - ref)  # 0 while nothing has come
            w = tl.where(x > float("-inf"), tl.exp(x - ref), 0.0)
            o = tl.load(
                OutParts + (rh * splits + s[:, None]) * dv + offs_d[None, :],
                mask=(s[:, None] < splits) & (offs_d[None, :] < dv),
                other=0.0,
            )
            total = total * keep + tl.sum(w, 0)
            acc = acc * keep + tl.sum(w[:, None] * o, 0)
            m = new_m
        has = total > 0
        ref = tl.where(m == float("-inf"), 0.0, m)
        tl.store(Lse + rh, tl.where(has, ref + tl.log(tl.where(has, total, 1.0)), float("-inf")))
        tl.store(Out + rh * dv + offs_d, acc / tl.where(has, total, 1.0), mask=offs_d < dv)
