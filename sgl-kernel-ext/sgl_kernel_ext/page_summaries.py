"""Per-page key min/max summaries, kept up to date by a decode step's KV write, in one launch.

A hot-set decode step refreshes, in every layer, the summary (elementwise min and max of
the keys) of the page each request's new token went to. In torch that is a handful of
scatter-reduces (about a dozen launches a layer); on a GPU an eager step pays for each
launch in host time. :func:`summarise_decode_keys` does it in one Triton launch,
reading the new keys straight from the layer's key pool:

- one program per (token, KV head): page ``slot // page_size``; a token at its page's
  first slot starts the page's summary afresh (min = max = its key), any other token
  merges into it;
- **decode only**: the tokens' pages must be distinct (a decode step writes one token per
  request, each into its own last page), since programs do not synchronise. A prefill
  writes many tokens per page: use the torch path there.

Knows nothing of SGLang.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the CPU path runs without Triton
    HAS_TRITON = False


def summarise_decode_keys(
    key_buffer: torch.Tensor, slots: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, page_size: int
) -> None:
    """Merge the keys at ``slots`` into their pages' summaries, in place (one launch).

    Args:
        key_buffer: the layer's key pool ``[num_slots, kv_heads, D]`` (the keys just written;
            any dtype, converted to the summaries').
        slots: ``[n]`` token slots, each in a different page.
        key_min, key_max: ``[num_pages, kv_heads, D]`` summaries (contiguous), updated in place.
        page_size: tokens per page.
    """
    n = slots.numel()
    if n == 0:
        return
    _, kv_heads, dim = key_min.shape
    if key_buffer.shape[1:] != (kv_heads, dim) or key_max.shape != key_min.shape:
        raise ValueError(f"shapes disagree: keys {tuple(key_buffer.shape)}, summaries {tuple(key_min.shape)}")
    if not (key_min.is_contiguous() and key_max.is_contiguous()) or key_buffer.stride(2) != 1:
        raise ValueError("key_min and key_max must be contiguous, and each key row too")
    _summarise_decode_keys_kernel[(n, kv_heads)](
        key_buffer,
        slots,
        key_min,
        key_max,
        key_buffer.stride(0),
        key_buffer.stride(1),
        page_size,
        kv_heads * dim,
        dim,
        BLOCK_D=triton.next_power_of_2(dim),
    )


if HAS_TRITON:

    @triton.jit
    def _summarise_decode_keys_kernel(
        keys,
        slots,
        key_min,
        key_max,
        key_stride_slot,
        key_stride_head,
        page_size,
        page_stride,
        dim,
        BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slots + token).to(tl.int64)
        page = slot // page_size
        first = (slot % page_size) == 0
        d = tl.arange(0, BLOCK_D)
        inside = d < dim
        key = tl.load(keys + slot * key_stride_slot + head * key_stride_head + d, mask=inside)
        key = key.to(key_min.dtype.element_ty)
        at = page * page_stride + head * dim + d
        old_min = tl.load(key_min + at, mask=inside)
        old_max = tl.load(key_max + at, mask=inside)
        tl.store(key_min + at, tl.where(first, key, tl.minimum(old_min, key)), mask=inside)
        tl.store(key_max + at, tl.where(first, key, tl.maximum(old_max, key)), mask=inside)
