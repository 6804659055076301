"""Launch geometry and split schedule for decode-with-importance.

Pure Python (no Triton import) so the torch backend and the tests can reason about
the schedule without a GPU. The kernels in ``decode_importance`` recompute the same
per-request split boundaries on the device from ``kv_indptr``; nothing here reads a
device tensor, which is what keeps ``run()`` free of host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Query heads one stage-1 program handles together when a KV head serves several
# of them; 16 is the smallest M a tensor-core dot accepts.
GROUPED_BLOCK_H = 16
# Tokens per stage-1 tile. The grouped path is a [16, D] x [D, N] dot with 4 warps
# (about 170 registers on sm_90, importance on or off). The MHA path reduces one head
# elementwise in fp32; a 64-token tile there spilled at 4 warps, so it takes 32 tokens
# over 8 warps (about 120 registers). Register counts from ptxas, not timed yet.
GROUPED_BLOCK_N = 32
MHA_BLOCK_N = 32
GROUPED_NUM_WARPS = 4
MHA_NUM_WARPS = 8


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


def decode_geometry(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    page_size: int,
) -> DecodeGeometry:
    """Choose tiles for a model shape. Raises ValueError on shapes the kernel cannot serve."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two (1, 16, 32, 64, ...)")
    group = num_q_heads // num_kv_heads
    if group == 1:
        block_h, block_n, use_dot = 1, MHA_BLOCK_N, False
    else:
        block_h, block_n, use_dot = GROUPED_BLOCK_H, GROUPED_BLOCK_N, True
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
        num_warps=GROUPED_NUM_WARPS if use_dot else MHA_NUM_WARPS,
        num_stages=2,
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
) -> int:
    """Splits per request so that stage 1 fills the GPU about four programs per SM.

    Depends only on host-known integers (never on sequence lengths), so the same
    count is baked into a CUDA graph captured for this batch size.
    """
    device = torch.device(device)
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 4
    programs_per_split = max(1, batch_size * num_kv_heads * geometry.head_tiles)
    return max(1, min(max_splits, cdiv(4 * sms, programs_per_split)))
