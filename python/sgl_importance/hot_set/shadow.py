"""The shadow: an 8-bit copy of every full page of a hot-set request, kept on the device.

The guard (``estimate.py``) estimates the attention over the pages a step does not
read from this copy and bounds the error of that estimate. Per-page summaries cannot
do it on SmolLM2 (``benchmark/long_context/bench_bound.py``): a page's key min/max
bound is 13-14 nats loose, and even exact per-page logits leave the values *within*
a page unknown, which in the model's diffuse heads is most of the output. So the
shadow keeps every token, at 8 bits:

- keys, per page, KV head and channel, asymmetric over the page's tokens between the
  channel's minimum and maximum (per channel because keys have outlier channels;
  KIVI, Liu et al. 2024): ``k = min + code * step``, ``step = (max - min) / 255``;
- values the same way (per channel: on SmolLM2 a per-token or per-page scale leaves
  the bound 2-4x looser at 4 bits, ``bench_bound.py``).

Rounding to the nearest code leaves each element within ``step / 2`` of the stored
one, which is what the guard's bound uses. The minimum and maximum are stored keys
(values), so they are kept in the pool's dtype without rounding, and the step is
recomputed from them in float32 the same way on write and on read.

Pages are written once, when full (the page being decoded into is always in the
recent window, read exactly), and live in a pool of shadow pages indexed by their
own ids, independent of the device pages: a page released to the host pool keeps
its shadow. Id 0 is padding (zeros, never listed as valid). Capacity doubles on
demand; ``bytes_per_token`` says what it costs.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

LEVELS = 255  # 8-bit codes
# Float32 recomputes min + code * step with a few units of rounding; the bound adds
# this much of the page's largest magnitude so it holds for the float32 numbers too.
ROUNDING_MARGIN = 2.0**-18


@dataclass
class ShadowPages:
    """One layer's shadow of a batch's listed pages, laid out for batched matmuls.

    Attributes:
        k_codes, v_codes: uint8 ``[kv_heads, n, page_size, D]``.
        k_min, k_step, v_min, v_step: float32 ``[kv_heads, n, D]``: element ``i`` is
            ``min + code_i * step``, within ``step / 2`` of the stored one.
        k_magnitude: float32 ``[kv_heads, n]``, the page's largest dequantised |key|.
        v_norm: float32 ``[kv_heads, n, page_size]``, each dequantised value's L2 norm.
        v_error: float32 ``[kv_heads, n]``: no stored value is farther (L2) from its
            dequantised one.
    """

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_min: torch.Tensor
    k_step: torch.Tensor
    v_min: torch.Tensor
    v_step: torch.Tensor
    k_magnitude: torch.Tensor
    v_norm: torch.Tensor
    v_error: torch.Tensor

    def keys(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dequantised keys, float32 ``[kv_heads, n, page_size, D]`` (into ``out`` if given)."""
        return _dequantise(self.k_codes, self.k_min, self.k_step, out)

    def values(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _dequantise(self.v_codes, self.v_min, self.v_step, out)

    def logit_error(self, q: torch.Tensor) -> torch.Tensor:
        """``|q . k - q . k_dequantised| <=`` this, for every key of each page.

        Args:
            q: float32 ``[kv_heads, n, g, D]`` (scaled queries of the pages' requests).

        Returns:
            ``[kv_heads, n, g, P]`` for pages ``[kv_heads, n * P]`` of ``n`` requests.
        """
        hkv, n, g, d = q.shape
        a = q.abs()
        step = self.k_step.view(hkv, n, -1, d)
        rounding = torch.matmul(a, step.transpose(-1, -2)) * 0.5
        margin = a.sum(-1, keepdim=True) * self.k_magnitude.view(hkv, n, 1, -1) * ROUNDING_MARGIN
        return rounding + margin


def _dequantise(
    codes: torch.Tensor, low: torch.Tensor, step: torch.Tensor, out: Optional[torch.Tensor]
) -> torch.Tensor:
    # A conversion pass, then one fused multiply-add. A reused ``out`` matters on a CPU:
    # a fresh tensor of this size costs page faults, ~3x the conversion.
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    out.copy_(codes)
    return torch.addcmul(low[:, :, None].float(), out, step[:, :, None].float(), out=out)


def quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit codes of pages ``x`` ``[n, page_size, kv_heads, D]``, per page, head and channel.

    Returns:
        codes uint8 ``[kv_heads, n, page_size, D]``; min and step ``[kv_heads, n, D]`` in
        ``x``'s dtype: the min is an element of ``x`` (exact), the step is rounded *up*
        to the dtype, so ``min + 255 * step`` still reaches the max and every element
        is within ``step / 2`` of its code's value.
    """
    low = x.amin(dim=1)
    span = (x.amax(dim=1).float() - low.float()) / LEVELS
    step = (span * (1.0 + 2.0 * torch.finfo(x.dtype).eps)).to(x.dtype)
    scaled = (x.float() - low.float()[:, None]) / torch.where(step > 0, step.float(), 1.0)[:, None]
    codes = scaled.round_().clamp_(0, LEVELS).to(torch.uint8)
    return codes.permute(2, 0, 1, 3).contiguous(), low.transpose(0, 1), step.transpose(0, 1)


class ShadowPool:
    """8-bit K and V of full pages, by shadow page id, for every layer.

    Args:
        num_layers, num_kv_heads, head_dim, page_size: the KV pool's shape.
        dtype: the KV pool's dtype (the per-channel min and max are kept in it).
        initial_pages: capacity before the first growth.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        initial_pages: int = 64,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self._free: list[int] = []
        self._next = 1  # id 0 is padding
        self._alloc_tensors(max(2, initial_pages))

    def _alloc_tensors(self, capacity: int) -> None:
        lay, h, ps, d = self.num_layers, self.num_kv_heads, self.page_size, self.head_dim
        codes = dict(dtype=torch.uint8, device=self.device)
        ranges = dict(dtype=self.dtype, device=self.device)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.k_codes = torch.zeros((lay, h, capacity, ps, d), **codes)
        self.v_codes = torch.zeros((lay, h, capacity, ps, d), **codes)
        self.k_min = torch.zeros((lay, h, capacity, d), **ranges)
        self.k_step = torch.zeros((lay, h, capacity, d), **ranges)
        self.v_min = torch.zeros((lay, h, capacity, d), **ranges)
        self.v_step = torch.zeros((lay, h, capacity, d), **ranges)
        # What the bound needs per page and token, computed once when the page is written.
        self.k_magnitude = torch.zeros((lay, h, capacity), **f32)
        self.v_norm = torch.zeros((lay, h, capacity, ps), **f32)
        self.v_error = torch.zeros((lay, h, capacity), **f32)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.k_codes, self.v_codes, self.k_min, self.k_step, self.v_min, self.v_step,
            self.k_magnitude, self.v_norm, self.v_error,
        )  # fmt: skip

    @property
    def capacity(self) -> int:
        return self.k_codes.shape[2]

    @property
    def pages_in_use(self) -> int:
        return self._next - 1 - len(self._free)

    def bytes_per_token(self) -> float:
        """Device bytes the shadow keeps per token (codes plus the per-page ranges)."""
        per_page = sum(t[:, :, 0].numel() * t.element_size() for t in self._tensors())
        return per_page / self.page_size

    def alloc(self, num_pages: int) -> torch.Tensor:
        """``num_pages`` fresh shadow ids (the pool grows when full)."""
        reuse = [self._free.pop() for _ in range(min(num_pages, len(self._free)))]
        fresh = num_pages - len(reuse)
        if self._next + fresh > self.capacity:
            self._grow(self._next + fresh)
        ids = reuse + list(range(self._next, self._next + fresh))
        self._next += fresh
        # Ids are the decoder's bookkeeping, planned on the host; reads move them over.
        return torch.tensor(ids, dtype=torch.int64)

    def free(self, ids: torch.Tensor) -> None:
        self._free.extend(int(i) for i in ids.tolist() if i > 0)

    def _grow(self, needed: int) -> None:
        old = self._tensors()
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        self._alloc_tensors(capacity)
        for new, kept in zip(self._tensors(), old):
            new[:, :, : kept.shape[2]] = kept

    def write(self, layer: int, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantise one layer of full pages into shadow ``ids``.

        Args:
            keys, values: ``[n, page_size, kv_heads, D]`` (the pool's pages).
        """
        if ids.numel() == 0:
            return
        codes, low, step = quantise(keys.to(self.dtype))
        self.k_codes[layer][:, ids], self.k_min[layer][:, ids], self.k_step[layer][:, ids] = codes, low, step
        self.k_magnitude[layer][:, ids] = _dequantise(codes, low, step, None).abs().amax(dim=(2, 3))
        codes, low, step = quantise(values.to(self.dtype))
        self.v_codes[layer][:, ids], self.v_min[layer][:, ids], self.v_step[layer][:, ids] = codes, low, step
        values_hat = _dequantise(codes, low, step, None)
        self.v_norm[layer][:, ids] = values_hat.norm(dim=-1)
        magnitude = values_hat.abs().amax(dim=2)  # [H, n, D]
        self.v_error[layer][:, ids] = (step.float() * 0.5 + magnitude * ROUNDING_MARGIN).norm(dim=-1)

    def pages(self, layer: int, ids: torch.Tensor) -> ShadowPages:
        """One layer's shadow of ``ids`` (any shape, flattened in order)."""
        flat = ids.reshape(-1).to(self.device)
        h, cap = self.num_kv_heads, self.capacity
        # One gather of whole rows over (head, page): index_select on a middle dimension
        # copied ~5x slower on a CPU.
        rows = (torch.arange(h, device=flat.device)[:, None] * cap + flat[None, :]).flatten()

        def take(t: torch.Tensor) -> torch.Tensor:
            per = t[layer]
            return per.reshape(h * cap, -1).index_select(0, rows).view(h, flat.numel(), *per.shape[2:])

        return ShadowPages(
            k_codes=take(self.k_codes),
            v_codes=take(self.v_codes),
            k_min=take(self.k_min).float(),
            k_step=take(self.k_step).float(),
            v_min=take(self.v_min).float(),
            v_step=take(self.v_step).float(),
            k_magnitude=take(self.k_magnitude).view(h, -1),
            v_norm=take(self.v_norm),
            v_error=take(self.v_error).view(h, -1),
        )
