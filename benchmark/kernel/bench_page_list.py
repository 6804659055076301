"""One hot-set decode step on a GPU vs dense: the same kernel over a selected page list.

For every (model, bs, context, budget) it times, for one layer:

- ``dense``: ``DecodeImportanceWrapper.run`` over every page of every request;
- ``select``: the hot set's per-step selection on the device: key min/max bounds of
  every page (``hot_set.guard.key_ranges.key_bound``, batched), the top pages by bound mass
  (the ``quest`` policy's ranking, the costliest of the policies: ``importance``
  ranks resident pages by a stored value), sinks and window added, the page list
  built as slot indices;
- ``attend``: the same kernel over the selected pages only;
- ``hot set`` = select + attend, and its ratio to dense.

It also reports the host->device promotion traffic a step may cause: at most
``SWAP_FRACTION`` of the budget's free pages per request and step (what the
selection allows), across all ``--layers`` layers, in bytes and as time at a measured
pinned host->device copy bandwidth. Writes results.md, results.json and
results_page_list.png into --out. See README.md beside this file.

    python -m benchmark.kernel.bench_page_list --out /tmp/bench-page-list          # GPU
    python -m benchmark.kernel.bench_page_list --smoke --out /tmp/page-list-smoke  # CPU, interpreter

Run from the repository root; where nothing is installed (a bare GPU machine), put
both packages on the path: ``PYTHONPATH=sgl-kernel-ext:python python -m ...``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmark.kernel.bench_decode import MODELS, CpuTimer, CudaTimer, as_graph, build_batch, run_meta, write_outputs

REPO = Path(__file__).resolve().parents[2]

SINKS, WINDOW = 1, 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmark" / "kernel" / "results_page_list")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--models", default="llama8b")
    p.add_argument("--bs", default="1,4,16,32")
    p.add_argument("--ctx", default="32768,131072")
    p.add_argument("--budgets", default="0.1,0.2,0.3")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=32, help="layers a promoted page is copied for (Llama-8B: 32)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--max-splits", type=int, default=32)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--mem-fraction", type=float, default=0.8)
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.bs, args.ctx, args.budgets = "smollm2", "1,2", "160,320", "0.2,0.5"
        args.warmup, args.iters = 1, 2
    return args


@dataclass
class Row:
    model: str
    bs: int
    ctx: int
    budget: float
    pages: int
    selected: int
    dense_ms: float
    select_ms: float
    attend_ms: float
    hot_ms: float
    ratio: float
    promote_bytes: int
    promote_ms: float
    max_err: float | None


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import
    import torch

    from sgl_importance.hot_set.guard.key_ranges import key_bound
    from sgl_importance.hot_set.plan.selection import SWAP_FRACTION
    from sgl_kernel_ext import DecodeImportanceWrapper, decode_importance_reference

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke to validate the script on CPU")
    dtype = torch.bfloat16
    timer = CudaTimer(torch) if device == "cuda" else CpuTimer()
    h2d_gbps = measure_h2d(torch, device)
    print(f"host->device copy: {h2d_gbps:.1f} GB/s")
    rows = []
    for model in args.models.split(","):
        q_heads, kv_heads, head_dim = MODELS[model]
        for ctx in map(int, args.ctx.split(",")):
            for bs in map(int, args.bs.split(",")):
                ps = args.page_size
                pages = math.ceil(ctx / ps)
                need = 2 * (bs * pages + 1) * ps * kv_heads * head_dim * dtype.itemsize
                need += 2 * bs * pages * kv_heads * head_dim * 4 + (512 << 20)
                if device == "cuda" and need > args.mem_fraction * torch.cuda.mem_get_info()[0]:
                    print(f"skip {model} bs={bs} ctx={ctx}: needs {need / 2**30:.1f} GiB")
                    continue
                q, k, v, indptr, indices = build_batch(torch, bs, ctx, ps, q_heads, kv_heads, head_dim, dtype, device)
                # Key ranges of every request's pages (what the hot set keeps per full page).
                key_min = k.new_empty(bs, pages, kv_heads, head_dim)
                key_max = torch.empty_like(key_min)
                for b in range(bs):  # one request at a time: a gathered copy of all keys may not fit
                    keys = k[indices[b * ctx : (b + 1) * ctx]].view(pages, ps, kv_heads, head_dim)
                    key_min[b], key_max[b] = keys.amin(1), keys.amax(1)
                page_slot0 = indices.view(bs, pages, ps)[:, :, 0]
                wrapper = DecodeImportanceWrapper(
                    bs, q_heads, kv_heads, head_dim, max_pages=pages, page_size=ps,
                    max_splits=args.max_splits, dtype=dtype, device=device,
                )  # fmt: skip
                for budget in map(float, args.budgets.split(",")):
                    rows.append(
                        bench_one(
                            torch,
                            args,
                            timer,
                            device,
                            model,
                            bs,
                            ctx,
                            budget,
                            q,
                            k,
                            v,
                            indptr,
                            indices,
                            key_min,
                            key_max,
                            page_slot0,
                            wrapper,
                            key_bound,
                            decode_importance_reference,
                            SWAP_FRACTION,
                            h2d_gbps,
                        )  # fmt: skip
                    )
                    print(format_row(rows[-1]), flush=True)
                del q, k, v, key_min, key_max
                if device == "cuda":
                    torch.cuda.empty_cache()
    meta = run_meta(torch, device, args, dtype="bf16", h2d_gbps=h2d_gbps)
    write_outputs(args.out, rows, meta, markdown_table(rows, meta), plot, "results_page_list.png")


def bench_one(torch, args, timer, device, model, bs, ctx, budget, q, k, v, indptr, indices, key_min, key_max,
              page_slot0, wrapper, key_bound, reference, swap_fraction, h2d_gbps) -> Row:  # fmt: skip
    ps = args.page_size
    pages = key_min.shape[1]
    selected = max(SINKS + WINDOW, math.ceil(budget * pages))
    free = max(0, selected - SINKS - WINDOW)
    scale = 1.0 / math.sqrt(q.shape[2])
    arange_ps = torch.arange(ps, device=device)
    middle = torch.arange(SINKS, pages - WINDOW, device=device)
    fixed = torch.cat((torch.arange(SINKS, device=device), torch.arange(pages - WINDOW, pages, device=device)))
    sel_indptr = torch.arange(bs + 1, dtype=torch.int32, device=device) * (selected * ps)
    sel_indices = torch.empty(bs * selected * ps, dtype=indices.dtype, device=device)

    def select():
        # Bound mass ranking of every page, per request (largest over query heads).
        bounds = key_bound(q, key_min, key_max, sm_scale=scale).amax(-1)  # [bs, pages]
        top = bounds[:, middle].topk(free, dim=1).indices + SINKS if free else middle[:0].expand(bs, 0)
        chosen = torch.sort(torch.cat((fixed.expand(bs, -1), top), dim=1), dim=1).values
        slots = page_slot0.gather(1, chosen)[:, :, None] + arange_ps
        sel_indices.copy_(slots.reshape(-1))

    def attend():
        return wrapper.run(q, k, v, sel_indptr, sel_indices)

    def dense():
        return wrapper.run(q, k, v, indptr, indices)

    fns = {"dense": dense, "select": select, "attend": attend, "hot": lambda: (select(), attend())}
    if device == "cuda" and not args.no_cuda_graph:
        fns = {name: as_graph(torch, fn) for name, fn in fns.items()}
    times = timer.interleaved(fns, args.warmup, args.iters)

    max_err = None
    if bs * ctx <= 8 * 4096:  # the selected list against the torch reference over it
        select()
        got = wrapper.run(q, k, v, sel_indptr, sel_indices)
        ref = reference(q, k, v, sel_indptr, sel_indices, page_size=ps, max_pages=wrapper.max_pages)
        err_out = ((got.output.float() - ref.output).norm() / ref.output.norm()).item()
        err_imp = (got.importance[:, :selected] - ref.importance[:, :selected]).abs().max().item()
        max_err = max(err_out, err_imp)
    kv_heads, head_dim = k.shape[1], k.shape[2]
    swaps = max(1, int(free * swap_fraction)) if free else 0
    promote_bytes = bs * swaps * ps * kv_heads * head_dim * 2 * k.element_size() * args.layers
    return Row(
        model=model,
        bs=bs,
        ctx=ctx,
        budget=budget,
        pages=pages,
        selected=selected,
        dense_ms=times["dense"],
        select_ms=times["select"],
        attend_ms=times["attend"],
        hot_ms=times["hot"],
        ratio=times["hot"] / times["dense"],
        promote_bytes=promote_bytes,
        promote_ms=promote_bytes / h2d_gbps / 1e6,
        max_err=max_err,
    )


def measure_h2d(torch, device) -> float:
    """GB/s of a pinned host->device copy (a CPU memcpy under --smoke)."""
    nbytes = (256 << 20) if device == "cuda" else (16 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def format_row(r: Row) -> str:
    err = f" err={r.max_err:.1e}" if r.max_err is not None else ""
    return (
        f"{r.model:8s} bs={r.bs:<3d} ctx={r.ctx:<7d} budget={r.budget:.0%} pages={r.selected}/{r.pages} "
        f"dense={r.dense_ms:.3f}ms select={r.select_ms:.3f}ms attend={r.attend_ms:.3f}ms "
        f"hot={r.hot_ms:.3f}ms ratio={r.ratio:.2f} promote={r.promote_bytes / 2**20:.1f}MiB{err}"
    )


def markdown_table(rows, meta) -> str:
    lines = [
        f"Hot-set decode step vs dense, one layer — {meta['device']}, bf16, CUDA graph: {meta['cuda_graph']}, "
        f"host->device {meta['h2d_gbps']:.1f} GB/s" + (" (SMOKE: timings meaningless)" if meta["smoke"] else ""),
        "",
        "| model | bs | ctx | budget | pages attended | dense ms | select ms | attend ms | hot set ms "
        "| hot / dense | promotion MiB / step (all layers) | promotion ms at H2D | max err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = f"{r.max_err:.1e}" if r.max_err is not None else "-"
        lines.append(
            f"| {r.model} | {r.bs} | {r.ctx} | {r.budget:.0%} | {r.selected}/{r.pages} | {r.dense_ms:.4f} "
            f"| {r.select_ms:.4f} | {r.attend_ms:.4f} | {r.hot_ms:.4f} | {r.ratio:.2f} "
            f"| {r.promote_bytes / 2**20:.1f} | {r.promote_ms:.3f} | {err} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, meta, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for model, ctx, budget in sorted({(r.model, r.ctx, r.budget) for r in rows}):
        pts = sorted((r.bs, r.ratio) for r in rows if (r.model, r.ctx, r.budget) == (model, ctx, budget))
        ax.plot([b for b, _ in pts], [y for _, y in pts], marker="o", label=f"{model} {ctx // 1024}K {budget:.0%}")
    ax.axhline(0.5, color="k", ls="--", lw=1, label="target 0.5")
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("hot-set step / dense step (one layer)")
    ax.set_title(meta["device"] + (" — SMOKE" if meta["smoke"] else ""))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
