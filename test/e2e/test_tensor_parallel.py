"""Eviction policy ``importance`` under tensor parallelism, in the real server.

Each tensor-parallel rank attends with its own heads, so each rank's page table
differs; the fold agrees on the values over the tree-cache group, so every rank's
tree evicts the same nodes. SGLang's rank consensus checker
(``SGLANG_ENABLE_RANK_CONSENSUS_CHECKER``) compares every rank's ``evict`` and
``match_prefix`` arguments and results and kills the scheduler on the first
divergence; here it runs under a device pool a few prompts fill, so the server
evicts while it serves.

The TP size is 3, not 2: SmolLM2-135M has 9 query and 3 KV heads, which 3 ranks
split evenly. With 2 ranks SGLang pads the heads for device ``cpu``
(``adjust_config_with_unaligned_cpu_tp``) but loads padded weights only on its
compiled CPU engine (``SGLANG_USE_CPU_ENGINE``), so the model cannot load on
torch_cpu. Three ranks on a 2-core machine are slow (seconds per decode step),
hence the short prompts and few tokens.

Greedy tokens must equal those of a single-rank server running the same workload.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_importance.client import generate, greedy, metrics_text
from sgl_importance.local_server import metric, start_with_retry
from support.server import Server, importance_torch_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TP = 3
PAGE = 16
DEVICE_TOKENS = 384
PROMPT_TOKENS = 64
NEW_TOKENS = 4
SEQUENTIAL = 6
CONCURRENT = 3
# Three ranks start in minutes on a busy 2-core machine, beyond conftest's default.
STARTUP_TIMEOUT_S = 900
COMMON = importance_torch_args(PAGE, DEVICE_TOKENS, "--radix-eviction-policy", "importance", "--enable-metrics")


def _bind_ranks(ranks: int) -> str:
    # SGLang's CPU ranks each need a core set; round-robin over the cores we may use.
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[i % len(cpus)]) for i in range(ranks))


@pytest.fixture(scope="module")
def prompts(model_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def ids(i: int) -> list[int]:
        text = " ".join(f"Note {i}.{j}: shelf {i * 13 + j} holds box {(i * 7 + j) % 31}." for j in range(12))
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(tokens) >= PROMPT_TOKENS
        return tokens[:PROMPT_TOKENS]

    return [ids(i) for i in range(SEQUENTIAL + CONCURRENT)]


def run_workload(server, prompts: list[list[int]]) -> dict:
    """Distinct prompts one by one, then a concurrent batch, then the first again.

    Together they hold several times the device pool, so nodes are evicted.
    """

    def output_ids(input_ids: list[int]) -> list[int]:
        # Generous: three ranks on two cores take seconds per decode step.
        out = generate(server.url, input_ids=input_ids, sampling_params=greedy(NEW_TOKENS), timeout=900)
        return out["output_ids"]

    outputs = [output_ids(p) for p in prompts[:SEQUENTIAL]]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        outputs += list(pool.map(output_ids, prompts[SEQUENTIAL:]))
    outputs.append(output_ids(prompts[0]))
    alive = requests.get(server.url + "/health_generate", timeout=300).status_code
    metrics = metrics_text(server.url)
    server.stop()  # free the cores for the next server
    return {"outputs": outputs, "alive": alive, "metrics": metrics, "log": server.log()}


def serve_workload(model_path, prompts, tmp_path_factory, args: list[str], env: dict) -> dict:
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = start_with_retry(lambda: Server(model_path, args, env, log), timeout=STARTUP_TIMEOUT_S)
    try:
        return run_workload(server, prompts)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def single(model_path, prompts, tmp_path_factory) -> dict:
    return serve_workload(model_path, prompts, tmp_path_factory, COMMON, {})


@pytest.fixture(scope="module")
def parallel(model_path, prompts, tmp_path_factory) -> dict:
    env = {
        "SGLANG_CPU_OMP_THREADS_BIND": _bind_ranks(TP),
        "SGLANG_ENABLE_RANK_CONSENSUS_CHECKER": "1",
    }
    args = [*COMMON, "--tp-size", str(TP)]
    return serve_workload(model_path, prompts, tmp_path_factory, args, env)


def test_tensor_parallel_ranks_evict_under_pressure_without_diverging(parallel):
    log = parallel["log"]
    assert "Rank consensus checker is enabled" in log
    assert "Found rank divergence" not in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert parallel["alive"] == 200
    assert all(len(out) == NEW_TOKENS for out in parallel["outputs"])
    text = parallel["metrics"]
    assert metric(text, "sgl_importance:folded_steps_total") > 0, text
    assert metric(text, "sgl_importance:evicted_tokens_total", tier="device") > 0, text


def test_tensor_parallel_greedy_tokens_equal_a_single_rank(single, parallel):
    assert parallel["outputs"] == single["outputs"]
