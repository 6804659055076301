"""A decoder layer's small ops on the CPU, one C call each (``csrc/layer_ops.c``).

At a decode step's few rows a torch RMSNorm (6 ops), rotary embedding (~20 ops) or KV
write (two indexed copies behind a pool's checks) costs its dispatches, not its
arithmetic; these do the same work in one call. CPU tensors only (float32 for the norm
and the rotary): each function returns None (or False) where it does not apply (no C
library, another dtype or device, a layout it does not read), and the caller keeps its
torch path. Knows nothing of SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch

from .native import library

_F32 = torch.float32


def _done(rc: int, name: str, outside: str) -> bool:
    """A kernel's return code: 0 is True; -2 (an index outside its table, nothing written)
    raises IndexError with ``outside``, anything else ValueError."""
    if rc == -2:
        raise IndexError(outside)
    if rc != 0:
        raise ValueError(f"{name}: bad shape (code {rc})")
    return True


def _rows(t: torch.Tensor) -> bool:
    # Row-major float32 on the CPU with a contiguous last dimension.
    return t.dtype is _F32 and t.dim() == 2 and t.stride(1) == 1 and t.device.type == "cpu"


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """RMSNorm of ``x`` ``[rows, hidden]`` scaled by ``weight``; with ``residual``, of
    ``x + residual``, in place as SGLang's fused add-norm kernels do: ``residual``
    becomes the sum and ``x`` its norm (no allocation on a decode step's path).

    Returns:
        ``(out, residual)``: without a residual a fresh output and None, with one ``(x,
        residual)`` written in place; None where the C kernel does not apply (nothing written).
    """
    lib = library()
    if lib is None or not _rows(x) or weight.dtype is not _F32 or not weight.is_contiguous():
        return None
    rows, hidden = x.shape
    if weight.shape != (hidden,) or (residual is not None and (not _rows(residual) or residual.shape != x.shape)):
        return None
    if residual is None:
        out = torch.empty((rows, hidden), dtype=_F32)
        out_p, res_p, res_stride, out_stride = out.data_ptr(), None, 0, hidden
    else:
        out, res_p, res_stride = x, residual.data_ptr(), residual.stride(0)
        out_p, out_stride = x.data_ptr(), x.stride(0)
    rc = lib.sgl_rms_norm_f32(
        x.data_ptr(), res_p, weight.data_ptr(), out_p, res_p, rows, hidden, x.stride(0), res_stride, out_stride,
        res_stride, float(eps),
    )  # fmt: skip
    _done(rc, "sgl_rms_norm_f32", "")
    return out, residual


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    neox: bool,
) -> bool:
    """Rotary position embedding of ``q`` ``[tokens, q_heads * head_size]`` and ``k``
    ``[tokens, k_heads * head_size]`` in place (views of a fused QKV output are fine):
    token t rotates the first ``rotary_dim`` of each head by row ``positions[t]`` of
    ``cos_sin`` ``[max_position, rotary_dim]`` (cosines, then sines).

    Returns:
        True once rotated; False where the C kernel does not apply (nothing written).

    Raises:
        IndexError: a position outside ``cos_sin``'s rows (nothing written).
    """
    lib = library()
    if lib is None or not (_rows(q) and _rows(k)) or q.shape[0] != k.shape[0] or positions.numel() != q.shape[0]:
        return False
    if q.shape[1] % head_size or k.shape[1] % head_size or rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        return False
    if cos_sin.dtype is not _F32 or cos_sin.dim() != 2 or cos_sin.shape[1] != rotary_dim or not cos_sin.is_contiguous():
        return False
    if positions.dtype is not torch.int64 or positions.is_cuda or not positions.is_contiguous():
        return False
    rc = lib.sgl_rotary_f32(
        positions.data_ptr(), q.data_ptr(), k.data_ptr(), cos_sin.data_ptr(), q.shape[0],
        q.shape[1] // head_size, k.shape[1] // head_size, head_size, rotary_dim, q.stride(0), k.stride(0),
        cos_sin.shape[0], int(neox),
    )  # fmt: skip
    return _done(rc, "sgl_rotary_f32", "rotary: a position outside the cache's rows")


def _row_major(t: torch.Tensor) -> bool:
    # [n, heads, dim] CPU rows whose heads sit side by side (any row stride).
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.device.type == "cpu"


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor) -> bool:
    """Rows ``k[i]`` and ``v[i]`` (``[n, heads, dim]``) into slot ``loc[i]`` of ``k_pool``
    and ``v_pool`` (contiguous ``[slots, heads, dim]`` of the same dtype), as
    ``pool[loc] = rows`` would.

    Returns:
        True once written; False where the C kernel does not apply (nothing written).

    Raises:
        IndexError: a slot outside the pool (nothing written).
    """
    lib = library()
    if lib is None or not (_row_major(k) and _row_major(v)) or loc.dtype is not torch.int64 or loc.dim() != 1:
        return False
    n = loc.shape[0]
    if k.shape[0] != n or v.shape[0] != n or k.shape[1:] != k_pool.shape[1:] or v.shape[1:] != v_pool.shape[1:]:
        return False
    if not (k.dtype == v.dtype == k_pool.dtype == v_pool.dtype and k_pool.is_contiguous() and v_pool.is_contiguous()):
        return False
    if not loc.is_contiguous() or loc.device.type != "cpu" or k_pool.device.type != "cpu":
        return False
    size = k.element_size()
    rc = lib.sgl_store_kv(
        k.data_ptr(), v.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), loc.data_ptr(), n,
        k.stride(1) * k.shape[1] * size, v.stride(1) * v.shape[1] * size, k.stride(0) * size, v.stride(0) * size,
        min(k_pool.shape[0], v_pool.shape[0]),
    )  # fmt: skip
    return _done(rc, "sgl_store_kv", "store_kv: a slot outside the pool's rows")
