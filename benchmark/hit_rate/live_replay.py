"""Replay a scaled production slice against a live server: closed loop or on the trace's clock.

One arm = one fresh ``python -m sglang.launch_server`` (torch_cpu, the embedded model,
``--page-size 16``, a ``--max-total-tokens`` device pool, ``importance_torch`` attention
for every policy so only the eviction order differs, ``--enable-cache-report``;
optionally HiCache with a host pool and the ``file`` tier). Each request is a streamed
greedy ``/generate`` of the slice's token ids; its first chunk gives the TTFT, its
last the cached prompt tokens by tier (SGLang's ``cached_tokens_details``: device,
host, storage).

- closed loop: ``concurrency`` clients, each sending the next request when its last
  one finished (1: requests in trace order, one at a time: what the page model replays);
- open loop: request i is sent ``arrival_s[i] * time_scale`` seconds after the start,
  whatever is still running (the trace's clock, scaled to what this machine serves).
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import requests

from benchmark.hit_rate.production_trace import ScaledRequest
from benchmark.serving.bench_policies import wait_for_host_memory
from sgl_importance.client import greedy, stream_generate
from sgl_importance.local_server import HOST_MEMORY, PORT_CLASH, LocalServer, start_with_retry

TIERS = ("device", "host", "storage")
# How long a HiCache arm waits for host memory other processes hold (a shared machine).
HOST_MEMORY_WAIT_S = 1800


@dataclass(frozen=True)
class Arm:
    """A server configuration: ``--radix-eviction-policy`` and its config JSON."""

    name: str
    policy: str
    config: Optional[dict] = None

    @classmethod
    def parse(cls, spec: str) -> "Arm":
        """``lru``, ``slru``, ``importance`` or ``name=policy:{json config}``."""
        name, _, rest = spec.partition("=")
        if not rest:
            rest = name
        policy, _, config = rest.partition(":")
        return cls(name, policy, json.loads(config) if config else None)


@dataclass
class Loop:
    """How requests are sent: ``open`` on the trace's clock times ``time_scale``, or closed."""

    open: bool = False
    time_scale: float = 0.05
    concurrency: int = 1
    new_tokens: int = 4


@dataclass
class ArmResult:
    arm: str
    pool: int
    per_request: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    failed: int = 0

    def summary(self) -> dict:
        rows = self.per_request
        ttft = sorted(r["ttft_ms"] for r in rows) or [0.0]
        return {
            "arm": self.arm,
            "pool": self.pool,
            "requests": len(rows),
            "failed": self.failed,
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "cached": sum(r["cached"] for r in rows),
            **{t: sum(r[t] for r in rows) for t in TIERS},
            "ttft_mean_ms": statistics.fmean(ttft),
            "ttft_p50_ms": ttft[len(ttft) // 2],
            "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "seconds": self.seconds,
        }


def server_args(arm: Arm, pool: int, hicache: bool, hicache_ratio: float) -> list[str]:
    args = [
        "--page-size", "16",
        "--max-total-tokens", str(pool),
        "--attention-backend", "importance_torch",
        "--radix-eviction-policy", arm.policy,
        "--enable-cache-report",
    ]  # fmt: skip
    if arm.config:
        args += ["--radix-eviction-policy-config", json.dumps(arm.config)]
    if hicache:
        args += [
            "--enable-hierarchical-cache",
            "--hicache-ratio", str(hicache_ratio),
            "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete",
        ]  # fmt: skip
    return args


def send(url: str, ids: Sequence[int], new_tokens: int, timeout: float = 600) -> dict:
    """One streamed greedy request: its TTFT and the cache report."""
    ttft, last = stream_generate(
        url,
        timeout=timeout,
        input_ids=list(ids),
        sampling_params=greedy(new_tokens, ignore_eos=True),
        return_cached_tokens_details=True,
    )
    meta = last["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    cached = int(meta.get("cached_tokens", 0))
    row = {"ttft_ms": 1000 * ttft, "prompt_tokens": int(meta["prompt_tokens"]), "cached": cached}
    row.update({t: int(details.get(t, 0)) for t in TIERS})
    if not details:
        row["device"] = cached
    return row


def replay(url: str, slice_: Sequence[ScaledRequest], loop: Loop, progress: bool = True) -> ArmResult:
    """Send the slice to a running server; the per-request rows in slice order."""
    rows: list[Optional[dict]] = [None] * len(slice_)
    failed = [0]
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(i: int) -> None:
        if loop.open:
            delay = slice_[i].arrival_s * loop.time_scale - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
        try:
            rows[i] = {"i": i, **send(url, slice_[i].token_ids, loop.new_tokens)}
        except requests.RequestException as e:
            with lock:
                failed[0] += 1
            print(f"  request {i} failed: {e}", flush=True)
        if progress and (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(slice_)} sent, {time.perf_counter() - t0:.0f}s", flush=True)

    width = len(slice_) if loop.open else loop.concurrency
    with ThreadPoolExecutor(max_workers=max(1, min(width, 256))) as pool:
        list(pool.map(one, range(len(slice_))))
    result = ArmResult("", 0, [r for r in rows if r is not None], time.perf_counter() - t0, failed[0])
    return result


def run_arm(
    model: str,
    arm: Arm,
    pool: int,
    slice_: Sequence[ScaledRequest],
    loop: Loop,
    run_dir: Path,
    hicache: bool = False,
    hicache_ratio: float = 2.0,
) -> ArmResult:
    """Start a server for ``arm`` with a ``pool``-token device pool, replay, stop it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = {"OMP_NUM_THREADS": "1"}
    if hicache:
        (run_dir / "hicache").mkdir()
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(run_dir / "hicache")
    args = server_args(arm, pool, hicache, hicache_ratio)

    def make() -> LocalServer:
        if hicache:  # SGLang refuses a host pool while 10 GiB are not free: wait for them
            wait_for_host_memory(arm.name, HOST_MEMORY_WAIT_S)
        return LocalServer(model, args, run_dir / "server.log", env)

    server = start_with_retry(make, attempts=4, retry_on=(PORT_CLASH, HOST_MEMORY), pause_s=10, label=arm.name)
    try:
        result = replay(server.url, slice_, loop)
    finally:
        server.stop()
    result.arm, result.pool = arm.name, pool
    (run_dir / "requests.json").write_text(json.dumps(result.per_request))
    return result
