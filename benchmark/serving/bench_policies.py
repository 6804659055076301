"""lru vs slru vs importance under SGLang's own load generator, one server after another.

Each policy gets a fresh server (``python -m sglang.launch_server``) with the same
small device pool, the host tier, a fresh ``file`` storage tier, the
``importance_torch`` backend, ``--enable-metrics`` and ``--enable-cache-report``; the
same request stream is then sent by ``python -m sglang.benchmark.serving`` with the
``generated-shared-prefix`` dataset (system prompts picked by a Zipf law: a few are
reused often, with long gaps in between, most are used once or twice). Per policy:
TTFT, throughput, prefix hits by tier (device / host / storage, from the client's
per-request ``cached_tokens_details`` and from ``sglang:cached_tokens_total``),
evictions, host→device load-backs and storage traffic. Writes results.json,
results.md and results.png into --out and prints the markdown table.

    python -m benchmark.serving.bench_policies                    # ~12 min on 2 CPU cores
    python -m benchmark.serving.bench_policies --smoke --out /tmp/bench-serving-smoke

The client's generated dataset is cached under ``--out``/client-home (its HOME), so
all policies replay the identical stream; the script checks that they did.
See README.md beside this file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sgl_importance.client import load_generator, metrics_text
from sgl_importance.local_server import (
    HOST_MEMORY,
    PORT_CLASH,
    SERVED_NAME,
    LocalServer,
    metric,
    model_path,
    start_with_retry,
)

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("lru", "slru", "importance")
STARTUP_TIMEOUT_S = 600
START_ATTEMPTS = 3
# SGLang subtracts this from available RAM before sizing any host tier (pool_host/base.py).
HOST_MEMORY_RESERVE_BYTES = 10 << 30


@dataclass(frozen=True)
class Workload:
    """The client's generated-shared-prefix parameters (``--gsp-*``)."""

    groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    zipf_alpha: float
    concurrency: int
    seed: int = 42

    @property
    def num_prompts(self) -> int:
        return self.groups * self.prompts_per_group

    def client_args(self) -> list[str]:
        return [
            "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(self.groups),
            "--gsp-prompts-per-group", str(self.prompts_per_group),
            "--gsp-system-prompt-len", str(self.system_prompt_len),
            "--gsp-question-len", str(self.question_len),
            "--gsp-output-len", str(self.output_len),
            "--gsp-group-distribution", "zipf",
            "--gsp-zipf-alpha", str(self.zipf_alpha),
            "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency),
            "--seed", str(self.seed),
        ]  # fmt: skip


@dataclass(frozen=True)
class Pools:
    """Device pool, page and host-tier size: small enough that every tier is used."""

    max_total_tokens: int
    page_size: int
    hicache_ratio: float

    def server_args(self) -> list[str]:
        return [
            "--max-total-tokens", str(self.max_total_tokens),
            "--page-size", str(self.page_size),
            "--enable-hierarchical-cache",
            "--hicache-ratio", str(self.hicache_ratio),
            "--hicache-storage-backend", "file",
        ]  # fmt: skip


# 24 system prompts of 512 tokens under Zipf(1.1): the hottest gets ~30 of the 96
# requests, half of them are used at most twice. 2048 device tokens hold the two
# running requests and one to three cached prompts; the host tier (2x) about eight;
# the rest lives in the file tier only.
FULL = (Workload(24, 4, 512, 64, 16, 1.1, 2), Pools(2048, 16, 2.0))
SMOKE = (Workload(4, 2, 128, 16, 4, 1.1, 2), Pools(512, 16, 2.0))


def server_counters(text: str) -> dict:
    """The cache series this benchmark reports, from one /metrics scrape."""
    return {
        "hit_device": metric(text, "sglang:cached_tokens_total", cache_source="device"),
        "hit_host": metric(text, "sglang:cached_tokens_total", cache_source="host"),
        "hit_storage": metric(text, "sglang:cached_tokens_total", cache_source="storage"),
        "server_prompt_tokens": metric(text, "sglang:prompt_tokens_total"),
        # Device slots freed by eviction (backed up to host or dropped).
        "evicted_device": metric(text, "sglang:evicted_tokens_total"),
        "dropped_unbacked": metric(text, "sglang:hicache_dropped_tokens_total"),
        "backup_to_host": metric(text, "sglang:hicache_backup_tokens_total"),
        "load_back": metric(text, "sglang:load_back_tokens_total"),
        "written_to_storage": metric(text, "sglang:backuped_tokens_total"),
        "prefetched_from_storage": metric(text, "sglang:prefetched_tokens_total"),
        # The plugin's own series; only the importance policy has them.
        "importance_evicted_device": metric(text, "sgl_importance:evicted_tokens_total", tier="device"),
        "importance_evicted_host": metric(text, "sgl_importance:evicted_tokens_total", tier="host"),
    }


def run_policy(
    policy: str,
    workload: Workload,
    pools: Pools,
    args: argparse.Namespace,
    model: str,
) -> dict:
    run_dir = args.out / policy
    storage = run_dir / "hicache"
    if storage.exists():
        for f in storage.iterdir():
            f.unlink()
    storage.mkdir(parents=True, exist_ok=True)
    result_file = run_dir / "client.jsonl"
    result_file.unlink(missing_ok=True)

    server_args = [
        "--attention-backend", "importance_torch",
        "--radix-eviction-policy", policy,
        *pools.server_args(),
        "--enable-metrics",
        "--enable-cache-report",
    ]  # fmt: skip
    if policy == "importance" and args.importance_config:
        server_args += ["--radix-eviction-policy-config", args.importance_config]
    # SGLang's file backend reads this before any extra-config path: a fresh tier per run.
    server_env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)}

    code = git_state()
    started = time.time()

    def start() -> LocalServer:
        wait_for_host_memory(policy, args.memory_wait_s)
        server = LocalServer(model, server_args, run_dir / "server.log", server_env, platform=args.platform or None)
        print(f"[{policy}] starting server on port {server.port}", flush=True)
        return server

    # On a shared machine SGLang's host-memory check can refuse the host tier while
    # other processes hold memory; that is worth another try.
    server = start_with_retry(
        start, attempts=START_ATTEMPTS, retry_on=(HOST_MEMORY, PORT_CLASH), pause_s=30,
        timeout=STARTUP_TIMEOUT_S, label=policy,
    )  # fmt: skip
    url = server.url
    # The client caches its generated dataset under HOME/.cache/sglang/benchmark, keyed
    # without the tokenizer's path: keep it ours and shared by the runs.
    client_cmd, client_env = load_generator(
        server.port, model, SERVED_NAME, workload.client_args(), result_file, home=args.out / "client-home"
    )
    try:
        ready = time.time()
        load_before = os.getloadavg()[0]
        print(f"[{policy}] ready in {ready - started:.0f}s; running the client", flush=True)
        with open(run_dir / "client.log", "w") as client_log:
            proc = subprocess.run(client_cmd, env=client_env, stdout=client_log, stderr=subprocess.STDOUT, cwd=run_dir)
        client_s = time.time() - ready
        scrape = metrics_text(url)
    finally:
        server.stop()
    (run_dir / "metrics.txt").write_text(scrape)
    run = {
        "code": code,
        "startup_s": ready - started,
        "start_attempts": server.start_attempts,
        "client_wall_s": client_s,
        # The machine's 1-minute load average before and after the client ran: other
        # processes on a shared machine shift TTFT between runs, not the hits by tier.
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    (run_dir / "run.json").write_text(json.dumps(run, indent=2))
    if proc.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"[{policy}] client failed ({proc.returncode}); see {run_dir / 'client.log'}")
    row = saved_row(policy, run_dir)
    print(
        f"[{policy}] {row['completed']} done, mean TTFT {row['mean_ttft_ms']:.0f} ms, "
        f"hits device/host/storage {row['hit_device']:.0f}/{row['hit_host']:.0f}/{row['hit_storage']:.0f}",
        flush=True,
    )
    return row


def saved_row(policy: str, run_dir: Path) -> dict:
    """One policy's row from what its run left in run_dir (the client's JSON result,
    the /metrics scrape, the server log and run.json)."""
    client = json.loads((run_dir / "client.jsonl").read_text().splitlines()[-1])
    log = (run_dir / "server.log").read_text(errors="replace")
    run_file = run_dir / "run.json"
    run = json.loads(run_file.read_text()) if run_file.exists() else {}
    report = client.get("cache_report") or {}
    return {
        "policy": policy,
        "completed": client["completed"],
        "errors": sum(1 for e in client.get("errors", []) if e),
        "mean_ttft_ms": client["mean_ttft_ms"],
        "median_ttft_ms": client["median_ttft_ms"],
        "p99_ttft_ms": client["p99_ttft_ms"],
        "mean_e2e_latency_ms": client["mean_e2e_latency_ms"],
        "request_throughput": client["request_throughput"],
        "input_throughput": client["input_throughput"],
        "output_throughput": client["output_throughput"],
        "duration_s": client["duration"],
        "prompt_tokens": report.get("total_prompt_tokens"),
        "cached_tokens": report.get("total_cached_tokens"),
        "client_hit_device": report.get("device_cached_tokens") or 0,
        "client_hit_host": report.get("host_cached_tokens") or 0,
        "client_hit_storage": report.get("storage_cached_tokens") or 0,
        "hit_rate_pct": report.get("cache_hit_rate_pct"),
        **server_counters((run_dir / "metrics.txt").read_text()),
        "server_log_tracebacks": log.count("Traceback"),
        "startup_s": run.get("startup_s"),
        "start_attempts": run.get("start_attempts"),
        "code": run.get("code", "unknown"),
        "client_wall_s": run.get("client_wall_s"),
        "load_before": run.get("load_before"),
        "load_after": run.get("load_after"),
        "input_lens": client.get("input_lens"),
    }


def wait_for_host_memory(policy: str, timeout_s: float) -> None:
    """SGLang refuses a host tier of any size while less than its fixed 10 GiB
    reserve plus the pool is available; on a shared machine, wait for it."""
    import psutil

    need = HOST_MEMORY_RESERVE_BYTES + (256 << 20)
    deadline = time.time() + timeout_s
    announced = False
    while psutil.virtual_memory().available < need and time.time() < deadline:
        if not announced:
            print(f"[{policy}] waiting for {need / 2**30:.2f} GiB of available host memory", flush=True)
            announced = True
        time.sleep(10)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "—"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| policy | done | mean TTFT ms | median TTFT ms | p99 TTFT ms | req/s | out tok/s "
        "| hit rate % | device hit | host hit | storage hit | device evicted | host→device "
        "| written to storage | storage→host |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['completed']} | {r['mean_ttft_ms']:.0f} | {r['median_ttft_ms']:.0f} "
            f"| {r['p99_ttft_ms']:.0f} | {r['request_throughput']:.3f} | {r['output_throughput']:.2f} "
            f"| {r['hit_rate_pct']:.1f} | {r['hit_device']:.0f} | {r['hit_host']:.0f} "
            f"| {r['hit_storage']:.0f} | {r['evicted_device']:.0f} | {r['load_back']:.0f} "
            f"| {r['written_to_storage']:.0f} | {r['prefetched_from_storage']:.0f} |"
        )
    by = {r["policy"]: r for r in rows}
    pairs = [(a, b) for a, b in (("importance", "lru"), ("importance", "slru"), ("slru", "lru")) if a in by and b in by]
    if pairs:
        lines += [
            "",
            "| ratio | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " |",
            "|---|" + "---:|" * len(pairs),
        ]
        for key, label in (
            ("mean_ttft_ms", "mean TTFT"),
            ("median_ttft_ms", "median TTFT"),
            ("p99_ttft_ms", "p99 TTFT"),
            ("request_throughput", "request throughput"),
            ("cached_tokens", "cached prompt tokens"),
            ("hit_device", "device hit tokens"),
        ):
            lines.append(f"| {label} | " + " | ".join(ratio(by[a][key], by[b][key]) for a, b in pairs) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.27
    for i, (key, label) in enumerate((("mean_ttft_ms", "mean"), ("median_ttft_ms", "median"), ("p99_ttft_ms", "p99"))):
        ax1.bar([j + (i - 1) * width for j in x], [r[key] for r in rows], width, label=label)
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_title("time to first token")
    ax1.legend()
    bottom = [0.0] * len(rows)
    for key, label in (("hit_device", "device"), ("hit_host", "host"), ("hit_storage", "storage")):
        values = [r[key] for r in rows]
        ax2.bar(list(x), values, 0.5, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("cached prompt tokens")
    ax2.set_title("prefix hits by tier")
    ax2.legend(loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_state() -> str:
    """HEAD, and a hash of the uncommitted diff of the installed (editable) packages:
    each server imports the plugin from the working tree as it is when it starts."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "diff", "HEAD", "--", "python", "sgl-kernel-ext"], cwd=REPO, capture_output=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if not diff:
        return sha
    return f"{sha} + uncommitted changes (diff sha256 {hashlib.sha256(diff).hexdigest()[:12]})"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmark" / "serving" / "out")
    p.add_argument("--smoke", action="store_true", help="tiny workload and pools (validates the script)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, run in this order")
    p.add_argument("--model-path", default=None, help="default: the embedded model (scripts/prepare_model.py)")
    p.add_argument(
        "--platform",
        default="torch_cpu",
        help="SGLANG_PLATFORM for the servers; empty keeps the environment's (a GPU machine)",
    )
    p.add_argument(
        "--reuse",
        default="",
        help="comma-separated policies whose finished run in --out is reused instead of rerun "
        "(to redo one failed arm; say so when reporting)",
    )
    p.add_argument(
        "--memory-wait-s",
        type=float,
        default=1800,
        help="before each start, wait up to this long for SGLang's host-memory reserve to be available",
    )
    p.add_argument(
        "--importance-config",
        default="",
        help="--radix-eviction-policy-config JSON for the importance policy (default: none, so the policy's defaults)",
    )
    default_workload, default_pools = FULL
    for name, value in asdict(default_workload).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None, help=f"default {value}")
    for name, value in asdict(default_pools).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None, help=f"default {value}")
    args = p.parse_args(argv)
    workload, pools = SMOKE if args.smoke else FULL
    args.workload = Workload(
        **{k: v if getattr(args, k) is None else getattr(args, k) for k, v in asdict(workload).items()}
    )
    args.pools = Pools(**{k: v if getattr(args, k) is None else getattr(args, k) for k, v in asdict(pools).items()})
    args.out = args.out.resolve()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model_path or model_path()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    started = time.time()
    reuse = {p.strip() for p in args.reuse.split(",") if p.strip()}
    rows = [
        saved_row(policy, args.out / policy)
        if policy in reuse
        else run_policy(policy, args.workload, args.pools, args, model)
        for policy in policies
    ]
    wall_s = time.time() - started

    streams = {tuple(r.pop("input_lens") or ()) for r in rows}
    same_stream = len(streams) == 1
    title = (
        f"{args.workload.num_prompts} requests, {args.workload.groups} system prompts x "
        f"{args.workload.system_prompt_len} tok (Zipf {args.workload.zipf_alpha}), "
        f"device {args.pools.max_total_tokens} tok, host x{args.pools.hicache_ratio:g}, file tier"
    )
    table = markdown(rows)
    meta = {
        "workload": asdict(args.workload),
        "pools": asdict(args.pools),
        "importance_config": args.importance_config or "defaults",
        "platform": args.platform,
        "smoke": args.smoke,
        # Per policy: the working tree can change between one server start and the next.
        "code": {r["policy"]: r["code"] for r in rows},
        "same_request_stream": same_stream,
        "wall_s": wall_s,
        "reused_runs": sorted(reuse),
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "results.md").write_text(f"{title}\n\n{table}\n")
    plot(rows, args.out / "results.png", title)
    print()
    print(title)
    print()
    print(table)
    print()
    print(f"same request stream for every policy: {same_stream}; wall time {wall_s:.0f}s")
    for policy, code in meta["code"].items():
        print(f"  {policy} server ran on {code}")
    print(f"wrote {args.out / 'results.md'}, results.json, results.png")
    failed = [r["policy"] for r in rows if r["completed"] != args.workload.num_prompts or r["errors"]]
    if failed or not same_stream:
        print(f"FAILED: incomplete runs {failed}, same stream {same_stream}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
