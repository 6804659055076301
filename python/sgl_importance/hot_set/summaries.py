"""Page summaries: an upper bound of each KV page's logits without reading its keys.

Per physical page, layer and KV head the summary keeps the elementwise minimum and
maximum of the page's keys (Quest, Tang et al. 2024). For a query ``q`` and any key
``k`` of the page, ``q . k = sum_d q_d k_d <= sum_d max(q_d min_d, q_d max_d)``, so
two vectors per page bound every logit of the page; reading them costs
``2 / page_size`` of reading the page's keys. The bound drives promotion of pages
outside the hot set and the guard (``guard.py``).

Summaries are filed by physical page (``slot // page_size``), like the page importance table,
and updated as keys are written (prefill, extend and decode). A write at a page's
first slot starts the page afresh: the allocator hands out whole pages, so that
write is the first of the page's current owner. Everything else merges (min/max),
which keeps the bound valid even for a page whose first write was missed (stale
keys only loosen it).

Torch, and one ``sgl_kernel_ext`` Triton kernel for decode writes; nothing here imports SGLang.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from sgl_kernel_ext.page_summaries import HAS_TRITON, summarise_decode_keys

# update() merges keys with index_reduce_ (fixed-shape, capture-safe, one pass on a CPU);
# torch warns once per process that its API is in beta, which a server log need not show.
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta", category=UserWarning)


class PageSummaries:
    """Elementwise key min/max per (layer, physical page, KV head).

    Args:
        num_layers: attention layers (indexed by SGLang's ``layer_id``).
        num_pages: physical pages, SGLang's padding page 0 included.
        num_kv_heads, head_dim: the KV pool's key shape.
        page_size: tokens per page.
        dtype: the key dtype; min and max of stored keys are stored keys, so keeping
            them in the key dtype loses nothing.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_pages, num_kv_heads, head_dim, page_size) < 1:
            raise ValueError("PageSummaries dimensions must all be >= 1")
        self.page_size = page_size
        # Decode writes go through sgl_kernel_ext's one-launch kernel where it can run:
        # None decides by device (CUDA); the test worlds of the Triton backend say True.
        self.decode_kernel: Optional[bool] = None
        shape = (num_layers, num_pages, num_kv_heads, head_dim)
        # Empty pages hold (+inf, -inf): the identity of min/max merging.
        self.key_min = torch.full(shape, float("inf"), dtype=dtype, device=device)
        self.key_max = torch.full(shape, float("-inf"), dtype=dtype, device=device)

    @property
    def num_pages(self) -> int:
        return self.key_min.shape[1]

    def update_decode(self, layer_id: int, slots: torch.Tensor, key_buffer: torch.Tensor) -> None:
        """``update`` for a decode step's write (each slot in a different page), reading the
        keys from the layer's pool ``key_buffer``: one Triton launch where it runs (a dozen
        torch ops otherwise)."""
        use_kernel = self.decode_kernel if self.decode_kernel is not None else key_buffer.is_cuda
        if use_kernel and HAS_TRITON and key_buffer.dim() == 3:
            summarise_decode_keys(key_buffer, slots, self.key_min[layer_id], self.key_max[layer_id], self.page_size)
        else:
            self.update(layer_id, slots, key_buffer[slots.to(torch.int64)])

    def update(self, layer_id: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Merge keys just written at ``slots`` into their pages' summaries.

        Args:
            layer_id: the layer the keys belong to.
            slots: token slots ``[n]`` (SGLang's ``out_cache_loc``).
            keys: ``[n, kv_heads, head_dim]`` (or ``[n, kv_heads * head_dim]``).
        """
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64)
        kmin, kmax = self.key_min[layer_id], self.key_max[layer_id]
        keys = keys.reshape(slots.numel(), kmin.shape[1], kmin.shape[2]).to(kmin.dtype)
        pages = torch.div(slots, self.page_size, rounding_mode="floor")
        # Every op has the shape of the write and reads nothing back (no mask indexing,
        # unique or nonzero): a CUDA graph captures it as it is and the host never waits.
        # index_reduce_ merges each key into its page (atomics on a GPU, one pass on a
        # CPU; scatter_reduce_ over an expanded index sorts, 40 % of a CPU decode step).
        # A key at a page's first slot first resets its page: +inf into the min (-inf
        # into the max) by a max (min); the other keys bring the identity, -inf (+inf).
        reset = keys.new_full((slots.numel(), 1, 1), float("inf"))
        reset.masked_fill_((slots % self.page_size != 0)[:, None, None], float("-inf"))
        reset = reset.expand_as(keys)
        kmin.index_reduce_(0, pages, reset, "amax")
        kmax.index_reduce_(0, pages, -reset, "amin")
        kmin.index_reduce_(0, pages, keys, "amin")
        kmax.index_reduce_(0, pages, keys, "amax")

    def bound(
        self,
        layer_id: int,
        q: torch.Tensor,
        pages: torch.Tensor,
        *,
        sm_scale: float,
        logit_cap: float = 0.0,
    ) -> torch.Tensor:
        """An upper bound of each page's largest logit, per query head.

        Args:
            q: one request's query ``[q_heads, head_dim]``; query head ``h`` reads KV
                head ``h // (q_heads // kv_heads)`` (SGLang's GQA layout).
            pages: physical page ids ``[P]``.
            sm_scale: the layer's softmax scale; logit_cap: its soft cap (0 = none).

        Returns:
            float32 ``[P, q_heads]``, ``>= sm_scale * q_h . k`` (capped like the
            logits) for every key ``k`` the page holds.
        """
        return key_bound(
            q,
            self.key_min[layer_id].index_select(0, pages),
            self.key_max[layer_id].index_select(0, pages),
            sm_scale=sm_scale,
            logit_cap=logit_cap,
        )


def key_bound(
    q: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``sm_scale * sum_d max(q_d min_d, q_d max_d)`` per page and query head.

    Args:
        q: ``[..., q_heads, D]``; key_min, key_max: ``[..., P, kv_heads, D]`` (the same
            leading dimensions: one request, or a batch of requests).

    Returns:
        ``[..., P, q_heads]`` in float32 (or ``compute_dtype``).
    """
    dtype = compute_dtype or torch.float32
    num_q_heads, head_dim = q.shape[-2:]
    num_pages, num_kv_heads = key_min.shape[-3:-1]
    lead = q.shape[:-2]
    qg = q.to(dtype).reshape(*lead, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    # The positive part of q meets the largest key value, the negative part the
    # smallest: the maximum of the bilinear form over the box [min, max].
    upper = torch.einsum("...hgd,...phd->...phg", qg.clamp(min=0), key_max.to(dtype))
    upper += torch.einsum("...hgd,...phd->...phg", qg.clamp(max=0), key_min.to(dtype))
    upper = upper.reshape(*lead, num_pages, num_q_heads) * sm_scale
    if logit_cap > 0:
        # tanh is increasing, so capping the bound bounds the capped logits.
        upper = logit_cap * torch.tanh(upper / logit_cap)
    return upper
