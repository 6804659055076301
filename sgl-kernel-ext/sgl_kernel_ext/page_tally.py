"""One layer's page tally in one launch: what a captured hot-set step keeps of each page.

For each request ``b`` and listed column ``j`` of a decode layer, into a float32
``tally[3, rows, pages]`` kept across the step's layers:

- ``tally[0, b, j] += mean_kv per_kv[b, j, kv]``: the page's exact mass, summed over layers;
- ``tally[1, b, j] = max(tally[1, b, j], max_kv per_kv[b, j, kv])``: the largest over layers
  and KV heads;
- ``tally[2, b, p] = max(tally[2, b, p], max_h bound)`` for page ``p`` of the request whose
  key range has id ``ids[b, p]`` (0: none): ``bound = sm_scale * sum_d max(q_d min_d,
  q_d max_d)`` (capped like the logits) ``+ log(page_size) - lse[b, h]``, the log of the
  most mass the page's tokens could hold against the layer's denominator (Quest's bound;
  a page without a range counts as -inf). ``ids`` None: no page is bounded (``tally[2]`` as it was).

A Triton kernel with a fixed grid (rows x page blocks x KV heads: no host sync, no
allocation, safe in a CUDA graph) and a torch path with the same contract (fixed shapes
too), for the CPU and as the reference. Each KV head's program bounds its pages for its
query heads (unrolled, so their loads go out together) and meets the others in an atomic
max. Until 2026-12-04 one program walked every KV head and query head of its pages in
turn: 26 us a layer on an H200 at 32K, batch 1 (32 programs for 2,048 pages, a chain of
48 dependent loads each), 10 % of the captured hot-set step.

Knows nothing of SGLang.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the torch backend runs without Triton
    HAS_TRITON = False

SUM, MAX, BOUND = 0, 1, 2


def _check(per_kv, q, lse, key_min, key_max, ids, tally):
    bs, pages, kv = per_kv.shape
    if tally.dim() != 3 or tally.shape[0] != 3 or tally.shape[1] < bs or tally.shape[2] != pages:
        raise ValueError(f"tally must be [3, >= {bs}, {pages}], got {tuple(tally.shape)}")
    if tally.dtype != torch.float32 or not tally.is_contiguous():
        raise ValueError("tally must be a contiguous float32 tensor")
    if ids is not None and ids.shape != (bs, pages):
        raise ValueError(f"ids must be [{bs}, {pages}], got {tuple(ids.shape)}")
    if q.dim() != 3 or q.shape[0] != bs or q.shape[1] % kv or lse.shape != q.shape[:2]:
        raise ValueError("q must be [bs, q_heads, D] (q_heads a multiple of kv_heads) and lse [bs, q_heads]")
    if key_min.shape != key_max.shape or key_min.dim() != 3 or key_min.shape[1:] != (kv, q.shape[2]):
        raise ValueError("key_min/key_max must be [range_ids, kv_heads, D]")


def tally_pages_torch(per_kv, q, lse, key_min, key_max, ids, tally, *, sm_scale, logit_cap=0.0, page_size):
    """The torch path of :func:`tally_pages` (same arguments)."""
    bs, pages, kv = per_kv.shape
    hq, dim = q.shape[1:]
    f32 = torch.float32
    tally[SUM, :bs].add_(per_kv.to(f32).mean(dim=-1))
    torch.maximum(tally[MAX, :bs], per_kv.to(f32).amax(dim=-1), out=tally[MAX, :bs])
    if ids is None:
        return tally
    flat = ids.reshape(-1)
    kmin = key_min.index_select(0, flat).view(bs, pages, kv, dim).to(f32)
    kmax = key_max.index_select(0, flat).view(bs, pages, kv, dim).to(f32)
    qg = q.to(f32).view(bs, kv, hq // kv, dim)
    # The positive part of q meets the largest key value, the negative part the smallest.
    bound = torch.einsum("bhgd,bphd->bphg", qg.clamp(min=0), kmax)
    bound += torch.einsum("bhgd,bphd->bphg", qg.clamp(max=0), kmin)
    bound = bound.reshape(bs, pages, hq) * sm_scale
    if logit_cap > 0:
        bound = logit_cap * torch.tanh(bound / logit_cap)
    log_mass = bound + math.log(page_size) - lse.to(f32)[:, None, :]
    # A page without a range (id 0, whatever that row holds: a pool's padding slot) and a
    # NaN count as nothing, as in the kernel.
    inf = float("inf")
    log_mass = log_mass.masked_fill((ids == 0)[:, :, None], -inf)
    best = torch.nan_to_num(log_mass, nan=-inf, posinf=inf, neginf=-inf).amax(dim=-1)
    torch.maximum(tally[BOUND, :bs], best, out=tally[BOUND, :bs])
    return tally


if HAS_TRITON:

    @triton.jit
    def _tally_pages_kernel(
        PerKv,
        Q,
        Lse,
        KeyMin,
        KeyMax,
        Ids,
        Tally,
        pages,
        sm_scale,
        logit_cap,
        log_page,
        stride_pb,
        stride_pp,
        stride_qb,
        stride_qh,
        stride_lb,
        stride_kr,
        stride_kh,
        stride_ib,
        stride_tt,
        stride_tb,
        KV: tl.constexpr,
        GROUP: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_P: tl.constexpr,
        HAS_CAP: tl.constexpr,
        HAS_IDS: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        kvh = tl.program_id(2)
        in_row = cols < pages
        row = Tally + b * stride_tb + cols
        if kvh == 0:
            # Exact masses: the mean and the largest over KV heads.
            total = tl.zeros([BLOCK_P], dtype=tl.float32)
            most = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
            for h in tl.static_range(KV):
                m = tl.load(PerKv + b * stride_pb + cols * stride_pp + h, mask=in_row, other=0.0).to(tl.float32)
                total += m
                most = tl.maximum(most, m)
            tl.store(row, tl.load(row, mask=in_row) + total / KV, mask=in_row)  # tally[0]
            tl.store(row + stride_tt, tl.maximum(tl.load(row + stride_tt, mask=in_row), most), mask=in_row)  # [1]
        if HAS_IDS:
            # Key bounds of the row's pages with a range, largest over this KV head's query heads;
            # the KV heads' programs meet in an atomic max (exact, so the order does not matter).
            d = tl.arange(0, BLOCK_D)
            in_dim = d < DIM
            ids = tl.load(Ids + b * stride_ib + cols, mask=in_row, other=0).to(tl.int64)
            ranged = in_row & (ids > 0)
            box = ranged[:, None] & in_dim[None, :]
            at = ids[:, None] * stride_kr + kvh * stride_kh + d[None, :]
            low = tl.load(KeyMin + at, mask=box, other=0.0).to(tl.float32)
            high = tl.load(KeyMax + at, mask=box, other=0.0).to(tl.float32)
            best = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
            for g in tl.static_range(GROUP):
                head = kvh * GROUP + g
                qv = tl.load(Q + b * stride_qb + head * stride_qh + d, mask=in_dim, other=0.0).to(tl.float32)
                bound = tl.sum(tl.where(qv[None, :] > 0, qv[None, :] * high, qv[None, :] * low), axis=1) * sm_scale
                if HAS_CAP:
                    # cap * tanh(x / cap), from exp (tanh is increasing: the capped bound bounds)
                    t = tl.exp(-2.0 * tl.abs(bound / logit_cap))
                    bound = logit_cap * tl.where(bound >= 0, 1.0, -1.0) * (1.0 - t) / (1.0 + t)
                log_mass = bound + log_page - tl.load(Lse + b * stride_lb + head).to(tl.float32)
                best = tl.maximum(best, log_mass)
            tl.atomic_max(row + 2 * stride_tt, best, mask=ranged)  # tally[2]


def tally_pages(
    per_kv: torch.Tensor,
    q: torch.Tensor,
    lse: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    ids: Optional[torch.Tensor],
    tally: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
    page_size: int,
    use_triton: Optional[bool] = None,
) -> torch.Tensor:
    """Add one layer to ``tally`` (see the module docstring).

    Args:
        per_kv: ``[bs, pages, kv_heads]`` each listed page's exact mass per KV head.
        q: ``[bs, q_heads, D]`` the layer's queries; lse: ``[bs, q_heads]`` its log denominators.
        key_min, key_max: ``[range_ids, kv_heads, D]`` the layer's key ranges (row 0: none).
        ids: int64 ``[bs, pages]`` the range id of each of the request's pages (0: none);
            None: no bounds (no row ranks its unread pages by them).
        tally: float32 ``[3, >= bs, pages]``, updated in place.
        use_triton: default: Triton for CUDA tensors, torch otherwise.

    Returns:
        ``tally``.
    """
    _check(per_kv, q, lse, key_min, key_max, ids, tally)
    if use_triton is None:
        use_triton = HAS_TRITON and per_kv.is_cuda
    run = dict(sm_scale=sm_scale, logit_cap=logit_cap, page_size=page_size)
    if not use_triton:
        return tally_pages_torch(per_kv, q, lse, key_min, key_max, ids, tally, **run)
    if not HAS_TRITON:
        raise RuntimeError("use_triton=True but triton is not installed")
    bs, pages, kv = per_kv.shape
    if bs == 0:
        return tally
    dim = q.shape[2]
    if per_kv.stride(2) != 1 or q.stride(2) != 1 or key_min.stride() != key_max.stride() or key_min.stride(2) != 1:
        raise ValueError("per_kv, q and the key ranges must be contiguous in their last dimension")
    block_d = triton.next_power_of_2(dim)
    block_p = max(16, min(128, 8192 // block_d))
    grid = (bs, triton.cdiv(pages, block_p), kv if ids is not None else 1)
    _tally_pages_kernel[grid](
        per_kv, q, lse, key_min, key_max, per_kv if ids is None else ids, tally,
        pages, float(sm_scale), float(logit_cap), math.log(page_size),
        per_kv.stride(0), per_kv.stride(1), q.stride(0), q.stride(1), lse.stride(0),
        key_min.stride(0), key_min.stride(1), 0 if ids is None else ids.stride(0), tally.stride(0), tally.stride(1),
        KV=kv, GROUP=q.shape[1] // kv, DIM=dim, BLOCK_D=block_d, BLOCK_P=block_p, HAS_CAP=logit_cap > 0,
        HAS_IDS=ids is not None,
    )  # fmt: skip
    return tally
