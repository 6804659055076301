"""The C linear layer (``sgl_kernel_ext.linear``) against torch's float32 matmul at a decode step's rows.

``make serve`` on torch_cpu runs SGLang's unquantized linear layers and its LM head through
the C kernel up to ``ROWS_MAX`` rows (``platform/cpu_forwards.py``); this times both ways on
a model's matmuls, one layer's worth after another over enough copies of the weights that
they come from memory, not cache, as in a real step (a 135M-parameter model's 540 MB in
float32 does not fit any cache). Ways interleave round by round, so a machine shared with
other work slows both alike; times are the calling thread's CPU time (run with
``OMP_NUM_THREADS=1``: the kernel and torch both run on it), each ratio the median over rounds.

Shapes: SmolLM2-135M (``make serve``'s model: hidden 576, fused QKV 960, gate-up 2 x 1,536,
LM head 49,152) and a Llama-3.1-8B layer (hidden 4,096, QKV 6,144, gate-up 2 x 14,336).
Prints a table; writes results.json and linear.png into ``--out``.

    OMP_NUM_THREADS=1 python -m benchmark.kernel.bench_linear --out /tmp/bench_linear
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sgl_kernel_ext import linear as c_linear
from sgl_kernel_ext.linear import ROWS_MAX, linear

# (model, matmul): (out features, in features)
SHAPES = {
    ("SmolLM2-135M", "qkv"): (960, 576),
    ("SmolLM2-135M", "o"): (576, 576),
    ("SmolLM2-135M", "gate_up"): (3072, 576),
    ("SmolLM2-135M", "down"): (576, 1536),
    ("SmolLM2-135M", "lm_head"): (49152, 576),
    ("Llama-3.1-8B", "qkv"): (6144, 4096),
    ("Llama-3.1-8B", "down"): (4096, 14336),
}
WAYS = ("torch", "C")


def weights(out_features: int, in_features: int, budget: int) -> list[torch.Tensor]:
    """Copies of one weight filling ``budget`` bytes (at least one): read in turn, none stays cached."""
    copies = max(1, budget // (out_features * in_features * 4))
    return [torch.randn(out_features, in_features) for _ in range(copies)]


def time_way(way: str, x: torch.Tensor, ws: list[torch.Tensor], out: torch.Tensor) -> float:
    """CPU seconds of one matmul, the mean over one pass over the copies."""
    start = time.thread_time()
    if way == "torch":
        for w in ws:
            F.linear(x, w)
    else:
        for w in ws:
            linear(x, w, out=out)
    return (time.thread_time() - start) / len(ws)


def measure(rows: list[int], rounds: int, budget: int) -> list[dict]:
    results = []
    for (model, name), (n, k) in SHAPES.items():
        ws = weights(n, k, budget)
        for m in rows:
            x, out = torch.randn(m, k), torch.empty(m, n)
            torch.testing.assert_close(linear(x, ws[0], out=out), F.linear(x, ws[0]), rtol=1e-4, atol=1e-3)
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for _ in range(rounds):
                for way in WAYS:
                    times[way].append(time_way(way, x, ws, out))
            ratios = [t / c for t, c in zip(times["torch"], times["C"])]
            row = {"model": model, "matmul": name, "out": n, "in": k, "rows": m}
            row.update({f"{w}_us": statistics.median(times[w]) * 1e6 for w in WAYS})
            row["torch_over_c"] = statistics.median(ratios)
            # Bytes: the weight once (float32) plus x and y; what a decode step reads.
            row["c_gb_s"] = (n * k + m * (n + k)) * 4 / (row["C_us"] * 1e-6) / 1e9
            results.append(row)
            print(
                f"{model:13s} {name:8s} {n:6d}x{k:<6d} rows {m:3d}: torch {row['torch_us']:9.1f} us, "
                f"C {row['C_us']:9.1f} us, torch / C {row['torch_over_c']:.2f}x, C {row['c_gb_s']:.1f} GB/s",
                flush=True,
            )
        del ws
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for model, name in SHAPES:
        mine = [r for r in results if r["model"] == model and r["matmul"] == name]
        ax.plot([r["rows"] for r in mine], [r["torch_over_c"] for r in mine], "o-", ms=4, label=f"{model} {name}")
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.axvline(ROWS_MAX, color="grey", ls=":", lw=1, label=f"ROWS_MAX = {ROWS_MAX}")
    ax.set_xlabel("rows (requests in a decode step)")
    ax.set_ylabel("torch time / C time")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32", help="rows of x (past ROWS_MAX: where torch takes over)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-mb", type=int, default=256, help="bytes of weight copies a shape cycles through")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench_linear_")))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = [int(r) for r in a.rows.split(",")]
    c_linear.ROWS_MAX = max(rows)  # past the serving cap too: where torch's GEMM takes over
    results = measure(rows, a.rounds, a.budget_mb << 20)
    meta = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {torch.get_num_threads()} torch threads",
        "rows_max": ROWS_MAX,
        "rounds": a.rounds,
    }
    (a.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, a.out / "linear.png")
    print(f"results.json and linear.png in {a.out}")


if __name__ == "__main__":
    main()
