"""Soak: mixed concurrent load on the importance configuration with host + storage tiers.

The load that once killed the scheduler (a deferred storage retry kept the id of a
radix node that host eviction had since deleted): a few hundred requests, 16 at a
time, prompts of 50-1,000 tokens built on shared prefixes, random output lengths,
greedy and sampled, a share streamed and dropped by the client mid-stream, on a
1,024-token device pool that pushes KV through the host tier into the `file` tier.

What must hold: every request that was not dropped by the client is answered 200;
the log has no traceback and SGLang's idle leak check stays silent; /health is green
at the end; the counters agree with each other and with what the client saw; and a
canary prompt's greedy output is the same before and after.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_importance.client import metrics_text
from sgl_importance.local_server import SERVED_NAME, metric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
DEVICE_TOKENS = 1024
# CI runs 24 (about a minute and a half on 2 cores: the 1,024-token pool serves one or
# two prompts at a time, so 150 took 9.5 minutes); SGL_IMPORTANCE_SOAK_REQUESTS=400
# runs the long soak by hand.
REQUESTS = int(os.environ.get("SGL_IMPORTANCE_SOAK_REQUESTS", "24"))
CONCURRENCY = 16
PREFIXES = 6
SEED = 9
# Output lengths stay small so prompt + output fits the 1,024-token pool.
MAX_NEW_TOKENS = 32
CANARY = "Name three primary colours."


def build_workload(token_ids, rng: random.Random) -> list[dict]:
    """Requests as dicts (kind, input ids, sampling); prompts of 50-1,000 tokens, 80 %
    of them opening with one of a few shared prefixes."""
    prefixes = [token_ids(f"Shared context number {i}. " * 40, rng.randint(64, 640)) for i in range(PREFIXES)]
    filler = token_ids("The quick brown fox jumps over the lazy dog while it rains. " * 80, 1000)
    work = []
    for i in range(REQUESTS):
        prefix = prefixes[rng.randrange(PREFIXES)] if rng.random() < 0.8 else []
        # Log-uniform over 50..1000 - MAX_NEW_TOKENS: short prompts dominate, as in chat.
        total = int(math.exp(rng.uniform(math.log(50), math.log(1000 - MAX_NEW_TOKENS))))
        tail_len = max(1, total - len(prefix))
        start = rng.randrange(len(filler) - tail_len) if tail_len < len(filler) else 0
        ids = (prefix + [(i % 500) + 1000] + filler[start : start + tail_len])[:total]
        sampling = {"max_new_tokens": rng.randint(1, MAX_NEW_TOKENS)}
        if rng.random() < 0.5:
            sampling["temperature"] = 0
        else:
            sampling.update(temperature=0.8, top_p=0.9)
        roll = rng.random()
        if roll < 0.15:
            kind = "abort"  # streamed, then dropped by the client after the first chunk
        elif roll < 0.3:
            kind = "stream"
        elif roll < 0.45:
            kind = "completions"
        else:
            kind = "generate"
        work.append({"kind": kind, "ids": ids, "sampling": sampling})
    return work


def send(url: str, item: dict) -> tuple[str, int, int]:
    """One request as its client would send it: (kind, HTTP status, prompt tokens)."""
    kind, ids, sampling = item["kind"], item["ids"], item["sampling"]
    if kind == "completions":
        body = {
            "model": SERVED_NAME,
            "prompt": ids,
            "max_tokens": sampling["max_new_tokens"],
            "temperature": sampling.get("temperature", 1.0),
            "top_p": sampling.get("top_p", 1.0),
        }
        r = requests.post(url + "/v1/completions", json=body, timeout=600)
        return kind, r.status_code, len(ids)
    body = {"input_ids": ids, "sampling_params": sampling, "stream": kind in ("stream", "abort")}
    with requests.post(url + "/generate", json=body, timeout=600, stream=body["stream"]) as r:
        if kind == "abort":
            for _ in r.iter_lines():
                break  # the client goes away mid-stream; closing drops the connection
        elif body["stream"]:
            lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == b"data: [DONE]", lines[-1:]
        else:
            _ = r.content  # read the whole answer, as a client would
        return kind, r.status_code, len(ids)


def wait_until_idle(server, timeout: float = 120) -> str:
    """The /metrics scrape once the gauges show nothing running or queued (or the last
    one at the deadline; the caller's assertions then say what was left)."""
    deadline = time.time() + timeout
    while True:
        scrape = metrics_text(server.url, timeout=30)
        idle = metric(scrape, "sglang:num_running_reqs") == 0 and metric(scrape, "sglang:num_queue_reqs") == 0
        if idle or time.time() > deadline:
            return scrape
        time.sleep(1)


def canary(server) -> list[int]:
    return server.generate(CANARY, max_new_tokens=16)["output_ids"]


def test_mixed_concurrent_load_with_storage_tier_serves_everything_and_leaks_nothing(launch_here, tmp_path, token_ids):
    storage = tmp_path / "hicache"
    storage.mkdir()
    server = launch_here(
        [
            "--page-size", str(PAGE),
            "--max-total-tokens", str(DEVICE_TOKENS),
            "--max-running-requests", str(CONCURRENCY),
            "--attention-backend", "importance_torch",
            "--radix-eviction-policy", "importance",
            "--enable-hierarchical-cache",
            "--hicache-storage-backend", "file",
            "--enable-metrics",
            "--enable-cache-report",
        ],
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)},
    )  # fmt: skip
    before = canary(server)
    # SGLang counts its own warm-up and health probes as requests too.
    requests_before = metric(metrics_text(server.url, timeout=30), "sglang:num_requests_total")
    work = build_workload(token_ids, random.Random(SEED))

    started = time.time()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda item: send(server.url, item), work))
    elapsed = time.time() - started

    statuses = Counter((kind, status) for kind, status, _ in results)
    failed = {k: n for k, n in statuses.items() if k[1] != 200}
    assert not failed, f"non-200 answers {failed}; log tail:\n{server.log()[-3000:]}"
    assert server.proc.poll() is None, server.log()[-3000:]

    # Idle: the scheduler runs its leak check once nothing is queued or running.
    wait_until_idle(server)
    time.sleep(3)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert canary(server) == before
    # The canary's answer can reach the client before the scheduler's next idle pass
    # republishes the running gauge, so wait for it again before reading the counters.
    scrape = wait_until_idle(server)

    log = server.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 :][:6000]
    assert "memory leak detected" not in log
    assert not re.search(r"\bERROR\b", log), [line for line in log.splitlines() if "ERROR" in line][:10]

    finished = sum(1 for kind, _, _ in results if kind != "abort")
    # Every request the client waited for was counted by the server (the dropped
    # ones may or may not have finished first), and nothing is left in flight.
    counted = metric(scrape, "sglang:num_requests_total") - requests_before - 1  # the second canary
    assert finished <= counted <= REQUESTS, (finished, counted)
    assert metric(scrape, "sglang:num_running_reqs") == 0
    assert metric(scrape, "sglang:num_queue_reqs") == 0
    prompt_tokens = metric(scrape, "sglang:prompt_tokens_total")
    cached = {
        src: metric(scrape, "sglang:cached_tokens_total", cache_source=src) for src in ("device", "host", "storage")
    }
    assert 0 < sum(cached.values()) <= prompt_tokens, (cached, prompt_tokens)
    for reason in ("waiting", "warm"):
        issued = metric(scrape, "sgl_importance:prefetch_tokens_total", reason=reason, outcome="issued")
        used = metric(scrape, "sgl_importance:prefetch_tokens_total", reason=reason, outcome="used")
        wasted = metric(scrape, "sgl_importance:prefetch_tokens_total", reason=reason, outcome="wasted")
        assert used + wasted <= issued, (reason, issued, used, wasted)
    evicted_device = metric(scrape, "sgl_importance:evicted_tokens_total", tier="device")
    assert evicted_device > 0, "the device pool never filled: the soak did not reach the tiers"
    assert any(storage.iterdir()), "nothing reached the file tier"
    print(
        "\nsoak: "
        + json.dumps(
            {
                "requests": REQUESTS,
                "seconds": round(elapsed, 1),
                "answers": {f"{k}:{s}": n for (k, s), n in sorted(statuses.items())},
                "prompt_tokens": prompt_tokens,
                "cached_tokens": cached,
                "evicted_device_tokens": evicted_device,
                "evicted_host_tokens": metric(scrape, "sgl_importance:evicted_tokens_total", tier="host"),
                "storage_files": sum(1 for _ in storage.iterdir()),
            }
        )
    )
