"""Host→device prefetch under ``importance`` in the real server (``cache/prefetch.py``).

A document that no eviction policy can keep: a 384-token document is asked three
questions (33 attended decode steps), then one 640-token prompt needs almost the
whole 768-token device pool, so the document is demoted to the host tier whatever
the policy. Then a short unrelated prompt arrives: its prefill batch is where the
prefetch acts — the document, demoted while it was the most important node, is
loaded back with that batch's load-back, evicting the 640-token prompt (attended
for one step, so less important). The document asked again then hits the device
tier. Without warming the same server loads it from the host tier
at admission instead (the default, where warming is off). Both servers give
identical greedy tokens.

Asserted from SGLang's per-request ``cached_tokens_details`` and from
``/metrics`` (``sgl_importance:prefetch_tokens_total``), not from internals.
"""

from __future__ import annotations

import json

import pytest

from sgl_importance.client import metrics_text
from sgl_importance.local_server import metric
from support.prompts import asked_document
from support.server import generate_ids, importance_torch_args

pytestmark = pytest.mark.e2e

PAGE = 16
DEVICE_TOKENS = 768
DOC_TOKENS = 384
QUESTION_TOKENS = 32
FLOOD_TOKENS = 640
SHORT_TOKENS = 48
COMMON = importance_torch_args(
    PAGE, DEVICE_TOKENS,
    "--enable-hierarchical-cache",
    "--hicache-ratio", "4",
    "--radix-eviction-policy", "importance",
    "--enable-metrics",
    "--enable-cache-report",
)  # fmt: skip


@pytest.fixture(scope="module")
def prompts(token_ids):
    facts = (f"Entry {i}: locker {i} holds {i * 11 % 89} blue marbles." for i in range(80))

    def question(i: int) -> str:
        return f" Question {i}: how many marbles are in locker {i * 5 + 2}? Answer:"

    ask = asked_document(token_ids, facts, DOC_TOKENS, question, QUESTION_TOKENS)
    flood = " ".join(f"Log line {j}: sensor {j % 17} read {j * 37 % 1000}." for j in range(200))
    short = " ".join(f"Say hello to guest number {j}." for j in range(20))
    return (
        [("document", ask(i), 12) for i in range(3)]
        + [("flood", token_ids(flood, FLOOD_TOKENS), 2), ("short", token_ids(short, SHORT_TOKENS), 4)]
        + [("document again", ask(7), 12)]
    )


def run(server, prompts) -> dict:
    try:
        outputs = [generate_ids(server, ids, n) for _, ids, n in prompts]
        text = metrics_text(server.url)
    finally:
        server.stop()
    return {
        "outputs": [o["output_ids"] for o in outputs],
        "details": [o["meta_info"].get("cached_tokens_details") or {} for o in outputs],
        "metrics": text,
        "log": server.log(),
    }


@pytest.fixture(scope="module")
def with_prefetch(launch, prompts):
    # Warming is opt-in: nodes demoted at >= a quarter of the hottest node's importance.
    config = json.dumps({"prefetch_min_importance": 0.25})
    return run(launch([*COMMON, "--radix-eviction-policy-config", config]), prompts)


@pytest.fixture(scope="module")
def without_prefetch(launch, prompts, with_prefetch):
    # The defaults: queued requests' host matches only, no warming.
    return run(launch(COMMON), prompts)


def test_the_flood_demotes_the_document_under_either_setting(with_prefetch, without_prefetch):
    for arm in (with_prefetch, without_prefetch):
        evicted = metric(arm["metrics"], "sgl_importance:evicted_tokens_total", tier="device")
        assert evicted >= DOC_TOKENS, arm["metrics"]


def test_prefetch_brings_the_document_back_to_the_device_before_it_is_asked(with_prefetch):
    last = with_prefetch["details"][-1]
    assert last["device"] >= DOC_TOKENS and last.get("host", 0) == 0, with_prefetch["details"]


def test_without_prefetch_the_document_comes_from_the_host_tier_at_admission(without_prefetch):
    last = without_prefetch["details"][-1]
    assert last["device"] < DOC_TOKENS and last["host"] > 0, without_prefetch["details"]


def test_metrics_count_the_warm_prefetch_as_issued_and_used(with_prefetch, without_prefetch):
    text = with_prefetch["metrics"]
    issued = metric(text, "sgl_importance:prefetch_tokens_total", reason="warm", outcome="issued")
    used = metric(text, "sgl_importance:prefetch_tokens_total", reason="warm", outcome="used")
    assert issued >= DOC_TOKENS and used >= DOC_TOKENS, text
    assert metric(text, "sgl_importance:prefetch_tokens_total", outcome="wasted") == 0
    assert metric(without_prefetch["metrics"], "sgl_importance:prefetch_tokens_total") == 0


def test_prefetch_never_changes_answers(with_prefetch, without_prefetch):
    assert with_prefetch["outputs"] == without_prefetch["outputs"]
    assert "importance prefetch failed" not in with_prefetch["log"]
