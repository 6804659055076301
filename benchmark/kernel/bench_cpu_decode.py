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

Times are this thread's CPU time (run it with ``OMP_NUM_THREADS=1``: the kernel then runs
on the calling thread), so a machine shared with other work does not count against it;
each ratio is the median over rounds of the two ways' times in that round (a round takes
the three ways in turn, a few milliseconds each).

Shapes: SmolLM2-135M's layer (9 query / 3 KV heads, head dim 64), SGLang's default page
of 1 token and the 16 the tiering features use, float32 and bfloat16 pools, contexts and
batches of the serving benchmark. Prints a table and writes results.json and a plot
into ``--out``.

    OMP_NUM_THREADS=1 python -m benchmark.kernel.bench_cpu_decode --out /tmp/bench_cpu_decode
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sgl_kernel_ext import PagedDecodeWorkspace, native, plan_from_slots
from sgl_kernel_ext.paged import _decode_native, _native_inputs  # the C path on a build of our choosing

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


def time_ways(calls: dict, rounds: int, sample_s: float = 0.005) -> dict[str, list[float]]:
    """CPU seconds per call of each way (this thread's: the kernel runs on it with one
    OpenMP thread, and time the machine gives other work is not counted), one sample per
    round (about ``sample_s`` of calls), the ways taken in turn within a round, starting
    from another one each round."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up: workspace, page faults
    start = time.thread_time()
    next(iter(calls.values()))()
    inner = max(1, int(sample_s / max(time.thread_time() - start, 1e-6)))
    names = list(calls)
    for r in range(rounds):
        # The order turns each round: a way never always follows the one that warmed the
        # cache with the same K and V.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = calls[name]
            start = time.thread_time()
            for _ in range(inner):
                fn()
            samples[name].append((time.thread_time() - start) / inner)
    return samples


def round_ratio(samples: dict[str, list[float]], way: str, base: str) -> float:
    """The median over rounds of ``way``'s time over ``base``'s in the same round."""
    return statistics.median(x / y for x, y in zip(samples[way], samples[base]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="64,1024,7600")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench_cpu_decode_")))
    a = ap.parse_args()
    full, bare = native.library(), native.library(NO_IMPORTANCE)
    if full is None or bare is None:
        raise SystemExit("the C decode kernel does not build here (see the warning above)")
    rows = []
    for dtype_name in a.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for page_size in (int(x) for x in a.page_sizes.split(",")):
            for context in (int(x) for x in a.contexts.split(",")):
                for bs in (int(x) for x in a.batches.split(",")):
                    case = batch(bs, context, page_size, dtype)
                    calls = {
                        "on": way(full, case, True),
                        "off": way(full, case, False),
                        "built without": way(bare, case, False),
                    }
                    samples = time_ways(calls, a.rounds)
                    row = {
                        "dtype": dtype_name,
                        "page_size": page_size,
                        "context": context,
                        "batch": bs,
                        **{f"{w}_us": statistics.median(samples[w]) * 1e6 for w in WAYS},
                        "off_vs_without": round_ratio(samples, "off", "built without"),
                        "on_vs_without": round_ratio(samples, "on", "built without"),
                        "load": os.getloadavg()[0],
                    }
                    rows.append(row)
                    print(
                        f"{dtype_name:>8} page {page_size:>2} ctx {context:>5} x{bs}: on {row['on_us']:8.1f} us, "
                        f"off {row['off_us']:8.1f}, built without {row['built without_us']:8.1f}; "
                        f"off/without {row['off_vs_without']:.3f}, on/without {row['on_vs_without']:.3f}",
                        flush=True,
                    )
    a.out.mkdir(parents=True, exist_ok=True)
    if torch.get_num_threads() != 1:
        print("warning: more than one torch thread: CPU time then misses the other threads' work", flush=True)
    meta = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "rounds": a.rounds}
    (a.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))
    plot(rows, a.out / "cpu_decode_importance.png")
    print(f"\n{a.out}/results.json, cpu_decode_importance.png")


def way(lib, case: tuple, importance: bool):
    """One way of decoding ``case`` (q, k, v, plan), with a plan and scratch of its own, as a
    server's step has: the kernel keeps its inputs on the plan from the first call on."""
    q, k, v, plan = case
    own = dataclasses.replace(plan, native_inputs=None)
    return functools.partial(native_decode, lib, q, k, v, own, PagedDecodeWorkspace(), importance)


def native_decode(lib, q, k, v, plan, ws, importance: bool):
    """``decode_importance_paged``'s C path on the build ``lib`` (the default one or another)."""
    inputs = _native_inputs(lib, q, k, v, None, None, plan, ws, importance)
    return _decode_native(lib, inputs, q, k, v, plan, q.shape[-1] ** -0.5, 0.0, None, None, None, importance)


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
