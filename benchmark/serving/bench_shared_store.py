"""Two servers sharing one Mooncake Store vs each with its own ``file`` tier.

Prefixes recur across instances: a stream of requests, each a shared document
(picked by a Zipf law) plus its own question, is split round-robin over two
servers, so a document one server computed is often asked next on the other. Arms
(each a fresh pair of ``python -m sglang.launch_server`` processes, one arm after
another, the same request stream):

- ``store`` x {importance, lru}: both servers on one local Mooncake Store
  (``sgl_importance.local_store``: master + segment holder, free ports);
- ``file``  x {importance, lru}: each server its own fresh ``file`` directory.

``lru`` is SGLang's best built-in policy on this machine in ``RESULTS.md``.
Per arm: storage-hit tokens, recomputed prefill tokens (prompt tokens not served
from any cache), mean / median / p99 TTFT, hits by tier, and for importance the
shared-importance records restored. The client is this script (streaming
``/generate`` with ``return_cached_tokens_details``), two requests in flight, one
per server: SGLang's own load generator talks to one server at a time.

    python -m benchmark.serving.bench_shared_store                 # ~12 min on 2 CPU cores
    python -m benchmark.serving.bench_shared_store --smoke --out /tmp/bench-shared

Writes results.json, results.md, results.png into --out (default
benchmark/serving/out/shared_store) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmark.serving.bench_policies import git_state, wait_for_host_memory
from sgl_importance.client import metrics_text, stream_generate
from sgl_importance.local_server import HOST_MEMORY, PORT_CLASH, LocalServer, metric, model_path, start_with_retry
from sgl_importance.local_store import LocalStore, store_unavailable

REPO = Path(__file__).resolve().parents[2]

START_ATTEMPTS = 4
ARMS = (("store", "importance"), ("store", "lru"), ("file", "importance"), ("file", "lru"))


def workload(docs: int, requests_n: int, doc_items: int, zipf: float, seed: int) -> list[str]:
    """The request texts: a Zipf-picked document (~4 tokens an item) + a question."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(docs)]
    texts = []
    for i in range(requests_n):
        d = rng.choices(range(docs), weights)[0]
        body = " ".join(f"doc{d}item{j}" for j in range(doc_items))
        texts.append(f"Document {d}: {body}\nQuestion {i}: what is item {rng.randrange(doc_items)}?")
    return texts


def server_args(policy: str, tier: str, a: argparse.Namespace) -> list[str]:
    return [
        "--page-size", "16",
        "--max-total-tokens", str(a.max_total_tokens),
        "--attention-backend", "importance_torch",
        "--radix-eviction-policy", policy,
        "--enable-hierarchical-cache",
        "--hicache-ratio", str(a.hicache_ratio),
        "--hicache-storage-backend", "mooncake" if tier == "store" else "file",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--enable-cache-report",
        "--enable-metrics",
        *shlex.split(a.server_args),
    ]  # fmt: skip


def send(server: LocalServer, text: str, output_len: int) -> dict:
    """One streamed greedy request: TTFT and the cache report."""
    ttft, last = stream_generate(
        server.url,
        text=text,
        sampling_params={"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
        return_cached_tokens_details=True,
    )
    meta = last["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {
        "ttft_ms": 1000 * ttft,
        "prompt_tokens": meta["prompt_tokens"],
        "cached": meta.get("cached_tokens", 0),
        **{t: details.get(t, 0) for t in ("device", "host", "storage")},
    }


def run_arm(tier: str, policy: str, texts: list[str], a: argparse.Namespace, model: str) -> dict:
    name = f"{tier}-{policy}"
    run_dir = a.out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    store = None
    envs = []
    if tier == "store":
        store = LocalStore(run_dir / "store", segment="2GB").start()
        envs = [store.server_env(), store.server_env()]
    else:
        for i in range(2):
            d = run_dir / f"hicache{i}"
            d.mkdir()
            envs.append({"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(d)})
    servers = []
    try:
        wait_for_host_memory(name, a.memory_wait_s)
        started = time.time()

        def server(i: int) -> LocalServer:
            return LocalServer(model, server_args(policy, tier, a), run_dir / f"server{i}.log", envs[i])

        # Both start at once; one that SGLang's fixed 10 GiB host-memory reserve refused
        # (a shared machine) starts again on its own once memory is back.
        servers = [server(i) for i in range(2)]
        for i in range(2):
            starting = [servers[i]]

            def again(i: int = i, starting: list = starting) -> LocalServer:
                if not starting:
                    wait_for_host_memory(name, a.memory_wait_s)
                    starting.append(server(i))
                servers[i] = starting.pop()
                return servers[i]

            retry_on = (HOST_MEMORY, PORT_CLASH)
            start_with_retry(again, attempts=START_ATTEMPTS, retry_on=retry_on, pause_s=30, timeout=600, label=name)
        startup_s = time.time() - started
        print(f"[{name}] ready in {startup_s:.0f}s; {len(texts)} requests round-robin", flush=True)
        results: list = [None] * len(texts)
        load_before = os.getloadavg()[0]

        # One request in flight per server; request i goes to server i % 2, in order.
        def lane(k: int) -> None:
            for i in range(k, len(texts), 2):
                results[i] = send(servers[k], texts[i], a.output_len)

        t0 = time.time()
        lanes = [threading.Thread(target=lane, args=(k,)) for k in range(2)]
        for t in lanes:
            t.start()
        for t in lanes:
            t.join()
        wall = time.time() - t0
        scrapes = [metrics_text(s.url) for s in servers]
        load_after = os.getloadavg()[0]
    finally:
        for s in servers:
            s.stop()
        if store is not None:
            store.stop()
    if any(r is None for r in results):
        raise RuntimeError(f"[{name}] some requests failed; see {run_dir}")
    ttfts = sorted(r["ttft_ms"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached"] for r in results)
    row = {
        "arm": name,
        "tier": tier,
        "policy": policy,
        "requests": len(results),
        "prompt_tokens": prompt,
        "hit_device": sum(r["device"] for r in results),
        "hit_host": sum(r["host"] for r in results),
        "hit_storage": sum(r["storage"] for r in results),
        "recomputed_tokens": prompt - cached,
        "mean_ttft_ms": statistics.mean(ttfts),
        "median_ttft_ms": statistics.median(ttfts),
        "p99_ttft_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "wall_s": wall,
        "startup_s": startup_s,
        "load_before": load_before,
        "load_after": load_after,
        "shared_restored_pages": sum(
            metric(t, "sgl_importance:shared_importance_pages_total", event="restored") for t in scrapes
        ),
        # Pages and bytes the servers wrote to the storage tier (trailers excluded).
        "stored_pages": sum(metric(t, "sgl_importance:storage_pages_total", op="write") for t in scrapes),
        "stored_bytes": sum(metric(t, "sgl_importance:storage_page_bytes_total", op="write") for t in scrapes),
        "shared_published_pages": sum(
            metric(t, "sgl_importance:shared_importance_pages_total", event="published") for t in scrapes
        ),
        "tracebacks": sum(
            (run_dir / f"server{i}.log").read_text(errors="replace").count("Traceback") for i in range(2)
        ),
    }
    (run_dir / "requests.json").write_text(json.dumps(results))
    print(
        f"[{name}] mean TTFT {row['mean_ttft_ms']:.0f} ms, storage hits {row['hit_storage']}, "
        f"recomputed {row['recomputed_tokens']} of {prompt} tokens",
        flush=True,
    )
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| arm | requests | prompt tok | device hit | host hit | storage hit | recomputed tok "
        "| mean TTFT ms | median TTFT ms | p99 TTFT ms | wall s | shared importance pages restored | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['requests']} | {r['prompt_tokens']} | {r['hit_device']} | {r['hit_host']} "
            f"| {r['hit_storage']} | {r['recomputed_tokens']} | {r['mean_ttft_ms']:.0f} "
            f"| {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['wall_s']:.0f} "
            f"| {r['shared_restored_pages']:.0f} | {r['load_before']:.1f}–{r['load_after']:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["arm"] for r in rows]
    x = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.bar([i - 0.2 for i in x], [r["mean_ttft_ms"] for r in rows], 0.4, label="mean")
    ax1.bar([i + 0.2 for i in x], [r["median_ttft_ms"] for r in rows], 0.4, label="median")
    ax1.set_xticks(x, names)
    ax1.set_ylabel("TTFT (ms)")
    ax1.legend()
    bottom = [0.0] * len(rows)
    for key, label in (
        ("hit_device", "device hit"),
        ("hit_host", "host hit"),
        ("hit_storage", "storage hit"),
        ("recomputed_tokens", "recomputed"),
    ):
        values = [r[key] for r in rows]
        ax2.bar(x, values, 0.5, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax2.set_xticks(x, names)
    ax2.set_ylabel("prompt tokens")
    ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmark" / "serving" / "out" / "shared_store")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (validates the script)")
    p.add_argument("--arms", default=",".join(f"{t}-{p}" for t, p in ARMS), help="tier-policy, comma-separated")
    p.add_argument("--docs", type=int, default=12)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--doc-items", type=int, default=100, help="~4 tokens an item (100: ~400 tokens)")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-total-tokens", type=int, default=1024)
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--memory-wait-s", type=float, default=1800)
    p.add_argument(
        "--server-args", default="", help="more launch_server flags for every server, e.g. "
        "'--importance-storage-precision graded'"
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.smoke:
        a.docs, a.requests, a.output_len = 3, 6, 2
    a.out = a.out.resolve()
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    reason = store_unavailable()
    if reason is not None:
        print(f"Mooncake Store unavailable: {reason}", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    model = model_path()
    texts = workload(a.docs, a.requests, a.doc_items, a.zipf, a.seed)
    arms = [tuple(x.split("-", 1)) for x in a.arms.split(",") if x]
    started = time.time()
    rows = [run_arm(tier, policy, texts, a, model) for tier, policy in arms]
    title = (
        f"{a.requests} requests round-robin over 2 servers, {a.docs} documents x ~{4 * a.doc_items} tok "
        f"(Zipf {a.zipf}), device {a.max_total_tokens} tok, host x{a.hicache_ratio:g}"
    )
    table = markdown(rows)
    meta = {"args": {k: str(v) for k, v in vars(a).items()}, "code": git_state(), "wall_s": time.time() - started}
    (a.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (a.out / "results.md").write_text(f"{title}\n\n{table}\n")
    plot(rows, a.out / "results.png", title)
    print(f"\n{title}\n\n{table}\n\ncode {meta['code']}; wall {meta['wall_s']:.0f}s; wrote {a.out}")
    return 1 if any(r["tracebacks"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
