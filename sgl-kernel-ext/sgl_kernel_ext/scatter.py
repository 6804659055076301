"""Scatter per-request page importance into a per-physical-page table.

The decode kernels index importance by a page's position inside its request; the
cache wants it by physical page (``slot // page_size``), the unit the allocator
frees and HiCache moves. A request's page ``j`` starts at token ``j * page_size``,
and SGLang's paged allocator keeps those ``page_size`` tokens on one physical page,
so the page's first slot names it.

Two implementations of one contract: a Triton kernel (fixed grid, no host sync,
safe inside a CUDA graph) and a torch version for the CPU backend.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the torch backend runs without Triton
    HAS_TRITON = False

REDUCE_MODES = ("set", "add", "max")


def _check(importance, kv_indptr, table, page_size, reduce):
    if reduce not in REDUCE_MODES:
        raise ValueError(f"reduce={reduce!r}; allowed: {REDUCE_MODES}")
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    if importance.dim() != 2 or table.dim() != 1:
        raise ValueError("importance must be [bs, max_pages] and table 1-D [num_physical_pages]")
    if importance.shape[1] > 1 and importance.stride(1) != 1:
        raise ValueError("importance rows must be contiguous")
    if kv_indptr.numel() < importance.shape[0] + 1:
        raise ValueError(f"kv_indptr has {kv_indptr.numel()} entries for bs={importance.shape[0]}")


if HAS_TRITON:

    @triton.jit
    def _scatter_page_importance_kernel(
        Importance,
        KvIndptr,
        KvIndices,
        Table,
        max_pages,
        table_size,
        stride_ib,
        PAGE_SIZE: tl.constexpr,
        BLOCK_P: tl.constexpr,
        REDUCE: tl.constexpr,  # 0 set, 1 add, 2 max
        SKIP_PAGE0: tl.constexpr,
    ):
        req = tl.program_id(0).to(tl.int64)
        pages = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        kv_start = tl.load(KvIndptr + req).to(tl.int64)
        seq_len = tl.load(KvIndptr + req + 1) - tl.load(KvIndptr + req)
        live = (pages < tl.cdiv(seq_len, PAGE_SIZE)) & (pages < max_pages)
        slot = tl.load(KvIndices + kv_start + pages.to(tl.int64) * PAGE_SIZE, mask=live, other=0)
        phys = slot // PAGE_SIZE
        live = live & (phys < table_size)
        if SKIP_PAGE0:
            live = live & (phys > 0)
        value = tl.load(Importance + req * stride_ib + pages, mask=live, other=0.0)
        if REDUCE == 0:
            tl.store(Table + phys, value, mask=live)
        elif REDUCE == 1:
            tl.atomic_add(Table + phys, value, mask=live)
        else:
            tl.atomic_max(Table + phys, value, mask=live)


def _scatter_torch(importance, kv_indptr, kv_indices, table, page_size, reduce, skip_page0):
    bs, max_pages = importance.shape
    if kv_indices.numel() == 0 or bs == 0:
        return table
    dev = importance.device
    starts = kv_indptr[:bs].long()
    lengths = kv_indptr[1 : bs + 1].long() - starts
    pages = torch.arange(max_pages, device=dev)
    live = pages[None, :] < ((lengths + page_size - 1) // page_size)[:, None]
    first_token = (starts[:, None] + pages[None, :] * page_size).clamp(max=kv_indices.numel() - 1)
    phys = kv_indices[first_token].long() // page_size
    live &= phys < table.numel()
    if skip_page0:
        live &= phys > 0
    if reduce == "set":
        table[phys[live]] = importance[live].to(table.dtype)
        return table
    # Fixed shapes (no mask picks the entries, so nothing waits on the device): entries
    # not listed add 0 / take the max with -inf at page 0, which changes nothing.
    phys = torch.where(live, phys, 0).flatten()
    neutral = 0.0 if reduce == "add" else float("-inf")
    values = torch.where(live, importance.to(table.dtype), neutral).flatten()
    if reduce == "add":
        table.index_put_((phys,), values, accumulate=True)
    else:
        table.scatter_reduce_(0, phys, values, reduce="amax", include_self=True)
    return table


def scatter_page_importance(
    importance: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    table: torch.Tensor,
    *,
    page_size: int,
    reduce: str = "set",
    skip_page0: bool = True,
    use_triton: Optional[bool] = None,
) -> torch.Tensor:
    """Write ``table[kv_indices[start_b + j * page_size] // page_size] (op)= importance[b, j]``.

    Args:
        importance: ``[bs, max_pages]`` per-request page importance (the kernel's output).
        kv_indptr: int32 ``[>= bs + 1]``; kv_indices: the same slots the kernel read.
        table: float32 ``[num_physical_pages]``, updated in place. Entries of pages no
            request touches are left alone; so are pages past ``max_pages`` and, with
            ``skip_page0``, SGLang's padding page 0.
        page_size: SGLang page size.
        reduce: ``"set"`` (a page shared by several requests keeps one of their values,
            which one is unspecified), ``"add"`` or ``"max"`` (atomic, order-free).
        use_triton: default: Triton for CUDA tensors, torch otherwise. The Triton path
            never syncs with the host.

    Returns:
        ``table``.
    """
    _check(importance, kv_indptr, table, page_size, reduce)
    if use_triton is None:
        use_triton = HAS_TRITON and importance.is_cuda
    if not use_triton:
        return _scatter_torch(importance, kv_indptr, kv_indices, table, page_size, reduce, skip_page0)
    if not HAS_TRITON:
        raise RuntimeError("use_triton=True but triton is not installed")
    bs, max_pages = importance.shape
    if bs == 0 or max_pages == 0:
        return table
    block_p = 64
    _scatter_page_importance_kernel[(bs, triton.cdiv(max_pages, block_p))](
        importance,
        kv_indptr,
        kv_indices,
        table,
        max_pages,
        table.numel(),
        importance.stride(0),
        PAGE_SIZE=page_size,
        BLOCK_P=block_p,
        REDUCE=REDUCE_MODES.index(reduce),
        SKIP_PAGE0=skip_page0,
    )
    return table
