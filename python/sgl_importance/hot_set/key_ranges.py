"""Key ranges: an upper bound of a page's logits without reading its keys, by range id.

Per full page of a tracked request, layer and KV head the pool keeps the elementwise
minimum and maximum of the page's keys (Quest, Tang et al. 2024). For a query ``q`` and
any key ``k`` of the page, ``q . k = sum_d q_d k_d <= sum_d max(q_d min_d, q_d max_d)``,
so two vectors per page bound every logit of the page; reading them costs ``2 / page_size``
of reading the page's keys. The bound ranks unread pages for promotion with the guard off
(and drives the ``quest`` baseline); the guard's 4-bit key codes are quantised against the
same range (``key_codes.py``). Ranges are stored in 16 bits (float32 keys' in bfloat16),
rounded outward (the min down, the max up), so every key stays inside its page's stored
range and every bound stays valid: half the bytes of float32 ranges, a bound a few parts
in a thousand looser.

A page's range is written once, at the end of the step that filled it (a full page never
changes again), from the device pool while the page is still there (``coding.py``): there
is no per-write upkeep and no copy per physical page. Ranges live in one fixed pool by
range id, allocated once at start-up inside SGLang's KV budget (``guard_budget.py``) and
never grown: a request that gets no ids decodes dense and keeps every page on the device
(counted). Row 0 is padding: an empty range (+inf / -inf), which bounds nothing.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch


def range_dtype(key_dtype: torch.dtype) -> torch.dtype:
    """What ranges of ``key_dtype`` keys are stored in: the key dtype, float32 as bfloat16."""
    return torch.bfloat16 if key_dtype == torch.float32 else key_dtype


def range_bytes_per_page(head_dim: int, element_size: int) -> int:
    """Device bytes of one page's range per layer and KV head (keys of ``element_size``
    bytes): its min and max vectors, in 16 bits for float32 keys."""
    return 2 * head_dim * min(element_size, 2)


def round_outward(low: torch.Tensor, high: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``low`` and ``high`` in ``dtype``, the min rounded down and the max up: whatever lay
    in ``[low, high]`` lies in the result."""
    lo, hi = low.to(dtype), high.to(dtype)
    if dtype != low.dtype:
        lo = torch.where(lo.float() > low.float(), torch.nextafter(lo, torch.full_like(lo, float("-inf"))), lo)
        hi = torch.where(hi.float() < high.float(), torch.nextafter(hi, torch.full_like(hi, float("inf"))), hi)
    return lo, hi


class KeyRanges:
    """Per-channel key min/max of full pages, by range id, for every layer.

    Args:
        num_layers, num_kv_heads, head_dim: the KV pool's key shape.
        capacity_pages: pages it holds, fixed (id 0 is padding, not counted).
        dtype: the key dtype (the ranges are stored in ``range_dtype`` of it).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        capacity_pages: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim) < 1 or capacity_pages < 0:
            raise ValueError("KeyRanges dimensions must be >= 1 and its capacity >= 0")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.device = torch.device(device)
        shape = (num_layers, capacity_pages + 1, num_kv_heads, head_dim)
        stored = range_dtype(dtype)
        self.key_min = torch.full(shape, float("inf"), dtype=stored, device=self.device)
        self.key_max = torch.full(shape, float("-inf"), dtype=stored, device=self.device)
        # Ids are planned on the host; freed ids are reused last-in first-out.
        self._free = list(range(capacity_pages, 0, -1))
        self.refused = 0  # allocations refused for want of room

    @property
    def capacity(self) -> int:
        return self.key_min.shape[1] - 1

    @property
    def pages_in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def nbytes(self) -> int:
        return 2 * self.key_min.numel() * self.key_min.element_size()

    def alloc(self, num_pages: int) -> Optional[torch.Tensor]:
        """``num_pages`` ids, or None (nothing taken) when the pool has fewer free."""
        if num_pages > len(self._free):
            self.refused += 1
            return None
        return torch.tensor([self._free.pop() for _ in range(num_pages)], dtype=torch.int64)

    def free(self, ids: torch.Tensor) -> None:
        for i in ids.tolist():
            if i > 0:
                self._free.append(int(i))

    def write(
        self, layer: int, ids: torch.Tensor, low: torch.Tensor, high: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's ranges ``[n, kv_heads, D]`` of pages ``ids``; returns them as stored
        (rounded outward), which is what the key codes must be written against."""
        lo, hi = round_outward(low, high, self.key_min.dtype)
        if ids.numel():
            ids = ids.to(self.device)
            self.key_min[layer].index_copy_(0, ids, lo.to(self.device))
            self.key_max[layer].index_copy_(0, ids, hi.to(self.device))
        return lo, hi

    def gather(self, layers: torch.Tensor | int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges of ``ids`` in ``layers``: ``[*ids.shape, Hkv, D]`` for one layer,
        ``[l, *ids.shape, Hkv, D]`` for a tensor of layers (copies)."""
        flat = ids.reshape(-1)
        if flat.device != self.device:  # ids planned on the host; a move is a copy (and reads as a sync)
            flat = flat.to(self.device)
        if isinstance(layers, int):
            kmin, kmax = self.key_min[layers].index_select(0, flat), self.key_max[layers].index_select(0, flat)
            return kmin.view(*ids.shape, *kmin.shape[1:]), kmax.view(*ids.shape, *kmax.shape[1:])
        # One gather of the (layer, id) pairs: never a whole layer of the pool.
        at = (layers.to(self.device)[:, None], flat[None, :])
        kmin, kmax = self.key_min[at], self.key_max[at]
        return kmin.view(kmin.shape[0], *ids.shape, *kmin.shape[2:]), kmax.view(
            kmax.shape[0], *ids.shape, *kmax.shape[2:]
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
            leading dimensions: one request, or a batch of requests). Query head ``h``
            reads KV head ``h // (q_heads // kv_heads)`` (SGLang's GQA layout).

    Returns:
        ``[..., P, q_heads]`` in float32 (or ``compute_dtype``), ``>= sm_scale * q_h . k``
        (capped like the logits) for every key ``k`` within the range.
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
