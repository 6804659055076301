"""Launch geometry and split schedule for decode-with-importance.

Pure Python (no Triton import) so the torch backend and the tests can reason about
the schedule without a GPU. The kernels in ``decode_importance`` recompute the same
per-request split boundaries on the device from ``kv_indptr``; nothing here reads a
device tensor, which is what keeps ``run()`` free of host syncs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Query heads one stage-1 program handles together when a KV head serves several
# of them; 16 is the smallest M a tensor-core dot accepts.
GROUPED_BLOCK_H = 16


@dataclass(frozen=True)
class DecodeTiles:
    """How one stage-1 program walks its split: tile, warps, pipeline depth.

    ``resident_per_sm`` is how many such programs one SM holds at once, the smaller
    of the importance-on and importance-off kernels; the split count is chosen from
    it so that stage 1 never leaves a thin last wave. Figures in ``TILE_CANDIDATES``
    come from ptxas for sm_90 (Triton 3.6, bf16, d 128; registers are the limit):
    ``python -m benchmark.kernel.occupancy`` prints them again without a GPU.
    """

    block_n: int  # tokens per tile (a power of two)
    num_warps: int
    num_stages: int  # 2: the next tile's slot indices are read synchronously; 3: they are prefetched too
    resident_per_sm: int


# Stage-1 shapes of the grouped (tensor-core) path, by name. The benchmark's
# ``--sweep-tiles`` times each beside SGLang's kernel; the default is the one that
# sweep decides. Why these and what each should move: benchmark/kernel/NOTES.md.
TILE_CANDIDATES = {
    "n32s2w4": DecodeTiles(block_n=32, num_warps=4, num_stages=2, resident_per_sm=5),
    "n32s3w4": DecodeTiles(block_n=32, num_warps=4, num_stages=3, resident_per_sm=4),
    "n64s2w4": DecodeTiles(block_n=64, num_warps=4, num_stages=2, resident_per_sm=4),
    "n64s3w4": DecodeTiles(block_n=64, num_warps=4, num_stages=3, resident_per_sm=3),
    "n64s3w8": DecodeTiles(block_n=64, num_warps=8, num_stages=3, resident_per_sm=2),
}
GROUPED_TILES = TILE_CANDIDATES["n64s3w4"]
# The one-head path reduces in fp32 elementwise; a 64-token tile spilled at 4 warps,
# so it takes 32 tokens over 8 warps. With importance on it needs 143 registers per
# thread (sm_90, d 128): one program per SM.
MHA_TILES = DecodeTiles(block_n=32, num_warps=8, num_stages=2, resident_per_sm=1)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DecodeGeometry:
    """Tile shapes of one model shape; fixed for the life of a wrapper.

    ``split_align`` is the granularity of split boundaries: a multiple of both the
    tile and the page, so a page never straddles two splits and every page's partial
    log-sum-exp is produced by exactly one program.
    """

    group_size: int  # query heads per KV head
    block_h: int  # query heads per stage-1 program
    head_tiles: int  # stage-1 programs per KV head
    block_n: int  # tokens per tile
    split_align: int  # lcm(block_n, page_size); both are powers of two
    use_dot: bool  # tensor-core dots (grouped) vs elementwise (one head)
    block_d: int
    block_dv: int
    num_warps: int
    num_stages: int
    resident_per_sm: int  # stage-1 programs one SM holds at once (see DecodeTiles)
    # each warp's columns of a tile are exactly one page (tokens reordered in the tile)
    page_per_warp: bool


def decode_geometry(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    page_size: int,
    tiles: Optional[DecodeTiles] = None,
) -> DecodeGeometry:
    """Choose tiles for a model shape. Raises ValueError on shapes the kernel cannot serve.

    ``tiles`` overrides the grouped path's stage-1 shape (``TILE_CANDIDATES``); the
    one-head path keeps ``MHA_TILES``.
    """
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two (1, 16, 32, 64, ...)")
    group = num_q_heads // num_kv_heads
    if group == 1:
        block_h, use_dot, tiles = 1, False, MHA_TILES
    else:
        block_h, use_dot, tiles = GROUPED_BLOCK_H, True, tiles or GROUPED_TILES
    block_n = tiles.block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two >= 16")
    # tl.dot wants K >= 16
    block_d = max(16, next_power_of_2(head_dim))
    block_dv = max(16, next_power_of_2(v_head_dim))
    return DecodeGeometry(
        group_size=group,
        block_h=block_h,
        head_tiles=cdiv(group, block_h),
        block_n=block_n,
        split_align=max(block_n, page_size),
        use_dot=use_dot,
        block_d=block_d,
        block_dv=block_dv,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        resident_per_sm=tiles.resident_per_sm,
        # the tensor-core layout hands warps 8-column runs of the tile, in turn
        page_per_warp=use_dot and 8 <= page_size < block_n and block_n == page_size * tiles.num_warps,
    )


def split_bounds(seq_len: int, num_splits: int, split_align: int) -> list[tuple[int, int]]:
    """Host mirror of the device split schedule: the non-empty ``[lo, hi)`` token ranges.

    Each split covers ``chunk`` tokens, ``chunk`` being ``ceil(seq_len / num_splits)``
    rounded up to ``split_align``; a short request therefore uses fewer splits than
    ``num_splits``. Used by tests and documentation, never on the launch path.
    """
    chunk = max(cdiv(cdiv(seq_len, num_splits), split_align) * split_align, split_align)
    return [(lo, min(lo + chunk, seq_len)) for lo in range(0, seq_len, chunk)]


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(
    batch_size: int,
    num_kv_heads: int,
    geometry: DecodeGeometry,
    max_splits: int,
    device: torch.device,
    policy: Optional[str] = None,
) -> int:
    """Splits per request for stage 1, by ``SPLIT_POLICIES[policy or DEFAULT_SPLIT_POLICY]``.

    Depends only on host-known integers (never on sequence lengths), so the same
    count is baked into a CUDA graph captured for this batch size.
    """
    device = torch.device(device)
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 4
    programs_per_split = max(1, batch_size * num_kv_heads * geometry.head_tiles)
    rule = SPLIT_POLICIES[policy or DEFAULT_SPLIT_POLICY]
    return max(1, min(max_splits, rule(programs_per_split, sms, geometry.resident_per_sm, max_splits)))


# The share of its last wave a grid must fill for ``whole_wave_splits`` to stop adding splits.
WAVE_FILL = 0.9


def whole_wave_splits(programs_per_split: int, sms: int, resident_per_sm: int, max_splits: int) -> int:
    """The fewest splits whose stage-1 grid is close to a whole number of waves.

    A wave is the ``sms * resident_per_sm`` programs the GPU runs at once. Every split
    of every request walks about as many tiles, so a grid of 1.3 waves leaves a last
    wave of few programs, too few loads in flight to keep the memory busy, for about
    as long as a full wave takes. Takes the fewest splits whose grid fills at least
    ``WAVE_FILL`` of its last wave (a grid smaller than one wave counts as that
    fraction of one); when none does (small batches), the count that fills most.
    """
    resident = max(1, sms * resident_per_sm)
    best, best_fill = 1, 0.0
    for splits in range(1, max(1, max_splits) + 1):
        waves = splits * programs_per_split / resident
        fill = waves / math.ceil(waves)
        if fill >= WAVE_FILL:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
    return best


def one_wave_splits(programs_per_split: int, sms: int, resident_per_sm: int, max_splits: int) -> int:
    """The most splits whose grid still fits one wave (one split when even that overflows)."""
    return max(1, sms * resident_per_sm // programs_per_split)


def four_per_sm_splits(programs_per_split: int, sms: int, resident_per_sm: int, max_splits: int) -> int:
    """About four programs per SM, rounded up, whatever the occupancy (the rule before
    ``whole_wave_splits``: with four resident programs it overflowed into a thin second
    wave at bs 8 and 32 on an H100)."""
    return cdiv(4 * sms, programs_per_split)


# Split rules by name; the benchmark's ``--sweep-splits`` times each.
SPLIT_POLICIES = {
    "whole_wave": whole_wave_splits,
    "one_wave": one_wave_splits,
    "four_per_sm": four_per_sm_splits,
}
DEFAULT_SPLIT_POLICY = "whole_wave"
