"""A linear layer at a decode step's few rows on the CPU, one C call (``csrc/linear.c``).

At 1-16 rows a step's matmuls stream each weight once and compute little; torch's float32
matmul (MKL's sgemm) blocks and packs for large matrices and, measured on a 2-core AMD
EPYC, ran these shapes 1.2-2.9x slower than a kernel that keeps a few rows of x against a
few rows of the weight in registers (``benchmark/kernel/bench_linear.py``). Past
``ROWS_MAX`` rows (a prefill) torch's GEMM is the better one and is kept. A row's result
does not depend on the rows beside it (fixed sums, explicit FMA). Knows nothing of SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch

from .native import library

_F32 = torch.float32
# Rows up to which the C kernel beats torch's GEMM (bench_linear.py; re-measure per machine).
ROWS_MAX = 16


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """``x @ weight.T (+ bias)`` for ``x`` ``[rows, in]`` and ``weight`` ``[out, in]``, as
    ``torch.nn.functional.linear`` computes it (float32 sums in another order).

    Args:
        out: ``[rows, out]`` float32 with a contiguous last dimension, written in place;
            a fresh tensor when None.

    Returns:
        The output, or None where the C kernel does not apply (not float32 CPU rows with a
        contiguous last dimension, a non-contiguous weight, more than ``ROWS_MAX`` rows, no
        C library): nothing written, the caller keeps torch.
    """
    if x.dtype is not _F32 or x.dim() != 2 or x.device.type != "cpu" or x.shape[0] > ROWS_MAX:
        return None
    if weight.dtype is not _F32 or weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != x.shape[1]:
        return None
    rows, n = x.shape[0], weight.shape[0]
    if x.stride(1) != 1 or (rows > 1 and x.stride(0) < x.shape[1]) or weight.device.type != "cpu":
        return None  # rows that overlap (an expanded view) are left to torch
    if bias is not None and (bias.dtype is not _F32 or bias.shape != (n,) or not bias.is_contiguous()):
        return None
    if out is None:
        out = torch.empty((rows, n), dtype=_F32)
    elif out.dtype is not _F32 or out.shape != (rows, n) or out.stride(1) != 1 or out.device.type != "cpu":
        return None
    elif rows > 1 and out.stride(0) < n:
        return None
    lib = library()
    if lib is None:
        return None
    x_stride, out_stride = (x.stride(0), out.stride(0)) if rows > 1 else (x.shape[1], n)
    rc = lib.sgl_linear_f32(
        x.data_ptr(), x_stride, rows, weight.data_ptr(), x.shape[1], n, None if bias is None else bias.data_ptr(),
        out.data_ptr(), out_stride, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"sgl_linear_f32: bad shape (code {rc})")
    return out
