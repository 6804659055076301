"""SGLang's own load generator, ``python -m sglang.benchmark.serving``, against our server.

The server runs the ``importance`` eviction policy on the ``importance_torch`` backend
with the host tier and the ``file`` storage tier; the client sends a small
``generated-shared-prefix`` workload (two system prompts, four questions each) with
its prefix-cache report on, and writes its JSON result. Everything stays offline:
the client gets the local model folder as ``--model`` and ``--tokenizer`` (given a
served name only, it would ask the Hugging Face hub for a tokenizer), and its
``HOME`` is a temporary folder, so its generated-dataset cache
(``~/.cache/sglang/benchmark``) is written there.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from sgl_importance.client import load_generator, metrics_text
from sgl_importance.local_server import SERVED_NAME, metric

pytestmark = pytest.mark.e2e

PAGE = 16
GROUPS = 2
PROMPTS_PER_GROUP = 4
NUM_PROMPTS = GROUPS * PROMPTS_PER_GROUP
SYSTEM_PROMPT_TOKENS = 256
CONCURRENCY = 2
CLIENT_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def bench(launch, model_path, tmp_path_factory):
    """Run the client once against an importance server; its result, /metrics and log."""
    storage = tmp_path_factory.mktemp("hicache-file")
    server = launch(
        [
            "--page-size", str(PAGE),
            "--max-total-tokens", "2048",
            "--attention-backend", "importance_torch",
            "--radix-eviction-policy", "importance",
            "--enable-hierarchical-cache",
            "--hicache-ratio", "2",
            "--hicache-storage-backend", "file",
            "--enable-metrics",
            "--enable-cache-report",
        ],
        # SGLang's file backend reads this before --hicache-storage-backend-extra-config.
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)},
    )  # fmt: skip
    client_dir = tmp_path_factory.mktemp("bench-client")
    result_file = client_dir / "result.jsonl"
    workload = [
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", str(GROUPS),
        "--gsp-prompts-per-group", str(PROMPTS_PER_GROUP),
        "--gsp-system-prompt-len", str(SYSTEM_PROMPT_TOKENS),
        "--gsp-question-len", "32",
        "--gsp-output-len", "8",
        "--num-prompts", str(NUM_PROMPTS),
        "--max-concurrency", str(CONCURRENCY),
    ]  # fmt: skip
    cmd, env = load_generator(server.port, model_path, SERVED_NAME, workload, result_file, home=client_dir)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, cwd=client_dir)
    output = proc.stdout + proc.stderr
    try:
        metrics = metrics_text(server.url)
    finally:
        server.stop()
    assert proc.returncode == 0, output[-4000:]
    assert result_file.exists(), output[-4000:]
    result = json.loads(result_file.read_text().splitlines()[-1])
    return {
        "result": result,
        "output": output,
        "metrics": metrics,
        "log": server.log(),
        "storage": storage,
    }


def test_the_benchmark_client_completes_every_request_without_errors(bench):
    result = bench["result"]
    assert result["completed"] == NUM_PROMPTS, bench["output"][-4000:]
    assert not any(result["errors"]), result["errors"]
    assert result["total_output_tokens"] == NUM_PROMPTS * 8


def test_requests_after_the_first_of_a_group_hit_the_shared_system_prompt(bench):
    # A group's first request misses; with two requests in flight a second one of the
    # same group may be prefilled beside it and miss too. Every later one hits at
    # least the page-aligned system prompt.
    cached = bench["result"]["cached_tokens"]
    hits = [c for c in cached if c >= SYSTEM_PROMPT_TOKENS]
    assert len(hits) >= NUM_PROMPTS - CONCURRENCY * GROUPS, cached
    details = [d for d in bench["result"]["cached_tokens_details"] if d]
    # SGLang reports the storage backend's class: the plugin's integrity wrapper
    # around the configured `file` backend.
    assert details and all(d["storage_backend"] == "IntegrityStorage" for d in details), details


def test_the_servers_metrics_count_the_same_prefix_hits_as_the_client(bench):
    report = bench["result"]["cache_report"]
    device = metric(bench["metrics"], "sglang:cached_tokens_total", cache_source="device")
    host = metric(bench["metrics"], "sglang:cached_tokens_total", cache_source="host")
    storage = metric(bench["metrics"], "sglang:cached_tokens_total", cache_source="storage")
    assert report["total_cached_tokens"] > 0, report
    assert device + host + storage == report["total_cached_tokens"], (device, host, storage, report)


def test_the_importance_policy_was_active_and_the_file_tier_was_written(bench):
    assert metric(bench["metrics"], "sgl_importance:folded_steps_total") > 0
    assert "Using the Python TreeCore" in bench["log"]
    assert metric(bench["metrics"], "sglang:backuped_tokens_total") > 0
    assert any(bench["storage"].iterdir()), "nothing was written to the file tier"
