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
Llama-3.1-8B shape (D 128, page 16) against 512 for its bf16 K and V (12.5 %).
The pool is allocated once, for a fixed number of pages (``--hot-set-guard-tokens``),
and never grows: a request that cannot get codes for its pages decodes without a
guard, and is counted (``alloc`` returns None).

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Optional

import torch

LEVELS = 15  # 4-bit codes
# Float32 recomputes min + code * step with a few units of rounding; the logit error
# adds this much of the page's largest |key| so it holds for the float32 numbers too.
ROUNDING_MARGIN = 2.0**-18


def bytes_per_page(head_dim: int, page_size: int) -> int:
    """Device bytes of guard state per page, layer and KV head: the packed codes and
    one float32 value norm (what ``GuardPool`` allocates per page id)."""
    return page_size * head_dim // 2 + 4


def bytes_per_token(head_dim: int, page_size: int) -> float:
    """Device bytes of guard state per token, layer and KV head."""
    return bytes_per_page(head_dim, page_size) / page_size


def kv_bytes_per_token(head_dim: int, element_size: int) -> int:
    """Device bytes of K and V per token, layer and KV head."""
    return 2 * head_dim * element_size


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


class GuardPool:
    """4-bit key codes and value norms of full pages, by guard page id, for every layer.

    Args:
        num_layers, num_kv_heads, head_dim, page_size: the KV pool's shape.
        capacity_pages: pages it holds, fixed (id 0 is padding, not counted).
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
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.device = page_size, torch.device(device)
        rows = capacity_pages + 1
        self.codes = torch.zeros((num_layers, num_kv_heads, rows, page_size, head_dim // 2), dtype=torch.uint8,
                                 device=self.device)  # fmt: skip
        self.value_norm = torch.zeros((num_layers, num_kv_heads, rows), dtype=torch.float32, device=self.device)
        # Ids are planned on the host; freed ids are reused last-in first-out.
        self._free = list(range(capacity_pages, 0, -1))
        self.refused = 0  # allocations refused for want of room

    @property
    def capacity(self) -> int:
        return self.codes.shape[2] - 1

    @property
    def pages_in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.value_norm.numel() * 4

    def bytes_per_page(self) -> int:
        """Device bytes of one page id (all layers and KV heads): its codes and value norms."""
        return self.num_layers * self.num_kv_heads * bytes_per_page(self.head_dim, self.page_size)

    def bytes_per_token(self) -> float:
        """Device bytes per token (all layers and KV heads) of the pages it holds."""
        return self.num_layers * self.num_kv_heads * bytes_per_token(self.head_dim, self.page_size)

    def alloc(self, num_pages: int) -> Optional[torch.Tensor]:
        """``num_pages`` ids, or None (nothing taken) when the pool has fewer free."""
        if num_pages > len(self._free):
            self.refused += 1
            return None
        ids = [self._free.pop() for _ in range(num_pages)]
        return torch.tensor(ids, dtype=torch.int64)

    def free(self, ids: torch.Tensor) -> None:
        self._free.extend(int(i) for i in ids.tolist() if i > 0)

    def write(
        self,
        layer: int,
        ids: torch.Tensor,
        keys: torch.Tensor,
        low: torch.Tensor,
        high: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Code one layer of full pages into guard ``ids``.

        Args:
            keys: ``[n, page_size, kv_heads, D]``; low, high: their ``[n, kv_heads, D]``
                per-channel range (what the reader will dequantise with);
            values: ``[n, page_size, kv_heads, Dv]``.
        """
        if ids.numel() == 0:
            return
        ids = ids.to(self.device)
        self.codes[layer][:, ids] = quantise(keys, low, high)
        self.value_norm[layer][:, ids] = values.float().norm(dim=-1).amax(dim=1).transpose(0, 1)

    def gather(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's packed codes ``[kv_heads, *ids.shape, page_size, D/2]`` and value
        norms ``[kv_heads, *ids.shape]`` of ``ids``."""
        flat = ids.reshape(-1).to(self.device)
        codes = self.codes[layer].index_select(1, flat)
        norms = self.value_norm[layer].index_select(1, flat)
        h = self.num_kv_heads
        return codes.view(h, *ids.shape, *codes.shape[2:]), norms.view(h, *ids.shape)
