"""Eviction policy ``importance`` in the real server, against SGLang's ``lru``.

A workload where recency is the wrong signal: a 384-token document is asked three
questions (its pages are attended for 33 decode steps), then six one-off 192-token
prompts (one decode step each) flood a 768-token device pool, then the document is
asked again. Under ``lru`` the document is the oldest leaf and is demoted to the
host tier; under ``importance`` (reuse weight 0, so hits cannot be what saves it)
the one-off prompts go first and the document is still on the device. Requests are
sequential and greedy, so the outcome is deterministic; that it is importance that
decides was checked by rerunning ``importance`` with ``importance_weight=0``, which
demotes the document exactly like ``lru``.

Then ``/flush_cache`` empties device and host and the file tier is asked for the
document and for a one-off prompt: ``lru`` wrote both; ``importance`` with L3
admission (``storage_min_hits`` / ``storage_min_importance``) wrote the document
only. The ``importance`` server also serves its Prometheus series.

Both servers use the ``importance_torch`` backend and must give identical greedy tokens,
with ``lru``, with ``importance`` and computed from nothing cached: the ``lru`` server, last,
asks again the requests both served from a cached prefix, each under its own ``cache_salt``
(which matches nothing stored, in any tier: ``test_tenant_isolation.py``).
"""

from __future__ import annotations

import json

import pytest

from sgl_importance.client import flush_cache, generate, greedy, metrics_text
from sgl_importance.local_server import metric
from support.prompts import asked_document
from support.server import generate_ids, importance_torch_args, launch_and_fail

pytestmark = pytest.mark.e2e

PAGE = 16
DEVICE_TOKENS = 768
DOC_TOKENS = 384
QUESTION_TOKENS = 32
ONE_OFF_TOKENS = 192
# Reuse weight 0: hits must not be what keeps the document. L3 admission: a node
# reaches the file tier with 2 hits or a tenth of the hottest node's importance.
IMPORTANCE_CONFIG = {"reuse_weight": 0, "storage_min_hits": 2, "storage_min_importance": 0.1}
# Float32 pinned: greedy tokens must be equal whether a prefix came from the cache or was
# computed again; in bfloat16 on a CPU with AMX tiles the rounding depends on the shapes
# (the extend's length), and the outputs parted at the third token (seen 2026-11-28).
COMMON = importance_torch_args(PAGE, DEVICE_TOKENS, "--dtype", "float32")
TIERED = [
    "--enable-hierarchical-cache",
    "--hicache-ratio", "4",
    "--hicache-storage-backend", "file",
    # Below SGLang's default 256, so a one-off prompt can come back from the file tier.
    "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 64}',
    "--enable-cache-report",
]  # fmt: skip


@pytest.fixture(scope="module")
def prompts(token_ids):
    facts = (f"Fact {i}: the code word for room {i} is {chr(65 + i % 26)}{i * 7 % 97}." for i in range(80))

    def question(i: int) -> str:
        return f" Question {i}: what is the code word for room {i * 3 + 1}? Answer:"

    ask = asked_document(token_ids, facts, DOC_TOKENS, question, QUESTION_TOKENS)

    def one_off(i: int) -> list[int]:
        return token_ids(
            " ".join(f"Note {i}-{j}: item {i * 31 + j} weighs {j * 13 % 101} grams." for j in range(60)),
            ONE_OFF_TOKENS,
        )

    workload = (
        [("document", ask(i), 12) for i in range(3)]
        + [("one-off", one_off(i), 2) for i in range(6)]
        + [("document again", ask(9), 12)]
    )
    # After /flush_cache empties device and host: which of them does the file tier hold?
    from_storage = [("document", ask(10), 2), ("one-off", one_off(5), 2)]
    return workload, from_storage


def run_workload(server, prompts, read_metrics: bool = False, uncached: bool = False) -> dict:
    """Greedy output ids of the workload, where the last request's prefix came from, the
    storage hits of the document and a one-off after /flush_cache, the server's /metrics
    text when asked for and (``uncached``) the output ids of the requests served from a
    cached prefix, asked again under salts that match nothing."""
    workload, from_storage = prompts
    stored, metrics, fresh = {}, "", []
    try:
        outputs = [generate_ids(server, ids, n) for _, ids, n in workload]
        if read_metrics:
            metrics = metrics_text(server.url)
        r = flush_cache(server.url)
        assert r.status_code == 200, r.text
        for name, ids, n in from_storage:
            details = generate_ids(server, ids, n)["meta_info"].get("cached_tokens_details") or {}
            stored[name] = details.get("storage", 0)
        for i in served_from_cache(prompts) if uncached else ():
            _, ids, n = workload[i]
            out = generate(server.url, input_ids=ids, sampling_params=greedy(n), cache_salt=f"uncached-{i}")
            assert out["meta_info"]["cached_tokens"] == 0, out["meta_info"]
            fresh.append(out["output_ids"])
    finally:
        # One server at a time: the next arm starts only after this one stopped.
        server.stop()
    return {
        "outputs": [o["output_ids"] for o in outputs],
        "details": outputs[-1]["meta_info"].get("cached_tokens_details") or {},
        "stored": stored,
        "metrics": metrics,
        "uncached": fresh,
        "log": server.log(),
    }


def served_from_cache(prompts) -> list[int]:
    """Indices of the document requests after the first: their prefix is cached."""
    return [i for i, (name, _, _) in enumerate(prompts[0]) if name.startswith("document")][1:]


@pytest.fixture(scope="module")
def lru(launch, prompts, tmp_path_factory):
    storage = tmp_path_factory.mktemp("hicache-lru")
    server = launch(
        [*COMMON, *TIERED, "--radix-eviction-policy", "lru"],
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)},
    )
    return run_workload(server, prompts, uncached=True)


@pytest.fixture(scope="module")
def importance(launch, prompts, tmp_path_factory, lru):
    storage = tmp_path_factory.mktemp("hicache-importance")
    server = launch(
        [
            *COMMON,
            *TIERED,
            "--radix-eviction-policy", "importance",
            "--radix-eviction-policy-config", json.dumps(IMPORTANCE_CONFIG),
            "--enable-metrics",
        ],
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)},
    )  # fmt: skip
    return run_workload(server, prompts, read_metrics=True)


def test_lru_demotes_the_document_and_loads_it_back_from_the_host_tier(lru):
    details = lru["details"]
    assert details["device"] < DOC_TOKENS and details["host"] > 0, details
    assert details["device"] + details["host"] >= DOC_TOKENS, details


def test_importance_keeps_the_attended_document_on_the_device_under_one_off_pressure(lru, importance):
    details = importance["details"]
    assert details["device"] >= DOC_TOKENS, details
    assert details["device"] > lru["details"]["device"], (details, lru["details"])


def test_importance_runs_on_sglangs_python_tree_core_with_the_full_override(importance):
    log = importance["log"]
    assert "Using the Python TreeCore: custom components require the Python TreeCore" in log
    assert "no page importance is recorded" not in log


def test_metrics_show_folded_steps_and_device_evictions_of_unimportant_nodes(importance):
    text = importance["metrics"]
    assert metric(text, "sgl_importance:folded_steps_total") >= 3 * 11
    assert metric(text, "sgl_importance:importance_scale") > 0
    assert metric(text, "sgl_importance:attended_node_importance_count") > 0
    # The one-off prompts left the device, each at a small share of the hottest node.
    evicted = metric(text, "sgl_importance:evicted_tokens_total", tier="device")
    assert evicted >= 2 * ONE_OFF_TOKENS
    nodes = metric(text, "sgl_importance:evicted_node_importance_count", tier="device")
    low = metric(text, "sgl_importance:evicted_node_importance_bucket", tier="device", le="0.2")
    assert nodes > 0 and low == nodes, text
    assert metric(text, "sgl_importance:storage_tokens_total", decision="deferred") >= 6 * ONE_OFF_TOKENS


def test_lru_writes_every_prompt_to_the_file_tier(lru):
    stored = lru["stored"]
    assert stored["document"] >= DOC_TOKENS and stored["one-off"] > 0, stored


def test_l3_admission_keeps_one_off_prompts_out_of_the_file_tier_but_not_the_document(importance):
    stored = importance["stored"]
    assert stored["document"] >= DOC_TOKENS and stored["one-off"] == 0, stored


def test_greedy_outputs_are_identical_with_lru_importance_and_nothing_cached(prompts, lru, importance):
    assert importance["outputs"] == lru["outputs"]
    assert [lru["outputs"][i] for i in served_from_cache(prompts)] == lru["uncached"]


@pytest.mark.parametrize(
    "config,message",
    [
        ('{"decay": 1.5}', "--radix-eviction-policy-config decay=1.5 is invalid; allowed: a number in (0, 1)"),
        ('{"recency": 1}', "--radix-eviction-policy-config has unknown key(s) 'recency'"),
    ],
)
def test_a_bad_importance_config_stops_start_up_naming_the_flag(model_path, config, message):
    out = launch_and_fail(model_path, "--radix-eviction-policy", "importance", "--radix-eviction-policy-config", config)
    assert message in out
