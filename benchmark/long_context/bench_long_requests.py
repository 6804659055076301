"""The longest request served against the device pool: the README's hot-set line on small pools,
with dense on a pool that holds every prompt beside it.

Each pool gets a fresh ``python -m sglang.launch_server`` on torch_cpu with the README's hot-set
line (``--page-size 16 --radix-eviction-policy importance --attention-backend importance_torch
--enable-hierarchical-cache --hot-set-policy importance --hot-set-budget 0.2``, the guard on),
``--max-total-tokens`` the pool and a host pool that holds the model's whole context
(``--hicache-ratio``), plus ``--extra`` flags (``--hot-set-guard-threshold 1``: the guard off).
Then dense (``importance_torch``, no hot set) on ``--dense-pool`` tokens. Every server answers
the same retrieval prompts (``bench_hot_set.make_trials``: a needle and a four-pair key-value
task at each of ``--lengths``, ``--n`` each, one at a time, greedy, rids pinned). Per pool and
length: the longest request the server states it takes, how many prompts it served (a prompt
past that gets a 400), its answers against dense's (dense's hits it kept, and hits it got that
dense missed), the KV pages it borrowed for rows at most, the pages it released, and the wall
time. Writes RESULTS_long_requests.md and long_requests.png into --out and prints the table.

    python -m benchmark.long_context.bench_long_requests --out /tmp/long_requests
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import requests

from benchmark.long_context.bench_capacity import BorrowedWatch
from benchmark.long_context.bench_hot_set import PAGE, make_trials
from sgl_importance.client import generate, greedy, metrics_text
from sgl_importance.local_server import LocalServer, metric, model_path

README_LINE = [
    "--page-size", str(PAGE), "--radix-eviction-policy", "importance", "--attention-backend", "importance_torch",
    "--enable-hierarchical-cache", "--hot-set-policy", "importance", "--hot-set-budget", "0.2", "--enable-metrics",
]  # fmt: skip
CONTEXT = 8192
LIMITS = re.compile(r"hot set: the longest request is (\d+) tokens \((.+?)\),")
MAX_NEW = {"needle": 12, "kv": 12}


def run_server(name: str, args: list[str], trials: list[dict], out: Path) -> list[dict]:
    """Every trial through one server, one at a time: a row per trial."""
    server = LocalServer(model_path(), args, out / f"server_{name}.log")
    rows = []
    try:
        server.wait_ready(timeout=900)
        limit = LIMITS.search(server.log())
        watch = BorrowedWatch(server.url)
        for t in trials:
            started = time.time()
            row = {"server": name, "task": t["task"], "length": len(t["ids"]), "trial": t["trial"]}
            try:
                out_ = generate(
                    server.url,
                    input_ids=t["ids"],
                    sampling_params=greedy(MAX_NEW[t["task"]]),
                    rid=f"long-{t['task']}-{t['length']}-{t['trial']}",
                    timeout=3600,
                )
                row.update(served=True, correct=t["answer"] in out_["text"], text=out_["text"])
            except requests.HTTPError as err:
                row.update(served=False, correct=False, error=err.response.text[:300])
            row["seconds"] = time.time() - started
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
        borrowed, scrape = watch.stop(), metrics_text(server.url)
        for row in rows:
            row["longest"] = int(limit.group(1)) if limit else None
            row["bound"] = limit.group(2) if limit else "SGLang's own (the device pool)"
            row["borrowed_most"] = borrowed
            row["released"] = metric(scrape, "sgl_importance:hot_set_pages_released_total")
    finally:
        server.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pools", default="1024,2048,4096", help="the hot-set servers' --max-total-tokens")
    p.add_argument("--lengths", default="3500,7500", help="prompt tokens (the model's context: 8192)")
    p.add_argument("--tasks", default="needle,kv")
    p.add_argument("--n", type=int, default=6, help="prompts per task and length")
    p.add_argument("--dense-pool", type=int, default=16384)
    p.add_argument("--extra", default="", help="more flags for the hot-set servers (e.g. the guard off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="long_requests_")))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    lengths = [int(x) for x in a.lengths.split(",")]
    trials = [t for task in a.tasks.split(",") for t in make_trials(tokenizer, task, lengths, a.n, a.seed)]
    started = time.time()
    rows = []
    for pool in (int(x) for x in a.pools.split(",")):
        ratio = -(-CONTEXT // pool) + 1  # a host pool that holds a whole context
        args = [*README_LINE, "--max-total-tokens", str(pool), "--hicache-ratio", str(ratio), *shlex.split(a.extra)]
        rows += run_server(f"hot set, {pool}-token pool", args, trials, a.out)
    dense = ["--page-size", str(PAGE), "--attention-backend", "importance_torch", "--max-total-tokens"]
    rows += run_server(f"dense, {a.dense_pool}-token pool", [*dense, str(a.dense_pool)], trials, a.out)
    (a.out / "long_requests.json").write_text(json.dumps(rows, indent=1))
    write_results(rows, a, (time.time() - started) / 60)


def write_results(rows: list[dict], a, minutes: float) -> None:
    dense_name = f"dense, {a.dense_pool}-token pool"
    dense = {(r["task"], r["length"], r["trial"]): r for r in rows if r["server"] == dense_name}
    lines = [
        "| server | longest request it takes (bound) | prompt tokens | served | needle right (dense) | "
        "key-value right (dense) | dense's hits kept | KV pages borrowed for rows, most | mean s / request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for server in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == server]
        for length in sorted({r["length"] // 100 * 100 for r in mine}):
            cell = [r for r in mine if r["length"] // 100 * 100 == length]
            ref = [dense[(r["task"], r["length"], r["trial"])] for r in cell]

            def right(task: str, of: list[dict]) -> int:
                return sum(r["correct"] for r in of if r["task"] == task)

            kept = sum(r["correct"] and d["correct"] for r, d in zip(cell, ref))
            hits = sum(d["correct"] for d in ref)
            lines.append(
                f"| {server} | {cell[0]['longest'] or '–'} ({cell[0]['bound']}) | ~{length} | "
                f"{sum(r['served'] for r in cell)}/{len(cell)} | {right('needle', cell)} ({right('needle', ref)}) | "
                f"{right('kv', cell)} ({right('kv', ref)}) | {kept}/{hits} | {cell[0]['borrowed_most']:.0f} | "
                f"{sum(r['seconds'] for r in cell) / len(cell):.0f} |"
            )
    command = "python -m benchmark.long_context.bench_long_requests " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    text = (
        "# The longest request served against the device pool (bench_long_requests.py)\n\n"
        f"Command (took {minutes:.0f} min):\n\n```\n{command}\n```\n\n" + "\n".join(lines) + "\n"
    )
    (a.out / "RESULTS_long_requests.md").write_text(text)
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    servers = [s for s in dict.fromkeys(r["server"] for r in rows) if s != dense_name]
    for server in servers:
        mine = [r for r in rows if r["server"] == server]
        xs = sorted({r["length"] // 100 * 100 for r in mine})
        ax.plot(xs, [sum(r["served"] for r in mine if r["length"] // 100 * 100 == x) for x in xs], "o-", label=server)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prompts served")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out / "long_requests.png", dpi=120)


if __name__ == "__main__":
    main()
