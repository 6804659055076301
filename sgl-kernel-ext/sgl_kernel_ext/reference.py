"""Torch reference of decode attention with page importance.

The tests compare the Triton kernels against it in float64; the server's torch
backend uses it as its CPU path (float32). Vectorised per request: one batched
softmax over the request's tokens, one loop over requests.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .output import DecodeImportanceOutput


def decode_importance_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    page_size: int,
    max_pages: Optional[int] = None,
    sm_scale: Optional[float] = None,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    mask_page0: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> DecodeImportanceOutput:
    """Attention output, natural-log lse and page importance, computed directly.

    Same contract as the Triton kernels (see ``DecodeImportanceOutput``): page ``j``
    of a request is its tokens ``[j * page_size, (j + 1) * page_size)``; masses are
    normalised by the full denominator, sink included; empty requests (and requests
    whose every slot is on page 0 when ``mask_page0``) give zero output, zero lse and
    zero importance.

    Args:
        q: ``[bs, q_heads, D]``; k_buffer ``[slots, kv_heads, D]``; v_buffer
            ``[slots, kv_heads, Dv]``; kv_indptr ``[bs + 1]``; kv_indices slots.
        max_pages: importance columns; defaults to the longest request's page count.
        compute_dtype: arithmetic dtype (float64 for tests, float32 for serving).

    Returns:
        DecodeImportanceOutput with ``output`` in ``compute_dtype``, both importance
        tensors filled (float32).
    """
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    v_head_dim = v_buffer.shape[2]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    bounds = kv_indptr[: bs + 1].tolist()
    lengths = [bounds[i + 1] - bounds[i] for i in range(bs)]
    if max_pages is None:
        max_pages = max([-(-n // page_size) for n in lengths] + [1])

    dev = q.device
    output = torch.zeros(bs, num_q_heads, v_head_dim, dtype=compute_dtype, device=dev)
    lse = torch.zeros(bs, num_q_heads, dtype=compute_dtype, device=dev)
    per_kv = torch.zeros(bs, max_pages, num_kv_heads, dtype=compute_dtype, device=dev)
    sink_logit = None
    if sinks is not None:
        sink_logit = sinks.to(compute_dtype).view(num_kv_heads, group, 1)

    for b in range(bs):
        n = lengths[b]
        if n == 0:
            continue
        slots = kv_indices[bounds[b] : bounds[b + 1]].long()
        valid = slots >= page_size if mask_page0 else torch.ones_like(slots, dtype=torch.bool)
        if not bool(valid.any()):
            continue
        k = k_buffer[slots].to(compute_dtype)  # [n, kv, D]
        v = v_buffer[slots].to(compute_dtype)  # [n, kv, Dv]
        qb = q[b].to(compute_dtype).view(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,nkd->kgn", qb, k) * sm_scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        scores = scores.masked_fill(~valid, float("-inf"))

        peak = scores.amax(dim=-1, keepdim=True)
        if sink_logit is not None:
            peak = torch.maximum(peak, sink_logit)
        weights = torch.exp(scores - peak)
        denom = weights.sum(dim=-1, keepdim=True)
        if sink_logit is not None:
            denom = denom + torch.exp(sink_logit - peak)
        probs = weights / denom  # [kv, g, n]

        output[b] = torch.einsum("kgn,nkd->kgd", probs, v).reshape(num_q_heads, v_head_dim)
        lse[b] = (peak + torch.log(denom)).reshape(num_q_heads)

        num_pages = -(-n // page_size)
        padded = torch.nn.functional.pad(probs, (0, num_pages * page_size - n))
        page_mass = padded.view(num_kv_heads, group, num_pages, page_size).sum(-1).mean(1)
        kept = min(num_pages, max_pages)
        per_kv[b, :kept] = page_mass[:, :kept].transpose(0, 1)

    importance = per_kv.mean(dim=-1)
    return DecodeImportanceOutput(
        output=output,
        lse=lse.float(),
        importance=importance.float(),
        importance_per_kv_head=per_kv.float(),
    )
