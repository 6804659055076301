"""``--hot-set-plan-ahead``: the README's hot-set server with each step ended where it ran and a step late.

Issue 47: ending a step a step late lets a GPU's host plan the next step while the device
replays the current one. On a CPU nothing overlaps (a step is synchronous), so this measures
what the flag costs and changes, not what it buys: per mode, one server (the README's hot-set
line, ``importance_torch``, the host pool, ``--hot-set-threshold`` low enough that every
request is a hot-set one; ``dense``: the same server without the hot set) and the same
concurrent greedy requests (``ignore_eos``); the hot set's counters from ``/metrics`` (pages
attended, read from the host, released, promoted, decode steps counted), wall time and the
greedy outputs against the first mode's (dense's by default).

    python -m benchmark.long_context.bench_plan_ahead --out /tmp/plan_ahead

(~3 min on 2 CPU cores.) A table (``RESULTS.md``), ``results.json`` and a plot
(``plan_ahead.png``) go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmark.long_context.bench_hot_set import PAGE, essay_text
from sgl_importance.client import generate, greedy, metrics_text
from sgl_importance.local_server import LocalServer, metric, model_path

COUNTERS = ("steps", "pages_attended", "pages_dense", "pages_read_from_host", "pages_released", "pages_copied_in")


def server_args(a: argparse.Namespace, mode: str) -> list[str]:
    """The README's hot-set line at this benchmark's sizes, the flag set to ``mode``
    (``dense``: the same server without the hot set, every page read)."""
    return [
        "--page-size", str(PAGE), "--radix-eviction-policy", "importance",
        "--attention-backend", "importance_torch", "--enable-hierarchical-cache",
        "--hot-set-policy", "off" if mode == "dense" else "importance", "--hot-set-budget", "0.2",
        "--enable-metrics", "--hot-set-threshold", str(a.threshold), "--max-total-tokens", str(a.device_tokens),
        "--dtype", a.dtype, *(["--hot-set-plan-ahead", mode] if mode != "dense" else []),
    ]  # fmt: skip


def run_mode(mode: str, prompts: list[list[int]], a: argparse.Namespace) -> dict:
    """One server with ``--hot-set-plan-ahead mode``; every prompt sent at once."""
    server = LocalServer(model_path(), server_args(a, mode), a.out / f"server_{mode}.log")
    try:
        server.wait_ready()
        sampling = greedy(a.max_new, ignore_eos=True)
        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda ids: generate(server.url, input_ids=ids, sampling_params=sampling), prompts))
        wall = time.perf_counter() - started
        scrape = metrics_text(server.url)
    finally:
        server.stop()
    row = {"mode": mode, "wall_s": wall, "outputs": [r["output_ids"] for r in answers]}
    row.update({name: metric(scrape, f"sgl_importance:hot_set_{name}_total") for name in COUNTERS})
    return row


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def write_results(rows: list[dict], a: argparse.Namespace, out: Path) -> str:
    base = rows[0]
    lines = [
        f"| --hot-set-plan-ahead | wall s | {' | '.join(COUNTERS)} | greedy outputs = {base['mode']}'s "
        "| tokens before the first difference, min / median |",
        "|---" * (4 + len(COUNTERS)) + "|",
    ]
    for r in rows:
        same = sum(x == y for x, y in zip(r["outputs"], base["outputs"]))
        first = [first_difference(x, y) for x, y in zip(r["outputs"], base["outputs"])]
        cells = [r["mode"], f"{r['wall_s']:.1f}", *(f"{r[name]:.0f}" for name in COUNTERS)]
        cells += [f"{same}/{len(base['outputs'])}", f"{min(first)} / {statistics.median(first):g}"]
        lines.append("| " + " | ".join(cells) + " |")
    command = "python -m benchmark.long_context.bench_plan_ahead " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    text = (
        "# Steps ended where they ran and a step late (bench_plan_ahead.py)\n\n"
        f"```\n{command}\n```\n\n{len(base['outputs'])} requests of {a.length} tokens at once, {a.max_new} new tokens "
        f"each (greedy, ignore_eos), --max-total-tokens {a.device_tokens}, --dtype {a.dtype}, "
        f"--hot-set-threshold {a.threshold}.\n\n" + "\n".join(lines) + "\n"
    )
    (out / "RESULTS.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    names = [r["mode"] for r in rows]
    for ax, key, label in zip(
        axes,
        ("pages_attended", "pages_read_from_host", "wall_s"),
        ("pages attended (over layers)", "pages read from the host", "wall s"),
    ):
        ax.bar(names, [r[key] for r in rows])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("--hot-set-plan-ahead")
    fig.tight_layout()
    fig.savefig(out / "plan_ahead.png", dpi=120)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--modes", default="dense,off,on", help="--hot-set-plan-ahead values or dense, a server each (the first: base)"
    )
    p.add_argument("--requests", type=int, default=6, help="sent at once")
    p.add_argument("--length", type=int, default=1600, help="prompt tokens")
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--threshold", type=int, default=512, help="--hot-set-threshold")
    p.add_argument("--device-tokens", type=int, default=16384, help="--max-total-tokens")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench_plan_ahead_")))
    a = p.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"on", "off", "dense"}:
        p.error("--modes: from dense, off, on")
    a.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    filler = AutoTokenizer.from_pretrained(model_path())(essay_text(), add_special_tokens=False)["input_ids"]
    stride = (len(filler) - a.length) // a.requests
    prompts = [filler[i * stride : i * stride + a.length] for i in range(a.requests)]
    print(write_results([run_mode(mode, prompts, a) for mode in modes], a, a.out))


if __name__ == "__main__":
    main()
