"""The CPU decode kernel (``sgl_kernel_ext``'s C kernel) with importance on, off, and built without it.

What plain serving pays for page importance on the CPU: one layer's decode step over a
batch's page lists (``decode_importance_paged``), timed three ways in one run,
interleaved round by round so that a machine shared with other work slows all three
alike:

- ``on``: the kernel as the importance policy or the hot set runs it (page masses out);
- ``off``: ``importance=False``, as ``make serve`` runs it with nothing reading them;
- ``built without``: the same source compiled with ``-DSGL_PAGED_DECODE_NO_IMPORTANCE``,
  where the importance code is not there at all: the baseline ``off`` is held to
  (at most 1.03x its time).

Shapes: SmolLM2-135M's layer (9 query / 3 KV heads, head dim 64), SGLang's default page
of 1 token and the 16 the tiering features use, float32 and bfloat16 pools, contexts and
batches of the serving benchmark. Prints a table and writes results.json and a plot
into ``--out``.

    OMP_NUM_THREADS=1 python -m benchmark.kernel.bench_cpu_decode --out /tmp/bench_cpu_decode
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sgl_kernel_ext import PagedDecodeWorkspace, native, plan_from_slots
from sgl_kernel_ext.paged import _decode_native  # the C path on a build of our choosing

NO_IMPORTANCE = ("SGL_PAGED_DECODE_NO_IMPORTANCE",)
WAYS = ("on", "off", "built without")


def batch(bs: int, context: int, page_size: int, dtype: torch.dtype, seed: int = 0):
    """A pool holding ``bs`` requests of ``context`` tokens on shuffled pages, their query and plan."""
    gen = torch.Generator().manual_seed(seed)
    q_heads, kv_heads, dim = 9, 3, 64
    pages_each = -(-context // page_size)
    pages = 1 + bs * pages_each  # page 0 is SGLang's padding page
    k = torch.randn(pages * page_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pages * page_size, kv_heads, dim, generator=gen).to(dtype)
    order = 1 + torch.randperm(pages - 1, generator=gen)
    slots = (order.view(bs, pages_each, 1) * page_size + torch.arange(page_size)).view(bs, -1)
    plan = plan_from_slots(slots, torch.arange(bs), torch.full((bs,), context), page_size=page_size)
    q = torch.randn(bs, q_heads, dim, generator=gen).to(dtype)
    shape = (-1, page_size, kv_heads, dim)
    return q, k.view(shape), v.view(shape), plan


def time_ways(calls: dict, rounds: int, inner: int) -> dict[str, float]:
    """Median seconds of each call, timed round-robin (``inner`` calls a sample)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up: workspace, page faults
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="64,1024,7600")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench_cpu_decode_")))
    a = ap.parse_args()
    full, bare = native.library(), native.library(NO_IMPORTANCE)
    if full is None or bare is None:
        raise SystemExit("the C decode kernel does not build here (see the warning above)")
    rows = []
    ws = PagedDecodeWorkspace()
    for dtype_name in a.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for page_size in (int(x) for x in a.page_sizes.split(",")):
            for context in (int(x) for x in a.contexts.split(",")):
                for bs in (int(x) for x in a.batches.split(",")):
                    case = batch(bs, context, page_size, dtype)
                    calls = {
                        "on": functools.partial(native_decode, full, *case, ws, True),
                        "off": functools.partial(native_decode, full, *case, ws, False),
                        "built without": functools.partial(native_decode, bare, *case, ws, False),
                    }
                    inner = max(1, int(2e6 // (bs * context)))
                    t = time_ways(calls, a.rounds, inner)
                    row = {
                        "dtype": dtype_name,
                        "page_size": page_size,
                        "context": context,
                        "batch": bs,
                        **{f"{w}_us": t[w] * 1e6 for w in WAYS},
                        "off_vs_without": t["off"] / t["built without"],
                        "on_vs_without": t["on"] / t["built without"],
                    }
                    rows.append(row)
                    print(
                        f"{dtype_name:>8} page {page_size:>2} ctx {context:>5} x{bs}: on {row['on_us']:8.1f} us, "
                        f"off {row['off_us']:8.1f}, built without {row['built without_us']:8.1f}; "
                        f"off/without {row['off_vs_without']:.3f}, on/without {row['on_vs_without']:.3f}",
                        flush=True,
                    )
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "rounds": a.rounds}
    (a.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))
    plot(rows, a.out / "cpu_decode_importance.png")
    print(f"\n{a.out}/results.json, cpu_decode_importance.png")


def native_decode(lib, q, k, v, plan, ws, importance: bool):
    """``decode_importance_paged``'s C path on the build ``lib`` (the default one or another)."""
    return _decode_native(lib, q, k, v, plan, q.shape[-1] ** -0.5, 0.0, None, None, None, ws, importance)


def table(rows: list[dict]) -> str:
    lines = [
        "| dtype | page | context | batch | on, us | off, us | built without, us | off / without | on / without |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['page_size']} | {r['context']} | {r['batch']} | {r['on_us']:.1f} | "
            f"{r['off_us']:.1f} | {r['built without_us']:.1f} | {r['off_vs_without']:.3f} | {r['on_vs_without']:.3f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    labels = [f"{r['dtype'][:4]} p{r['page_size']} {r['context']}x{r['batch']}" for r in rows]
    xs = range(len(rows))
    ax.plot(xs, [r["off_vs_without"] for r in rows], "o", label="importance off / built without")
    ax.plot(xs, [r["on_vs_without"] for r in rows], "^", label="importance on / built without")
    ax.axhline(1.03, color="k", ls="--", lw=1, label="1.03")
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
    ax.set_ylabel("time / the build without importance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
