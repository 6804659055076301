"""Registers, shared memory and resident programs per SM of the stage-1 decode kernel
for each tile shape in ``plan.TILE_CANDIDATES``, compiled for sm_90 on any machine:
no GPU needed, only Triton's bundled ptxas and cuobjdump.

``DecodeTiles.resident_per_sm`` (what the split count is chosen from) is read off this
table. Run it again after any change to the stage-1 kernel, and with the Triton the GPU
machine uses (the figures move between Triton releases):

    PYTHONPATH=sgl-kernel-ext python -m benchmark.kernel.occupancy
    PYTHONPATH=sgl-kernel-ext python -m benchmark.kernel.occupancy --page-size 16 --heads 32,8 --head-dim 128
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

# What one sm_90 SM offers (CUDA occupancy rules): registers are handed to warps in
# 256-register units, every block costs 1 KiB of shared memory beyond its own.
SM90 = dict(registers=65536, shared=228 * 1024, block_reserved=1024, max_blocks=32, max_warps=64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="32,8", help="q_heads,kv_heads (default: Llama-3.1-8B)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--tiles", default="", help="comma-separated names from TILE_CANDIDATES (default: all)")
    p.add_argument("--keep", default="", help="folder to keep each kernel's ttgir, ptx and sass in")
    return p.parse_args(argv)


def resident_per_sm(regs: int, shared: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps one sm_90 SM holds at once."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (SM90["registers"] // per_warp) // num_warps if per_warp else SM90["max_blocks"]
    by_shared = SM90["shared"] // (shared + SM90["block_reserved"])
    by_warps = SM90["max_warps"] // num_warps
    return min(by_regs, by_shared, by_warps, SM90["max_blocks"])


def compile_for_sm90(fn, args: dict, num_warps: int, num_stages: int, keep: str = "") -> dict:
    """Compile a ``@triton.jit`` function for sm_90 with ``args`` (name -> tensor, int,
    float or constexpr value); return its registers, spill bytes and shared memory."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32"}
    pointer[torch.int64] = "*i64"
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name], constants[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            # what the JIT assumes of a torch allocation: 16-byte aligned
            signature[param.name], attrs[(i,)] = pointer[value.dtype], [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif value == 1:
            signature[param.name], constants[(i,)] = "constexpr", 1  # the JIT specialises 1
        else:
            signature[param.name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(fn, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True)
        sass = ""
        if keep:
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True)
            sass = sass.stdout
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage.stdout, re.S)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {usage.stdout}{usage.stderr}")
    if keep:
        os.makedirs(keep, exist_ok=True)
        stem = os.path.join(keep, f"{fn.__name__}-w{num_warps}-s{num_stages}-{len(os.listdir(keep))}")
        for ext, text in (("ttgir", compiled.asm["ttgir"]), ("ptx", compiled.asm["ptx"]), ("sass", sass)):
            with open(f"{stem}.{ext}", "w") as f:
                f.write(text)
    return dict(regs=int(found.group(1)), spill=int(found.group(2)), shared=compiled.metadata.shared)


def stage1_args(tiles, *, q_heads, kv_heads, head_dim, page_size, dtype, importance, max_pages=8192, splits=32):
    """The stage-1 launch ``decode_importance_fwd`` makes, as compile-time values."""
    import torch

    from sgl_kernel_ext.plan import decode_geometry

    geo = decode_geometry(q_heads, kv_heads, head_dim, head_dim, page_size, tiles)
    one = lambda d: torch.empty(1, dtype=d)  # noqa: E731
    f32 = torch.float32
    return geo, dict(
        Q=one(dtype),
        K=one(dtype),
        V=one(dtype),
        KvIndptr=one(torch.int32),
        KvIndices=one(torch.int64),
        MidO=one(f32),
        MidLse=one(f32),
        PageLse=one(f32),
        sm_scale=head_dim**-0.5,
        logit_cap=0.0,
        num_splits=3,
        max_pages=max_pages,
        stride_qb=q_heads * head_dim,
        stride_qh=head_dim,
        stride_ks=kv_heads * head_dim,
        stride_kh=head_dim,
        stride_vs=kv_heads * head_dim,
        stride_vh=head_dim,
        stride_mob=q_heads * splits * head_dim,
        stride_moh=splits * head_dim,
        stride_mos=head_dim,
        stride_mlb=q_heads * splits,
        stride_mlh=splits,
        stride_plb=q_heads * max_pages,
        stride_plh=max_pages,
        GROUP=geo.group_size,
        HEAD_TILES=geo.head_tiles,
        BLOCK_H=geo.block_h,
        BLOCK_N=geo.block_n,
        HEAD_DIM=head_dim,
        V_HEAD_DIM=head_dim,
        BLOCK_D=geo.block_d,
        BLOCK_DV=geo.block_dv,
        PAGE_SIZE=page_size,
        SPLIT_ALIGN=geo.split_align,
        USE_DOT=geo.use_dot,
        IEEE_DOT=False,
        HAS_CAP=False,
        MASK_PAGE0=True,
        IMPORTANCE=importance,
        PAGE_PER_WARP=geo.page_per_warp,
    )


def main(argv=None):
    args = parse_args(argv)
    import torch
    import triton

    from sgl_kernel_ext.decode_importance import _decode_importance_stage1
    from sgl_kernel_ext.plan import TILE_CANDIDATES

    q_heads, kv_heads = map(int, args.heads.split(","))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    names = args.tiles.split(",") if args.tiles else list(TILE_CANDIDATES)
    if q_heads == kv_heads:
        names = names[:1]  # the one-head path has one shape, plan.MHA_TILES
    print(f"stage 1 on sm_90, Triton {triton.__version__}: {q_heads} q / {kv_heads} kv heads, d {args.head_dim}, ")
    print(f"page {args.page_size}, {args.dtype}; resident = programs per SM (registers, shared memory, warps)\n")
    print("| tiles | importance | regs | spill B | shared B | resident | table says |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        tiles = TILE_CANDIDATES[name]
        for importance in (False, True):
            geo, kernel_args = stage1_args(
                tiles,
                q_heads=q_heads,
                kv_heads=kv_heads,
                head_dim=args.head_dim,
                page_size=args.page_size,
                dtype=dtype,
                importance=importance,
            )
            got = compile_for_sm90(_decode_importance_stage1, kernel_args, geo.num_warps, geo.num_stages, args.keep)
            resident = resident_per_sm(got["regs"], got["shared"], geo.num_warps)
            shown = name if geo.use_dot else "MHA_TILES"
            print(
                f"| {shown} | {'on' if importance else 'off'} | {got['regs']} | {got['spill']} | {got['shared']} "
                f"| {resident} | {geo.resident_per_sm} |"
            )


if __name__ == "__main__":
    main()
