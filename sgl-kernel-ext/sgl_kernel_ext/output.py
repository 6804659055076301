"""The result type shared by the Triton kernels and the torch reference."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class DecodeImportanceOutput(NamedTuple):
    """One decode step of attention with per-page importance.

    Attributes:
        output: ``[bs, q_heads, Dv]`` attention output.
        lse: ``[bs, q_heads]`` float32, natural-log softmax denominator
            ``log(sum_j exp(s_j) + exp(sink_h))``; 0 for a request with no valid token.
        importance: ``[bs, max_pages]`` float32 page mass averaged over all query
            heads, or None when importance was switched off. Page ``j`` is the request's
            tokens ``[j * page_size, (j + 1) * page_size)``. Without sinks a request's
            row sums to 1; with sinks it sums to ``1 - mean_h(sink probability)``,
            because sinks count toward the denominator. Entries past the request's
            page count, and rows of empty requests, are 0.
        importance_per_kv_head: ``[bs, max_pages, kv_heads]`` float32 page mass
            averaged over the query heads of each KV group, or None when not asked for.
    """

    output: torch.Tensor
    lse: torch.Tensor
    importance: Optional[torch.Tensor]
    importance_per_kv_head: Optional[torch.Tensor]
