"""Decode attention with importance on vs off (same kernel), optionally vs SGLang's
stock Triton decode kernel and FlashInfer when they are importable.

For every (model, page size, bs, context) it reports the median time of one decode
step for one layer, the on/off ratio, and the achieved K+V read bandwidth next to a
measured device-to-device copy bandwidth. Writes results.md, results.json and
results.png into --out. See README.md beside this file.

    python -m benchmark.kernel.bench_decode --out /tmp/bench          # GPU
    python -m benchmark.kernel.bench_decode --smoke --out /tmp/smoke  # CPU, interpreter

``--sweep-tiles`` instead times every stage-1 tile shape of ``plan.TILE_CANDIDATES``
(with every split rule of ``--sweep-splits``) on/off, SGLang's kernel beside each at
the same split count, and writes sweep.md / sweep.json: the data that picks
``plan.GROUPED_TILES`` and ``plan.DEFAULT_SPLIT_POLICY`` (see NOTES.md).

Run from the repository root; where sgl-kernel-ext is not installed (a bare GPU
machine), put it on the path: ``PYTHONPATH=sgl-kernel-ext python -m ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

MODELS = {
    # name: (q_heads, kv_heads, head_dim)
    "llama8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmark" / "kernel" / "results")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on CPU under TRITON_INTERPRET=1 (validates the script; timings mean nothing)",
    )
    p.add_argument("--models", default="llama8b,smollm2")
    p.add_argument("--bs", default="1,8,32,64")
    p.add_argument("--ctx", default="4096,32768,131072")
    p.add_argument("--page-sizes", default="16")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--num-splits", type=int, default=0, help="0: the wrapper's default for the batch size")
    p.add_argument("--max-splits", type=int, default=32)
    p.add_argument("--no-cuda-graph", action="store_true", help="time eager launches instead of graph replays")
    p.add_argument("--no-baselines", action="store_true", help="skip SGLang / FlashInfer even if importable")
    p.add_argument(
        "--mem-fraction", type=float, default=0.8, help="skip configs needing more than this share of free GPU memory"
    )
    p.add_argument(
        "--sweep-tiles",
        default="",
        help="'all' or comma-separated plan.TILE_CANDIDATES names: time each on/off with SGLang beside it",
    )
    p.add_argument(
        "--sweep-splits",
        default="all",
        help="with --sweep-tiles: 'all' or comma-separated plan.SPLIT_POLICIES names (a rule per tile shape)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.bs = "1,2"
        args.ctx = "64,160"
        args.warmup, args.iters = 1, 2
    return args


@dataclass
class Row:
    model: str
    page_size: int
    bs: int
    ctx: int
    num_splits: int
    on_ms: float
    off_ms: float
    ratio: float
    kv_bytes: int
    on_gbps: float
    off_gbps: float
    copy_gbps: float
    baselines_ms: dict = field(default_factory=dict)
    max_rel_err: float | None = None


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

    import torch

    from sgl_kernel_ext import DecodeImportanceWrapper, decode_importance_reference

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke to validate the script on CPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    timer = CudaTimer(torch) if device == "cuda" else CpuTimer()
    baselines = {} if (args.no_baselines or args.smoke) else load_baselines()
    copy_gbps = measure_copy_bandwidth(torch, device, timer)
    print(f"device copy bandwidth: {copy_gbps:.0f} GB/s; baselines: {sorted(baselines) or 'none'}")
    setup = Setup(
        torch, args, timer, device, dtype, copy_gbps, baselines, DecodeImportanceWrapper, decode_importance_reference
    )

    if args.sweep_tiles:
        sweep(setup)
        return

    rows: list[Row] = []
    for model in args.models.split(","):
        q_heads, kv_heads, head_dim = MODELS[model]
        for page_size in map(int, args.page_sizes.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                for bs in map(int, args.bs.split(",")):
                    need = estimate_bytes(bs, ctx, page_size, q_heads, kv_heads, head_dim, dtype.itemsize)
                    if device == "cuda":
                        free, _ = torch.cuda.mem_get_info()
                        if need > args.mem_fraction * free:
                            print(f"skip {model} P={page_size} bs={bs} ctx={ctx}: needs {need / 2**30:.1f} GiB")
                            continue
                    row = bench_one(setup, model, page_size, bs, ctx)
                    rows.append(row)
                    print(format_row(row))
                    if device == "cuda":
                        torch.cuda.empty_cache()

    meta = run_meta(torch, device, args, dtype=args.dtype, copy_gbps=copy_gbps)
    write_outputs(args.out, rows, meta, markdown_table(rows, meta), plot, "results.png")


def run_meta(torch, device: str, args, **extra) -> dict:
    """What a results file says about the run: device, versions, graph replay, time."""
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1, smoke)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "cuda_graph": device == "cuda" and not args.no_cuda_graph,
        "smoke": args.smoke,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        **extra,
    }


def write_outputs(out: Path, rows: list, meta: dict, table: str, plot_fn, png: str) -> None:
    """results.md (the table, also printed), results.json (meta + rows) and the plot."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    plot_fn(rows, meta, out / png)
    print()
    print(table)
    print(f"wrote {out}/results.md, results.json, {png}")


def estimate_bytes(bs, ctx, page_size, q_heads, kv_heads, head_dim, itemsize):
    pages = math.ceil(ctx / page_size)
    kv = (bs * pages + 1) * page_size * kv_heads * head_dim * 2 * itemsize
    workspace = bs * q_heads * pages * 4 + bs * ctx * 8
    return kv + workspace + (256 << 20)


def build_batch(torch, bs, ctx, page_size, q_heads, kv_heads, head_dim, dtype, device, seed=0):
    """SGLang-like paged layout: each request owns ctx/page_size random physical pages >= 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages = math.ceil(ctx / page_size)
    order = torch.randperm(bs * pages, generator=gen) + 1
    slots = (order.view(bs, pages, 1) * page_size + torch.arange(page_size)).view(bs, -1)[:, :ctx]
    kv_indices = slots.reshape(-1).to(device)
    kv_indptr = torch.arange(bs + 1, dtype=torch.int32, device=device) * ctx
    num_slots = (bs * pages + 1) * page_size
    k = torch.empty(num_slots, kv_heads, head_dim, dtype=dtype, device=device).normal_()
    v = torch.empty(num_slots, kv_heads, head_dim, dtype=dtype, device=device).normal_()
    q = torch.randn(bs, q_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, k, v, kv_indptr, kv_indices


@dataclass
class Setup:
    """What every configuration of one run shares: the device, the timer, the
    measured copy bandwidth, the baselines and the kernel under test."""

    torch: Any
    args: argparse.Namespace
    timer: Any
    device: str
    dtype: Any
    copy_gbps: float
    baselines: dict
    Wrapper: Any
    reference: Any


def bench_one(setup: Setup, model: str, page_size: int, bs: int, ctx: int) -> Row:
    torch, args, device, dtype, reference = setup.torch, setup.args, setup.device, setup.dtype, setup.reference
    q_heads, kv_heads, head_dim = MODELS[model]
    q, k, v, indptr, indices = build_batch(torch, bs, ctx, page_size, q_heads, kv_heads, head_dim, dtype, device)
    max_pages = math.ceil(ctx / page_size)
    wrapper = setup.Wrapper(
        bs,
        q_heads,
        kv_heads,
        head_dim,
        max_pages=max_pages,
        page_size=page_size,
        max_splits=args.max_splits,
        dtype=dtype,
        device=device,
    )
    num_splits = args.num_splits or wrapper.num_splits_for(bs)

    def step(importance):
        return lambda: wrapper.run(q, k, v, indptr, indices, num_splits=num_splits, importance=importance)

    fns = {"on": step(True), "off": step(False)}
    for name, make in setup.baselines.items():
        try:
            fns[name] = make(torch, q, k, v, indptr, indices, page_size, num_splits, args.max_splits)
        except Exception as exc:  # a baseline's API drifted: report, keep going
            print(f"  baseline {name} unavailable for this config: {exc!r}")

    use_graph = device == "cuda" and not args.no_cuda_graph
    if use_graph:
        fns = {name: as_graph(torch, fn) for name, fn in fns.items()}
    times = setup.timer.interleaved(fns, args.warmup, args.iters)

    max_rel_err = None
    if bs * ctx <= 8 * 4096:  # cheap enough to check against the torch reference
        got = wrapper.run(q, k, v, indptr, indices, num_splits=num_splits)
        ref = reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
        err_out = ((got.output.float() - ref.output).norm() / ref.output.norm()).item()
        err_imp = (got.importance - ref.importance).abs().max().item()
        max_rel_err = max(err_out, err_imp)

    kv_bytes = bs * ctx * kv_heads * head_dim * 2 * dtype.itemsize
    on, off = times.pop("on"), times.pop("off")
    return Row(
        model=model,
        page_size=page_size,
        bs=bs,
        ctx=ctx,
        num_splits=num_splits,
        on_ms=on,
        off_ms=off,
        ratio=on / off,
        kv_bytes=kv_bytes,
        on_gbps=kv_bytes / on / 1e6,
        off_gbps=kv_bytes / off / 1e6,
        copy_gbps=setup.copy_gbps,
        baselines_ms=times,
        max_rel_err=max_rel_err,
    )


@dataclass
class SweepRow:
    """One (shape, tile shape, split count): importance on/off and SGLang at that count."""

    model: str
    page_size: int
    bs: int
    ctx: int
    tiles: str
    policies: str  # the split rules that gave this count, '/'-joined
    num_splits: int
    on_ms: float
    off_ms: float
    sglang_ms: float | None
    kv_bytes: int
    copy_gbps: float
    max_rel_err: float | None = None

    @property
    def on_pct_copy(self) -> float:
        return 100 * self.kv_bytes / self.on_ms / 1e6 / self.copy_gbps


def sweep(setup: Setup) -> None:
    """Every tile shape x split rule on every shape; writes sweep.md and sweep.json."""
    from sgl_kernel_ext.plan import SPLIT_POLICIES, TILE_CANDIDATES

    torch, args = setup.torch, setup.args
    tile_names = list(TILE_CANDIDATES) if args.sweep_tiles == "all" else args.sweep_tiles.split(",")
    policies = list(SPLIT_POLICIES) if args.sweep_splits == "all" else args.sweep_splits.split(",")
    unknown = [n for n in tile_names if n not in TILE_CANDIDATES] + [p for p in policies if p not in SPLIT_POLICIES]
    if unknown:
        sys.exit(f"unknown tiles/split rules {unknown}; tiles: {list(TILE_CANDIDATES)}, rules: {list(SPLIT_POLICIES)}")
    rows: list[SweepRow] = []
    for model in args.models.split(","):
        q_heads, kv_heads, head_dim = MODELS[model]
        for page_size in map(int, args.page_sizes.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                for bs in map(int, args.bs.split(",")):
                    # one wrapper per tile shape: a little more than estimate_bytes' workspace
                    need = estimate_bytes(bs, ctx, page_size, q_heads, kv_heads, head_dim, setup.dtype.itemsize)
                    need += len(tile_names) * bs * q_heads * math.ceil(ctx / page_size) * 4
                    if setup.device == "cuda":
                        free, _ = torch.cuda.mem_get_info()
                        if need > args.mem_fraction * free:
                            print(f"skip {model} P={page_size} bs={bs} ctx={ctx}: needs {need / 2**30:.1f} GiB")
                            continue
                    got = sweep_one(setup, model, page_size, bs, ctx, tile_names, policies)
                    rows += got
                    for r in got:
                        print(format_sweep_row(r))
                    if setup.device == "cuda":
                        torch.cuda.empty_cache()
    meta = run_meta(torch, setup.device, args, dtype=args.dtype, copy_gbps=setup.copy_gbps)
    table = sweep_table(rows, meta)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.md").write_text(table)
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    print()
    print(table)
    print(f"wrote {out}/sweep.md, sweep.json")


def sweep_one(setup: Setup, model, page_size, bs, ctx, tile_names, policies) -> list[SweepRow]:
    from sgl_kernel_ext.plan import TILE_CANDIDATES, default_num_splits

    torch, args, device, dtype = setup.torch, setup.args, setup.device, setup.dtype
    q_heads, kv_heads, head_dim = MODELS[model]
    q, k, v, indptr, indices = build_batch(torch, bs, ctx, page_size, q_heads, kv_heads, head_dim, dtype, device)
    max_pages = math.ceil(ctx / page_size)
    candidates = {}  # (tiles, splits) -> [wrapper, policies]
    for name in tile_names:
        wrapper = setup.Wrapper(
            bs,
            q_heads,
            kv_heads,
            head_dim,
            max_pages=max_pages,
            page_size=page_size,
            max_splits=args.max_splits,
            dtype=dtype,
            device=device,
            tiles=TILE_CANDIDATES[name],
        )
        for policy in policies:
            splits = default_num_splits(bs, kv_heads, wrapper.geometry, args.max_splits, device, policy)
            candidates.setdefault((name, splits), [wrapper, []])[1].append(policy)

    def step(wrapper, splits, importance):
        return lambda: wrapper.run(q, k, v, indptr, indices, num_splits=splits, importance=importance)

    fns = {}
    for (name, splits), (wrapper, _) in candidates.items():
        fns[f"{name}/{splits}/on"] = step(wrapper, splits, True)
        fns[f"{name}/{splits}/off"] = step(wrapper, splits, False)
    make_sglang = setup.baselines.get("sglang_triton")
    if make_sglang is not None:
        for splits in sorted({s for _, s in candidates}):
            try:
                sglang = make_sglang(torch, q, k, v, indptr, indices, page_size, splits, args.max_splits)
                fns[f"sglang/{splits}"] = sglang
            except Exception as exc:  # its API drifted: report, keep going
                print(f"  sglang_triton unavailable for this config: {exc!r}")
                break
    if device == "cuda" and not args.no_cuda_graph:
        fns = {name: as_graph(torch, fn) for name, fn in fns.items()}
    times = setup.timer.interleaved(fns, args.warmup, args.iters)

    ref = None
    if bs * ctx <= 8 * 4096:
        ref = setup.reference(q, k, v, indptr, indices, page_size=page_size, max_pages=max_pages)
    kv_bytes = bs * ctx * kv_heads * head_dim * 2 * dtype.itemsize
    rows = []
    for (name, splits), (wrapper, used) in candidates.items():
        err = None
        if ref is not None:
            got = wrapper.run(q, k, v, indptr, indices, num_splits=splits)
            err_out = ((got.output.float() - ref.output).norm() / ref.output.norm()).item()
            err = max(err_out, (got.importance - ref.importance).abs().max().item())
        rows.append(
            SweepRow(
                model=model,
                page_size=page_size,
                bs=bs,
                ctx=ctx,
                tiles=name,
                policies="/".join(used),
                num_splits=splits,
                on_ms=times[f"{name}/{splits}/on"],
                off_ms=times[f"{name}/{splits}/off"],
                sglang_ms=times.get(f"sglang/{splits}"),
                kv_bytes=kv_bytes,
                copy_gbps=setup.copy_gbps,
                max_rel_err=err,
            )
        )
    return rows


def format_sweep_row(r: SweepRow) -> str:
    sgl = f" sglang={r.sglang_ms:.4f}ms on/sglang={r.on_ms / r.sglang_ms:.3f}" if r.sglang_ms else ""
    err = f" err={r.max_rel_err:.1e}" if r.max_rel_err is not None else ""
    return (
        f"{r.model:8s} P={r.page_size:<3d} bs={r.bs:<3d} ctx={r.ctx:<7d} {r.tiles:8s} splits={r.num_splits:<3d} "
        f"({r.policies}) on={r.on_ms:.4f}ms off={r.off_ms:.4f}ms on/off={r.on_ms / r.off_ms:.3f} "
        f"on={r.on_pct_copy:.1f}%copy{sgl}{err}"
    )


def sweep_table(rows: list[SweepRow], meta: dict) -> str:
    """Every row, then one line per (tiles, split rule) against the three targets."""
    head = ["model", "page", "bs", "ctx", "tiles", "split rules", "splits", "on ms", "off ms", "on/off"]
    head += ["on % of copy", "sglang ms", "on/sglang", "off/sglang", "max err"]
    lines = [
        f"Tile sweep, decode with importance — {meta['device']}, {meta['dtype']}, triton {meta['triton']}, "
        f"CUDA graph: {meta['cuda_graph']}, copy bandwidth {meta['copy_gbps']:.0f} GB/s"
        + (" (SMOKE: timings meaningless)" if meta["smoke"] else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    ratio = lambda a, b: f"{a / b:.3f}" if b else "-"  # noqa: E731
    for r in rows:
        cells = [r.model, r.page_size, r.bs, r.ctx, r.tiles, r.policies, r.num_splits, f"{r.on_ms:.4f}"]
        cells += [f"{r.off_ms:.4f}", ratio(r.on_ms, r.off_ms), f"{r.on_pct_copy:.1f}%"]
        cells += [f"{r.sglang_ms:.4f}" if r.sglang_ms else "-"]
        cells += [ratio(r.on_ms, r.sglang_ms), ratio(r.off_ms, r.sglang_ms)]
        cells += [f"{r.max_rel_err:.1e}" if r.max_rel_err is not None else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")

    # per (tiles, rule): the worst case of each target over the shapes it ran
    lines += [
        "",
        "Per tile shape and split rule, worst over the shapes (targets: on/off <= 1.03; on >= 80 % of copy at "
        "bs 32 x 32K; on and off <= SGLang at the same split count):",
        "",
        "| tiles | split rule | worst on/off | on % of copy, bs 32 x 32K | worst on/sglang | worst off/sglang "
        "| geomean on/sglang | worst on/best sglang | targets met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    # SGLang at its fastest of the split counts swept for the shape: the fairer peer
    best_sglang: dict[tuple, float] = {}
    for r in rows:
        key = (r.model, r.page_size, r.bs, r.ctx)
        if r.sglang_ms:
            best_sglang[key] = min(best_sglang.get(key, math.inf), r.sglang_ms)
    by_rule: dict[tuple[str, str], list[SweepRow]] = {}
    for r in rows:
        for policy in r.policies.split("/"):
            by_rule.setdefault((r.tiles, policy), []).append(r)
    for (tiles, policy), rs in by_rule.items():
        worst_ratio = max(r.on_ms / r.off_ms for r in rs)
        big = [r.on_pct_copy for r in rs if r.bs == 32 and r.ctx == 32768]
        vs = [(r.on_ms / r.sglang_ms, r.off_ms / r.sglang_ms) for r in rs if r.sglang_ms]
        worst_on = max((a for a, _ in vs), default=None)
        worst_off = max((b for _, b in vs), default=None)
        geo = math.exp(sum(math.log(a) for a, _ in vs) / len(vs)) if vs else None
        vs_best = [r.on_ms / best_sglang[(r.model, r.page_size, r.bs, r.ctx)] for r in rs if r.sglang_ms]
        worst_best = max(vs_best, default=None)
        met = [worst_ratio <= 1.03, bool(big) and min(big) >= 80.0, worst_on is not None and worst_on <= 1.0]
        cells = [tiles, policy, f"{worst_ratio:.3f}", f"{min(big):.1f}%" if big else "-"]
        cells += [f"{x:.3f}" if x is not None else "-" for x in (worst_on, worst_off, geo, worst_best)]
        cells += [f"{sum(met)}/3"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def as_graph(torch, fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and settle allocations outside capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class CudaTimer:
    """Median of per-iteration CUDA-event times, L2 flushed before each iteration,
    candidates interleaved so clock drift hits them alike."""

    def __init__(self, torch):
        self.torch = torch
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def interleaved(self, fns, warmup, iters):
        torch = self.torch
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        samples = {name: [] for name in fns}
        names = list(fns)
        for i in range(iters):
            for name in names[i % 2 :: 1] + names[: i % 2]:  # alternate who goes first
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                samples[name].append((start, end))
        torch.cuda.synchronize()
        return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in samples.items()}


class CpuTimer:
    def interleaved(self, fns, warmup, iters):
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        samples = {name: [] for name in fns}
        for _ in range(iters):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
        return {name: statistics.median(s) for name, s in samples.items()}


def measure_copy_bandwidth(torch, device, timer):
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    nbytes = (1 << 30) if device == "cuda" else (16 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer.interleaved({"copy": lambda: dst.copy_(src)}, 3, 10 if device == "cuda" else 3)["copy"]
    return 2 * nbytes / ms / 1e6


def load_baselines():
    """name -> factory(torch, q, k, v, indptr, indices, page_size, num_splits, max_splits) -> callable."""
    found = {}
    stock = None
    for module in (
        "sglang.srt.layers.attention.triton_ops.decode_attention",
        "sglang.kernels.ops.attention.decode_attention",
    ):
        try:
            stock = __import__(module, fromlist=["decode_attention_fwd"]).decode_attention_fwd
            break
        except Exception:
            continue
    if stock is not None:

        def make_sglang(torch, q, k, v, indptr, indices, page_size, num_splits, max_splits):
            bs, heads, _ = q.shape
            o = torch.empty(bs, heads, v.shape[2], dtype=q.dtype, device=q.device)
            logits = torch.empty(bs, heads, max_splits, v.shape[2], dtype=torch.float32, device=q.device)
            lse = torch.empty(bs, heads, max_splits, dtype=torch.float32, device=q.device)
            splits = torch.full((bs,), num_splits, dtype=torch.int32, device=q.device)
            scale = 1.0 / math.sqrt(q.shape[2])
            # slot-addressed reads (its default page_size=1) touch exactly the same bytes
            return lambda: stock(q, k, v, o, indptr, indices, logits, lse, splits, max_splits, scale, 1.0, 1.0)

        found["sglang_triton"] = make_sglang
    try:
        import flashinfer

        def make_flashinfer(torch, q, k, v, indptr, indices, page_size, num_splits, max_splits):
            bs, heads, dim = q.shape
            kv_heads = k.shape[1]
            page_ids = (indices[::page_size] // page_size).to(torch.int32)  # whole pages in the bench
            pages_per_req = indptr[1:2].item() // page_size
            page_indptr = torch.arange(bs + 1, dtype=torch.int32, device=q.device) * pages_per_req
            last = torch.full((bs,), page_size, dtype=torch.int32, device=q.device)
            ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            wrapper.plan(
                page_indptr, page_ids, last, heads, kv_heads, dim, page_size, q_data_type=q.dtype, kv_data_type=k.dtype
            )
            kc = k.view(-1, page_size, kv_heads, dim)
            vc = v.view(-1, page_size, kv_heads, v.shape[2])
            return lambda: wrapper.run(q, (kc, vc))

        found["flashinfer"] = make_flashinfer
    except Exception:
        pass
    return found


def format_row(r: Row) -> str:
    extra = " ".join(f"{k}={v:.3f}ms" for k, v in r.baselines_ms.items())
    err = f" err={r.max_rel_err:.1e}" if r.max_rel_err is not None else ""
    return (
        f"{r.model:8s} P={r.page_size:<3d} bs={r.bs:<3d} ctx={r.ctx:<7d} splits={r.num_splits:<3d} "
        f"on={r.on_ms:.3f}ms off={r.off_ms:.3f}ms ratio={r.ratio:.3f} {extra}{err}"
    )


def markdown_table(rows, meta):
    names = sorted({k for r in rows for k in r.baselines_ms})
    head = (
        ["model", "page", "bs", "ctx", "splits", "on ms", "off ms", "on/off", "on GB/s", "off GB/s", "on % of copy"]
        + [f"{n} ms" for n in names]
        + ["max err"]
    )
    lines = [
        f"Decode attention with importance — {meta['device']}, {meta['dtype']}, "
        f"CUDA graph: {meta['cuda_graph']}, copy bandwidth {meta['copy_gbps']:.0f} GB/s"
        + (" (SMOKE: timings meaningless)" if meta["smoke"] else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [
            r.model,
            r.page_size,
            r.bs,
            r.ctx,
            r.num_splits,
            f"{r.on_ms:.4f}",
            f"{r.off_ms:.4f}",
            f"{r.ratio:.3f}",
            f"{r.on_gbps:.4g}",
            f"{r.off_gbps:.4g}",
            f"{100 * r.on_gbps / r.copy_gbps:.1f}%",
        ]
        cells += [f"{r.baselines_ms[n]:.4f}" if n in r.baselines_ms else "-" for n in names]
        cells += [f"{r.max_rel_err:.1e}" if r.max_rel_err is not None else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [
        f"{r.model}\nP{r.page_size} bs{r.bs}\n{r.ctx // 1024 if r.ctx >= 1024 else r.ctx}{'K' if r.ctx >= 1024 else ''}"
        for r in rows
    ]
    x = range(len(rows))
    ax1.bar(x, [100 * (r.ratio - 1) for r in rows], color=["tab:red" if r.ratio > 1.05 else "tab:blue" for r in rows])
    ax1.axhline(5, color="gray", linestyle="--", linewidth=1, label="5% budget")
    ax1.set_ylabel("importance-on overhead vs off (%)")
    ax1.set_xticks(list(x), labels, fontsize=6)
    ax1.legend()
    width = 0.4
    ax2.bar([i - width / 2 for i in x], [r.off_gbps for r in rows], width, label="off")
    ax2.bar([i + width / 2 for i in x], [r.on_gbps for r in rows], width, label="on")
    ax2.axhline(meta["copy_gbps"], color="gray", linestyle="--", linewidth=1, label="D2D copy")
    ax2.set_ylabel("K+V read bandwidth (GB/s)")
    ax2.set_xticks(list(x), labels, fontsize=6)
    ax2.legend()
    fig.suptitle(f"decode with importance — {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
