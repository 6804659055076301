"""The guard's device state: 4-bit codes of the keys of every full page, nothing of the values.

The guard (``estimate.py``) needs, for each page a step does not read, an interval
for every token's logit: it decides which unread pages could carry enough mass to
matter (read exactly) and ranks them for promotion. A key is stored as one 4-bit
code per channel against the page's own per-channel range, the key min/max the hot
set already keeps per page (``key_ranges.KeyRanges``, by the page's range id), so the
codes add nothing per page but themselves:

    k_d = min_d + code_d * step_d,   step_d = (max_d - min_d) / 15,

within ``step_d / 2`` of the stored key, so ``|q . k - q . k_hat| <= sum_d |q_d| step_d / 2``
for every token of the page. Values are not kept: the unread pages' values are
estimated from a uniform sample of pages read exactly (``sample.py``).

Two channels share a byte: channel ``d`` in the low nibble, ``d + D/2`` in the high
one, so unpacking needs no interleave. Besides the codes, each page keeps its
largest value norm per KV head (one float), which ranks what the guard reads.

Per token, layer and KV head that is ``D / 2 + 4 / page_size`` bytes: 64.25 for a
Llama-3.1-8B shape (D 128, page 16) against 512 for its bf16 K and V (12.5 %). The codes
live in pages borrowed from the KV pool as the request's pages fill (``rows.py``): one
page's K and V bytes of a layer hold the codes of several pages (``RowLayout``: 7 at 16
bits, one row of the page keeping their value norms), so nothing is set aside at start-up;
a request that cannot get rows decodes without a guard, counted (``alloc`` returns None).

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from sgl_importance.hot_set.guard.key_ranges import KeyRanges
from sgl_importance.hot_set.pages.rows import LocalPages, PageSource, RowStore

LEVELS = 15  # 4-bit codes
# Float32 recomputes min + code * step with a few units of rounding; the logit error
# adds this much of the page's largest |key| so it holds for the float32 numbers too.
ROUNDING_MARGIN = 2.0**-18


def bytes_per_page(head_dim: int, page_size: int) -> int:
    """Device bytes of guard state per page, layer and KV head: the packed codes and
    one float32 value norm."""
    return page_size * head_dim // 2 + 4


def bytes_per_token(head_dim: int, page_size: int) -> float:
    """Device bytes of guard state per token, layer and KV head."""
    return bytes_per_page(head_dim, page_size) / page_size


def kv_bytes_per_token(head_dim: int, element_size: int) -> int:
    """Device bytes of K and V per token, layer and KV head."""
    return 2 * head_dim * element_size


def code_rows_per_page(element_size: int, fused: bool = True) -> int:
    """Code rows one borrowed KV page holds: its K and V bytes (K alone where the pool
    keeps them apart) in rows of ``page_size * D / 2`` bytes a KV head, one of them the
    page's block of value norms (7 at 16 bits)."""
    return (2 if fused else 1) * 2 * element_size - 1


def quantise(keys: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit codes of pages ``keys`` against their per-channel range.

    Args:
        keys: ``[n, page_size, kv_heads, D]``.
        low, high: ``[n, kv_heads, D]``: each page's per-channel key min and max (every
            key of the page within them).

    Returns:
        uint8 ``[kv_heads, n, page_size, D / 2]``.
    """
    step = steps(low, high)[:, None]  # [n, 1, H, D]
    scaled = (keys.float() - low.float()[:, None]) / torch.where(step > 0, step, 1.0)
    codes = scaled.round_().clamp_(0, LEVELS).to(torch.uint8)
    half = codes.shape[-1] // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)
    return packed.permute(2, 0, 1, 3).contiguous()


def steps(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """float32 code steps of per-channel ranges (the same on write and on read)."""
    return (high.float() - low.float()).clamp_min(0.0) / LEVELS


class RowLayout(NamedTuple):
    """Where a code row lives in one layer's KV bytes, and its value norms (kernels read it).

    Rows are ``row_bytes`` (``Hkv * page_size * D / 2``) apart over the layer's bytes, K then V
    (one allocation in SGLang's pool); a page holds ``per_page`` rows in each half. The last
    ``norm_rows`` rows of a page in its last half are the page's norm block (one at any real
    shape): the value norms (float32, per KV head) of its other rows, K rows first.
    """

    halves: int  # 2: K and V; 1: K alone
    rows_per_half: int  # rows of the whole pool in one half
    per_page: int  # rows of one page in one half
    row_floats: int  # row_bytes / 4
    kv_heads: int
    norm_rows: int = 1

    @classmethod
    def of(cls, halves: int, rows_per_half: int, per_page: int, row_bytes: int, kv_heads: int) -> "RowLayout":
        """The layout with the fewest norm rows that hold the norms of a page's other rows."""
        total = halves * per_page
        for norm_rows in range(1, per_page):
            if (total - norm_rows) * kv_heads * 4 <= norm_rows * row_bytes:
                return cls(halves, rows_per_half, per_page, row_bytes // 4, kv_heads, norm_rows)
        raise ValueError(f"a KV page of {per_page} code rows a half has no room for their value norms")

    def norm_index(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 float32 offsets of the norms of code ``rows`` (KV head 0; head h is + h)."""
        half = rows // self.rows_per_half
        local = rows - half * self.rows_per_half
        page, j = local // self.per_page, local % self.per_page
        block = (self.halves - 1) * self.rows_per_half + page * self.per_page + self.per_page - self.norm_rows
        return block * self.row_floats + (j + half * self.per_page) * self.kv_heads

    def rows_of_page(self, page: int) -> list[int]:
        """The code rows of device ``page`` (its norm block left out)."""
        first = page * self.per_page
        rows = [half * self.rows_per_half + first + j for half in range(self.halves) for j in range(self.per_page)]
        return rows[: len(rows) - self.norm_rows]


class GuardPool:
    """4-bit key codes and value norms of full pages, by code row, for every layer.

    Standalone (this constructor: offline benchmarks, tests) it keeps private bytes for
    ``capacity_pages`` rows, laid out as over a 16-bit pool; in the server it is made over
    the KV pool (``over_pool``), its rows in borrowed pages (``rows.py``).

    Args:
        num_layers, num_kv_heads, head_dim, page_size: the KV pool's shape.
        capacity_pages: rows it holds at most (row 0 is padding, never handed out).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        page_size: int,
        capacity_pages: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if head_dim % 2:
            raise ValueError(f"the guard packs two 4-bit channels per byte; head_dim {head_dim} is odd")
        if capacity_pages < 0:
            raise ValueError(f"guard capacity {capacity_pages} pages must be >= 0")
        row_bytes = num_kv_heads * page_size * head_dim // 2
        per_pool_page = RowLayout.of(2, 0, 4, row_bytes, num_kv_heads)
        pages = -(-capacity_pages // (8 - per_pool_page.norm_rows)) + 1  # page 0 is padding
        half = pages * page_size * num_kv_heads * head_dim * 2  # bytes of a 16-bit K half
        flat = [torch.zeros(2 * half, dtype=torch.uint8, device=device) for _ in range(num_layers)]
        page_bytes = half // pages
        self._init(flat, 2, page_bytes, num_kv_heads, head_dim, page_size, LocalPages(1, pages - 1), capacity_pages)

    @classmethod
    def beside(cls, ranges: KeyRanges, page_size: int) -> "GuardPool":
        """Standalone, a code row for each of ``ranges``' rows (a decoder built without a pool: tests)."""
        return cls(
            ranges.num_layers,
            ranges.num_kv_heads,
            ranges.head_dim,
            page_size=page_size,
            capacity_pages=ranges.capacity or 0,
            device=ranges.device,
        )

    @classmethod
    def over_pool(
        cls,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        page_size: int,
        source: PageSource,
    ) -> "GuardPool":
        """Codes in the KV pool's own pages, K and V bytes of each layer as one row space
        where SGLang allocated them together (else K alone); pages from ``source``."""
        pool = cls.__new__(cls)
        k = k_buffers[0]
        kv_heads, head_dim = k.shape[1], k.shape[2]
        if head_dim % 2:
            raise ValueError(f"the guard packs two 4-bit channels per byte; head_dim {head_dim} is odd")
        halves = 2 if all(_fused(k, v) for k, v in zip(k_buffers, v_buffers)) else 1
        flat = [_bytes(k, halves) for k in k_buffers]
        page_bytes = page_size * k[0].numel() * k.element_size()
        pool._init(flat, halves, page_bytes, kv_heads, head_dim, page_size, source, None)
        return pool

    def _init(self, flat, halves, page_bytes, kv_heads, head_dim, page_size, source, max_rows) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = len(flat), kv_heads, head_dim
        self.page_size, self.device = page_size, flat[0].device
        row_bytes = kv_heads * page_size * head_dim // 2
        if page_bytes % row_bytes or row_bytes % 4:
            raise ValueError(f"a KV page of {page_bytes} bytes a half does not hold whole code rows of {row_bytes}")
        per_page = page_bytes // row_bytes
        rows_per_half = flat[0].numel() // halves // page_bytes * per_page
        self.layout = RowLayout.of(halves, rows_per_half, per_page, row_bytes, kv_heads)
        total = halves * rows_per_half
        # [Hkv, rows, page_size, D / 2]: a row's bytes are [Hkv, page_size, D / 2].
        self.codes = [
            b[: total * row_bytes].view(total, kv_heads, page_size, head_dim // 2).permute(1, 0, 2, 3) for b in flat
        ]
        self.norms = [b[: total * row_bytes].view(torch.float32) for b in flat]  # flat, by layout.norm_index
        self.rows = RowStore(self.layout.rows_of_page, source, max_rows)
        self._capacity = max_rows

    @property
    def capacity(self) -> Optional[int]:
        """Rows it may hold at most (None: what the KV pool can lend)."""
        return self._capacity

    @property
    def pages_in_use(self) -> int:
        return self.rows.rows_in_use

    @property
    def refused(self) -> int:
        return self.rows.refused

    def bytes_per_page(self) -> int:
        """Device bytes of one code row (all layers and KV heads): its codes and value norms."""
        return self.num_layers * self.num_kv_heads * bytes_per_page(self.head_dim, self.page_size)

    def bytes_per_token(self) -> float:
        """Device bytes per token (all layers and KV heads) of the pages it holds."""
        return self.num_layers * self.num_kv_heads * bytes_per_token(self.head_dim, self.page_size)

    def alloc(self, num_pages: int) -> Optional[torch.Tensor]:
        """``num_pages`` row ids, or None (nothing taken) when no row can be had."""
        return self.rows.alloc(num_pages)

    def free(self, ids: torch.Tensor) -> None:
        self.rows.free(ids)

    def write(
        self,
        layer: int,
        ids: torch.Tensor,
        keys: torch.Tensor,
        low: torch.Tensor,
        high: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Code one layer of full pages into rows ``ids``.

        Args:
            keys: ``[n, page_size, kv_heads, D]``; low, high: their ``[n, kv_heads, D]``
                per-channel range (what the reader will dequantise with);
            values: ``[n, page_size, kv_heads, Dv]``.
        """
        if ids.numel() == 0:
            return
        ids = ids.to(self.device)
        self.codes[layer][:, ids] = quantise(keys, low, high)
        norms = values.float().norm(dim=-1).amax(dim=1)  # [n, Hkv]
        self.norms[layer][self._norm_at(ids)] = norms.to(self.device)

    def _norm_at(self, ids: torch.Tensor) -> torch.Tensor:
        """``[*ids.shape, Hkv]`` float32 offsets of the rows' norms."""
        return self.layout.norm_index(ids)[..., None] + torch.arange(self.num_kv_heads, device=ids.device)

    def gather_norms(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """One layer's value norms ``[kv_heads, *ids.shape]`` of rows ``ids`` (padding: garbage,
        masked by the caller's valid flags); ``ids`` on the pool's device (inside a step: no copy)."""
        at = self._norm_at(ids.reshape(-1))
        return self.norms[layer][at].T.reshape(self.num_kv_heads, *ids.shape)

    def gather(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's packed codes ``[kv_heads, *ids.shape, page_size, D/2]`` and value
        norms ``[kv_heads, *ids.shape]`` of ``ids``."""
        flat = ids.reshape(-1).to(self.device)
        codes = self.codes[layer].index_select(1, flat)
        h = self.num_kv_heads
        return codes.view(h, *ids.shape, *codes.shape[2:]), self.gather_norms(layer, flat.view(ids.shape))


def _fused(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a layer's V follows its K in one allocation (SGLang's MHA pool, K and V of one shape)."""
    nbytes = k.numel() * k.element_size()
    return (
        k.shape == v.shape
        and k.is_contiguous()
        and v.is_contiguous()
        and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        and v.data_ptr() - k.data_ptr() == nbytes
    )


def _bytes(k: torch.Tensor, halves: int) -> torch.Tensor:
    """A layer's K bytes (and its V's after them, ``halves`` 2) as one flat uint8 view."""
    nbytes = k.numel() * k.element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=k.device)
    return flat.set_(k.untyped_storage(), k.storage_offset() * k.element_size(), (halves * nbytes,), (1,))
