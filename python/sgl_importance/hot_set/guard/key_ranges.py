"""Key ranges: an upper bound of a page's logits without reading its keys, by range id.

Per full page of a tracked request, layer and KV head the hot set keeps the elementwise
minimum and maximum of the page's keys (Quest, Tang et al. 2024). For a query ``q`` and
any key ``k`` of the page, ``q . k = sum_d q_d k_d <= sum_d max(q_d min_d, q_d max_d)``,
so two vectors per page bound every logit of the page; reading them costs ``2 / page_size``
of reading the page's keys. The bound ranks unread pages for promotion with the guard off
(and drives the ``quest`` baseline); the guard's 4-bit key codes are quantised against the
same range (``key_codes.py``).

A range row is a token slot of a page borrowed from the KV pool (``rows.py``): the min in
the slot's K, the max in its V, in the pool's own dtype, so a borrowed page holds the
ranges of ``page_size`` pages (1/16 of the KV at page 16) and a range id is that slot. A
page's range is written once, at the end of the step that filled it (a full page never
changes again), from the device pool while the page is still there (``coding.py``). Row 0
(SGLang's padding slot) is never handed out: a padding id reads as an empty range (+inf /
-inf), which bounds nothing.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sgl_importance.hot_set.pages.rows import LocalPages, PageSource, RowStore


def range_bytes_per_page(head_dim: int, element_size: int) -> int:
    """Device bytes of one page's range per layer and KV head (keys of ``element_size``
    bytes): its min and max vectors, a token slot's K and V."""
    return 2 * head_dim * element_size


class KeyRanges:
    """Per-channel key min/max of full pages, by range id, for every layer.

    Standalone (this constructor: offline benchmarks, tests) it keeps private tables for
    ``capacity_pages`` ranges; in the server it is made over the KV pool (``over_pool``),
    its rows in borrowed pages.

    Args:
        num_layers, num_kv_heads, head_dim: the KV pool's key shape.
        capacity_pages: ranges it holds at most (id 0 is padding, not counted).
        dtype: the key dtype (ranges are stored in it).
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
        page_size: int = 16,
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim) < 1 or capacity_pages < 0:
            raise ValueError("KeyRanges dimensions must be >= 1 and its capacity >= 0")
        pages = -(-capacity_pages // page_size) + 1  # page 0 is padding
        shape = (pages * page_size, num_kv_heads, head_dim)
        low = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        high = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._init(low, high, page_size, LocalPages(1, pages - 1), max_rows=capacity_pages)

    @classmethod
    def over_pool(
        cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int, source: PageSource
    ) -> "KeyRanges":
        """Ranges in the KV pool's own pages: row ``s`` is token slot ``s``, its min in
        ``k_buffers[layer][s]`` and its max in ``v_buffers[layer][s]``; pages from ``source``."""
        ranges = cls.__new__(cls)
        ranges._init(list(k_buffers), list(v_buffers), page_size, source, max_rows=None)
        return ranges

    def _init(self, low: list, high: list, page_size: int, source: PageSource, max_rows: Optional[int]) -> None:
        if low[0].shape != high[0].shape:
            raise ValueError(f"key ranges need K and V slots of one shape, not {low[0].shape} / {high[0].shape}")
        self.key_min, self.key_max = low, high  # per layer: [slots, Hkv, D]
        self.num_layers = len(low)
        self.num_kv_heads, self.head_dim = low[0].shape[1:]
        self.device, self.page_size = low[0].device, page_size
        self.rows = RowStore(lambda p: list(range(p * page_size, (p + 1) * page_size)), source, max_rows)

    @property
    def capacity(self) -> Optional[int]:
        """Ranges it may hold at most (None: what the KV pool can lend)."""
        return self.rows.max_rows

    @property
    def pages_in_use(self) -> int:
        return self.rows.rows_in_use

    @property
    def refused(self) -> int:
        return self.rows.refused

    @property
    def row_bytes(self) -> int:
        """Device bytes of one range, all layers and KV heads."""
        return 2 * self.num_layers * self.key_min[0][0].numel() * self.key_min[0].element_size()

    def alloc(self, num_pages: int) -> Optional[torch.Tensor]:
        """``num_pages`` ids, or None (nothing taken) when no row can be had."""
        return self.rows.alloc(num_pages)

    def free(self, ids: torch.Tensor) -> None:
        self.rows.free(ids)

    def write(
        self, layer: int, ids: torch.Tensor, low: torch.Tensor, high: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's ranges ``[n, kv_heads, D]`` of pages ``ids``; returns them as stored
        (in the table's dtype), which is what the key codes must be written against."""
        table = self.key_min[layer]
        lo, hi = low.to(table.dtype), high.to(table.dtype)
        if ids.numel():
            ids = ids.to(self.device)
            table.index_copy_(0, ids, lo.to(self.device))
            self.key_max[layer].index_copy_(0, ids, hi.to(self.device))
        return lo, hi

    def gather(self, layers: torch.Tensor | int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges of ``ids`` in ``layers``: ``[*ids.shape, Hkv, D]`` for one layer,
        ``[l, *ids.shape, Hkv, D]`` for a tensor of layers (copies); id 0 reads as empty."""
        if not isinstance(layers, int):
            parts = [self.gather(int(layer), ids) for layer in layers.tolist()]
            return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        flat = ids.reshape(-1)
        if flat.device != self.device:  # ids planned on the host; a move is a copy (and reads as a sync)
            flat = flat.to(self.device)
        kmin = self.key_min[layers].index_select(0, flat)
        kmax = self.key_max[layers].index_select(0, flat)
        pad = (flat == 0)[:, None, None]
        kmin = kmin.masked_fill(pad, float("inf"))
        kmax = kmax.masked_fill(pad, float("-inf"))
        return kmin.view(*ids.shape, *kmin.shape[1:]), kmax.view(*ids.shape, *kmax.shape[1:])


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
