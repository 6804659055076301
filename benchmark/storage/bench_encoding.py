"""Storage precision by importance: bytes on the storage tier, and retrieval served from it.

For each ``--importance-storage-precision`` setting, one float32 server on the
``file`` tier answers the long-context retrieval grid (needle, key-value,
adversarial prompts of ``benchmark/long_context/bench_hot_set.py``) twice per prompt:

1. *warm*: the prompt is prefilled and decoded from the device; L3 admission
   (``storage_min_importance``, a tiny threshold) holds its pages back until a
   decode step has attended them, so ``graded`` ranks them by the attention they
   earned; they are then sealed for the storage tier in their classes;
2. after ``/flush_cache`` (device and host emptied): the same prompt again, its
   prefix fetched from the storage tier and decoded into the host pool, so the
   answer is decoded over the stored pages.

Dense is the ``off`` setting's warm answers (float32 from the device). Bytes are
the page files each setting left on disk (trailer included) against float32's.
Settings: ``off``, ``graded`` (the defaults), ``graded-low`` (fewer bytes),
``blind`` (graded's class fractions with pages picked by key hash: the control
for what importance adds at equal bytes), ``uniform8``, ``uniform4``.

    python -m benchmark.storage.bench_encoding --n 10 --lengths 2048,4096

Prints a table per task and writes ``summary.json``, ``trials.jsonl`` and
``encoding_accuracy.png`` under ``--out``; ``--report`` re-reads the journal.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import struct
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmark.long_context import bench_hot_set as grid  # make_trials, MAX_NEW
from sgl_importance.client import flush_cache, generate, greedy
from sgl_importance.local_server import LocalServer, model_path

HERE = Path(__file__).resolve().parent

PAGE = 16
TRAILER = 32
# SmolLM2-135M: 30 layers x 3 KV heads x 64 channels, K and V, 16 tokens a page.
ELEMENTS = 2 * 30 * 3 * 64 * PAGE
FLOAT32_PAGE = 4 * ELEMENTS
SETTINGS = {
    "off": ("off", None),
    "graded": ("graded", None),
    "graded-low": ("graded", {"keep": 0.02, "cold": 0.9}),
    "blind": ("graded", {"order": "blind"}),
    "uniform8": ("uniform8", None),
    "uniform4": ("uniform4", None),
}


def server_args(setting: str, longest: int, batch: int) -> list[str]:
    precision, thresholds = SETTINGS[setting]
    args = [
        "--dtype", "float32", "--page-size", str(PAGE), "--context-length", "8192",
        "--max-total-tokens", str((batch + 1) * (longest + 64)),
        "--attention-backend", "importance_torch",
        "--radix-eviction-policy", "importance",
        "--radix-eviction-policy-config", json.dumps({"storage_min_importance": 1e-6}),
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--importance-storage-precision", precision,
        "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip
    if thresholds:
        args += ["--importance-storage-precision-config", json.dumps(thresholds)]
    return args


def answer(server: LocalServer, trial: dict) -> dict:
    out = generate(
        server.url,
        input_ids=trial["ids"],
        sampling_params=greedy(grid.MAX_NEW[trial["task"]]),
        return_cached_tokens_details=True,
        timeout=3600,
    )
    details = out["meta_info"].get("cached_tokens_details") or {}
    return {"text": out["text"], "storage": details.get("storage", 0)}


def page_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.suffix == ".bin"] if directory.exists() else []


def settle(directory: Path, quiet_s: float = 2.0, timeout: float = 300.0) -> None:
    """Wait until no page file appeared for ``quiet_s`` seconds."""
    deadline, last, since = time.time() + timeout, -1, time.time()
    while time.time() < deadline:
        n = len(page_files(directory))
        if n != last:
            last, since = n, time.time()
        elif time.time() - since > quiet_s:
            return
        time.sleep(0.25)


def stored_classes(directory: Path, ids: list[int]) -> list[int]:
    """The class in each of the prompt's stored page files' trailers (-1: not stored),
    found by SGLang's own page-hash chain (the file tier's key)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    classes = []
    for h in get_storage_hash_str(RadixKey(list(ids)), None, page_size=PAGE):
        found = list(directory.glob(f"{h}_*.bin"))
        if not found:
            classes.append(-1)
            continue
        raw = found[0].read_bytes()
        classes.append(struct.unpack_from("<H", raw, len(raw) - TRAILER + 6)[0])
    return classes


def fact_pages(tokenizer, ids: list[int], answer: str) -> list[int]:
    """The pages holding the answer's fact: the first pair of pages whose text contains it."""
    for p in range(len(ids) // PAGE):
        if answer in tokenizer.decode(ids[p * PAGE : (p + 2) * PAGE]):
            return [p, p + 1] if answer not in tokenizer.decode(ids[p * PAGE : (p + 1) * PAGE]) else [p]
    return []


def flush(server: LocalServer) -> None:
    for _ in range(60):
        r = flush_cache(server.url)
        if r.status_code == 200:
            return
        time.sleep(1)
    raise RuntimeError(f"/flush_cache refused: {r.status_code} {r.text}")


def run_setting(setting: str, trials: list[dict], a, model: str, done: set, sink, tokenizer) -> dict:
    """Serve every trial warm and from storage under ``setting``; returns its bytes."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-encoding-{setting}-"))
    directory = work / "pages"
    longest = max(len(t["ids"]) for t in trials)
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(directory)}
    server = LocalServer(model, server_args(setting, longest, a.batch), work / "server.log", env)
    try:
        server.wait_ready(timeout=900)
        for group in grid.make_groups(trials, a.batch):
            left = [t for t in group if (setting, t["task"], t["length"], t["trial"]) not in done]
            if not left:
                continue
            started = time.time()
            with ThreadPoolExecutor(len(left)) as pool:
                warm = list(pool.map(lambda t: answer(server, t), left))
            settle(directory)
            facts = []
            for t in left:
                classes = stored_classes(directory, t["ids"])
                # The best class among the fact's pages (0 full, 1 int8, 2 int4; -1 not stored).
                facts.append(min((classes[p] for p in fact_pages(tokenizer, t["ids"], t["answer"])), default=-1))
            flush(server)
            with ThreadPoolExecutor(len(left)) as pool:
                cold = list(pool.map(lambda t: answer(server, t), left))
            flush(server)  # the next group starts from an empty device and host too
            for trial, w, c, fact in zip(left, warm, cold, facts):
                row = {"setting": setting, "task": trial["task"], "length": trial["length"], "trial": trial["trial"]}
                row.update(
                    answer=trial["answer"],
                    warm_text=w["text"],
                    warm_correct=trial["answer"] in w["text"],
                    text=c["text"],
                    correct=trial["answer"] in c["text"],
                    storage_tokens=c["storage"],
                    prompt_tokens=len(trial["ids"]),
                    fact_class=fact,
                )
                sink.write(json.dumps(row) + "\n")
            sink.flush()
            print(
                f"{setting} {group[0]['task']} {group[0]['length']} #{group[0]['trial']}..{group[-1]['trial']}: "
                f"{time.time() - started:.0f} s",
                flush=True,
            )
        settle(directory)
    finally:
        server.stop()
    sizes = [p.stat().st_size for p in page_files(directory)]
    return {"pages": len(sizes), "bytes": sum(sizes), "log": str(work / "server.log")}


def read_journal(out: Path) -> list[dict]:
    path = out / "trials.jsonl"
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[(row["setting"], row["task"], row["length"], row["trial"])] = row
    return list(rows.values())


def summarise(rows: list[dict], storage: dict) -> dict:
    """Per setting: bytes, bits per element, and per task/length hits from storage vs dense."""
    dense = {(r["task"], r["length"], r["trial"]): r["warm_correct"] for r in rows if r["setting"] == "off"}
    dense_text = {(r["task"], r["length"], r["trial"]): r["warm_text"] for r in rows if r["setting"] == "off"}
    out: dict = {}
    for setting in SETTINGS:
        mine = [r for r in rows if r["setting"] == setting]
        if not mine:
            continue
        s = storage.get(setting) or {}
        pages, total = s.get("pages", 0), s.get("bytes", 0)
        per_page = total / pages if pages else float("nan")
        cells: dict = defaultdict(
            lambda: {"n": 0, "hits": 0, "dense_hits": 0, "storage_tokens": 0, "prompt": 0, "fact_full": 0, "same": 0}
        )
        for r in mine:
            for key in ((r["task"], r["length"]), (r["task"], "all")):
                c = cells[key]
                c["n"] += 1
                c["hits"] += int(r["correct"])
                c["dense_hits"] += int(dense.get((r["task"], r["length"], r["trial"]), False))
                c["storage_tokens"] += r["storage_tokens"]
                c["prompt"] += r["prompt_tokens"]
                c["fact_full"] += int(r.get("fact_class") == 0)
                # The whole answer token for token as dense's: more sensitive than a hit.
                c["same"] += int(dense_text.get((r["task"], r["length"], r["trial"])) == r["text"])
        out[setting] = {
            "pages": pages,
            "bytes_per_page": per_page,
            "bytes_per_token": per_page / PAGE if pages else float("nan"),
            "vs_float32": per_page / (FLOAT32_PAGE + TRAILER) if pages else float("nan"),
            "bits_per_element": 8 * (per_page - TRAILER) / ELEMENTS if pages else float("nan"),
            "cells": {f"{t}/{n}": c for (t, n), c in cells.items()},
        }
    return out


def table(summary: dict) -> str:
    lines = [
        "| setting | bytes/page | bytes/token | vs float32 | bits/element | task | length | hits (storage) | "
        "dense hits | kept | same answer as dense | storage tokens / prompt | fact page at float32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, s in summary.items():
        for key in sorted(s["cells"], key=lambda k: (k.split("/")[0], k.split("/")[1] == "all", k)):
            c = s["cells"][key]
            task, length = key.split("/")
            kept = c["hits"] / c["dense_hits"] if c["dense_hits"] else float("nan")
            lines.append(
                f"| {setting} | {s['bytes_per_page']:,.0f} | {s['bytes_per_token']:,.0f} | {s['vs_float32']:.3f} | "
                f"{s['bits_per_element']:.2f} | {task} | {length} | {c['hits']}/{c['n']} | "
                f"{c['dense_hits']}/{c['n']} | {kept:.0%} | {c['same']}/{c['n']} | "
                f"{c['storage_tokens'] / max(c['prompt'], 1):.2f} | "
                f"{c['fact_full']}/{c['n']} |"
            )
    return "\n".join(lines)


PAIRS = (("graded", "blind"), ("graded", "uniform4"), ("graded", "uniform8"), ("graded-low", "uniform4"))


def paired(rows: list[dict]) -> str:
    """Per task, trials where one setting answered as dense and the other did not (both
    ways), and the two-sided sign-test p-value of that split."""
    dense = {(r["task"], r["length"], r["trial"]): r["warm_text"] for r in rows if r["setting"] == "off"}
    by = {(r["setting"], r["task"], r["length"], r["trial"]): r for r in rows}
    lines = [
        "| A | B | task | A same as dense, B not | B same, A not | sign test p | A hit, B miss | B hit, A miss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a_name, b_name in PAIRS:
        for task in sorted({r["task"] for r in rows}):
            ab = ba = hab = hba = 0
            for (setting, t, length, trial), a in by.items():
                b = by.get((b_name, t, length, trial))
                if setting != a_name or t != task or b is None:
                    continue
                ref = dense.get((t, length, trial))
                a_same, b_same = a["text"] == ref, b["text"] == ref
                ab += a_same and not b_same
                ba += b_same and not a_same
                hab += a["correct"] and not b["correct"]
                hba += b["correct"] and not a["correct"]
            if ab or ba or hab or hba:
                p = grid.sign_test(ab, ba)
                lines.append(f"| {a_name} | {b_name} | {task} | {ab} | {ba} | {p:.3f} | {hab} | {hba} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({k.split("/")[0] for s in summary.values() for k in s["cells"]})
    fig, grid_axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 6.6), sharey=True, squeeze=False)
    families = {
        "uniform": (["uniform4", "uniform8", "off"], "o-", "uniform"),
        "graded": (["graded-low", "graded"], "s-", "importance-graded"),
        "blind": (["blind"], "x", "graded fractions, blind to importance"),
    }
    rows = (("hits", "hits, prefix served from storage"), ("same", "answers identical to dense"))
    for (field, ylabel), axes in zip(rows, grid_axes):
        for ax, task in zip(axes, tasks):
            for names, style, label in families.values():
                xs, ys = [], []
                for name in names:
                    s = summary.get(name)
                    c = s and s["cells"].get(f"{task}/all")
                    if c and c["n"]:
                        xs.append(s["bits_per_element"])
                        ys.append(c[field] / c["n"])
                if xs:
                    ax.plot(xs, ys, style, label=label)
            ax.set_title(task)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("stored bits per element (float32 = 32)")
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(ylabel)
    grid_axes[-1][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="needle,kv,adversarial")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--n", type=int, default=10, help="trials per task and length")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--batch", type=int, default=5, help="prompts served at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--report", action="store_true", help="only summarise the journal in --out")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    storage_file = out / "storage.json"
    storage = json.loads(storage_file.read_text()) if storage_file.exists() else {}
    if not a.report:
        (out / "command.txt").write_text(
            "python -m benchmark.storage.bench_encoding " + shlex.join(sys.argv[1:]) + "\n"
        )
        model = model_path()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        lengths = [int(x) for x in a.lengths.split(",")]
        trials = [t for task in a.tasks.split(",") for t in grid.make_trials(tokenizer, task, lengths, a.n, a.seed)]
        done = {(r["setting"], r["task"], r["length"], r["trial"]) for r in read_journal(out)}
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        with (out / "trials.jsonl").open("a") as sink:
            for setting in a.settings.split(","):
                started = time.time()
                storage[setting] = run_setting(setting, trials, a, model, done, sink, tokenizer)
                storage_file.write_text(json.dumps(storage, indent=1))
                print(f"{setting}: {storage[setting]} in {(time.time() - started) / 60:.1f} min", flush=True)
    summary = summarise(read_journal(out), storage)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print()
    print(paired(read_journal(out)))
    plot(summary, out / "encoding_accuracy.png")


if __name__ == "__main__":
    main()
