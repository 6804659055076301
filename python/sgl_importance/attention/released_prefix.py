"""An extend batch's prefixes, part of them released to the host pool, laid out for one kernel.

Streamed prefill (``--hot-set-prefill stream``) and a returning turn read from the host pool
leave a request's earlier pages on the host while its next chunk is prefilled. SGLang's
Triton extend kernel reads a prefix through ``kv_indices`` out of one K and one V buffer, so
``importance_triton`` gives it one: each layer, the batch's prefix tokens are gathered in
``kv_indices`` order into a staging buffer (the device-resident ones from the pool, the
released ones from their host copies, the values the device held), and the kernel reads it
densely packed. The output is the one the device-resident prefix would give.

The staging buffers are allocated once a forward (one layer of the batch's prefixes, K and
V) and rewritten in every layer; the positions of the released tokens in them and their
host slots are worked out once a forward, on the host.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

ReadHost = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# One request's: None (its prefix is on the device) or (positions, host slots) of its released tokens.
ReleasedPrefix = Optional[tuple[torch.Tensor, torch.Tensor]]


class ReleasedPrefixes:
    """Where an extend batch's released prefix tokens go in its staging buffers.

    Args:
        released: per request, None (its prefix is on the device) or ``(positions, host
            slots)`` of its prefix tokens held only in the host pool (positions from the
            start of its sequence).
        prefix_lens: each request's prefix length (tokens before its new ones), on the host.
        kv_indices: the pool slots of the prefixes, request after request (SGLang's extend
            metadata; a released token shows the released slot, overwritten here).
        kv_heads, head_dim, v_head_dim, dtype, device: the KV pool's layout.
    """

    def __init__(
        self,
        released: Sequence[ReleasedPrefix],
        prefix_lens: Sequence[int],
        kv_indices: torch.Tensor,
        *,
        kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        starts = [0]
        for n in prefix_lens:
            starts.append(starts[-1] + int(n))
        self.tokens = starts[-1]
        self.index = kv_indices[: self.tokens].to(torch.int64)
        rows, slots = [], []
        for start, entry in zip(starts, released):
            if entry is not None:
                rows.append(entry[0].to(torch.int64) + start)
                slots.append(entry[1].to(torch.int64))
        self.host_slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        self.rows = (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)).to(device)
        self.k = torch.empty(self.tokens, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(self.tokens, kv_heads, v_head_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """The staging buffers' bytes (one layer of the batch's prefixes)."""
        return self.k.nbytes + self.v.nbytes

    def layer(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, read_host: ReadHost) -> tuple[torch.Tensor, ...]:
        """This layer's prefixes, densely packed ``[tokens, kv_heads, D]`` (K, V): the slots read
        from the layer's pool, the released ones overwritten from their host copies
        (``read_host(host slots) -> (K, V)``)."""
        torch.index_select(k_buffer, 0, self.index, out=self.k)
        torch.index_select(v_buffer, 0, self.index, out=self.v)
        if self.host_slots.numel():
            host_k, host_v = read_host(self.host_slots)
            self.k[self.rows] = host_k.to(self.k.device, non_blocking=True)
            self.v[self.rows] = host_v.to(self.v.device, non_blocking=True)
        return self.k, self.v
