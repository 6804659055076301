"""--importance-trace-dir in the real server: same tokens, and a trace the simulator reads.

Two servers, one after the other, on the embedded model with 16-token pages and the
importance_torch backend: without recording, then recording into a trace directory.
The recording server is stopped with SIGTERM (its launcher SIGKILLs the scheduler);
the detached writer must still close a complete trace.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import output_ids_and_logprobs
from sgl_importance.trace.format import read_meta, read_trace

pytestmark = pytest.mark.e2e

PAGE = 16
MAX_NEW = 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a long shared context about tiered caches and attention. " * 6 + "Summary:",
]
CONCURRENT = ["Write a haiku about the sea.", "List three prime numbers:", "Explain what a KV cache is."]
SERVER_ARGS = ["--page-size", str(PAGE), "--attention-backend", "importance_torch"]


@pytest.fixture(scope="module")
def plain_outputs(launch):
    server = launch(SERVER_ARGS)
    outputs = [output_ids_and_logprobs(server.generate(p, MAX_NEW))[0] for p in PROMPTS]
    server.stop()
    return outputs


@pytest.fixture(scope="module")
def recorded(launch, plain_outputs, tmp_path_factory):
    """Sequential requests (named rids), then concurrent ones; then SIGTERM and the closed trace."""
    out = tmp_path_factory.mktemp("trace") / "live"
    server = launch([*SERVER_ARGS, "--importance-trace-dir", str(out)])
    responses = [server.generate(p, MAX_NEW, rid=f"seq-{i}") for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        list(pool.map(lambda ip: server.generate(ip[1], MAX_NEW, rid=f"par-{ip[0]}"), enumerate(CONCURRENT)))
    server.stop()
    deadline = time.time() + 30
    while not read_meta(out).extra.get("complete") and time.time() < deadline:
        time.sleep(0.2)
    return responses, out


def test_recording_leaves_greedy_tokens_unchanged(plain_outputs, recorded):
    responses, _ = recorded
    assert [output_ids_and_logprobs(r)[0] for r in responses] == plain_outputs


def test_trace_is_closed_after_sigterm_of_the_launcher(recorded):
    _, out = recorded
    meta = read_meta(out)
    assert meta.extra.get("complete") is True, meta
    assert meta.access_rows > 0 and meta.dropped_rows == 0
    assert meta.page_size == PAGE


def test_each_step_of_a_request_has_importance_summing_to_one(recorded):
    _, out = recorded
    tr = read_trace(out)
    keys = tr.step * 1_000_003 + tr.request_id
    _, inverse = np.unique(keys, return_inverse=True)
    sums = np.bincount(inverse, weights=tr.importance.astype(np.float64))
    assert np.allclose(sums, 1.0, atol=1e-3), (sums.min(), sums.max())


def test_sequential_requests_record_every_decode_step_over_all_their_pages(recorded):
    responses, out = recorded
    tr = read_trace(out)
    labels = tr.columns()["request_id"]
    for i, response in enumerate(responses):
        mine = labels == f"seq-{i}"
        n_out = len(response["output_ids"])
        prompt = response["meta_info"]["prompt_tokens"]
        steps = np.unique(tr.step[mine])
        # The first token comes from prefill; each later one from a decode step.
        assert len(steps) == n_out - 1
        last = mine & (tr.step == steps.max())
        assert sorted(tr.position[last]) == list(range(math.ceil((prompt + n_out - 1) / PAGE)))
        # A request's pages keep their physical ids from step to step.
        first = mine & (tr.step == steps.min())
        kept = dict(zip(tr.position[first], tr.page[first]))
        assert all(kept[p] == pg for p, pg in zip(tr.position[last], tr.page[last]) if p in kept)


def test_concurrent_requests_share_steps_in_the_trace(recorded):
    _, out = recorded
    tr = read_trace(out)
    labels = tr.columns()["request_id"]
    par = np.char.startswith(labels.astype(str), "par-")
    per_step = {s: len(set(labels[par & (tr.step == s)])) for s in np.unique(tr.step[par])}
    assert max(per_step.values()) > 1
    assert set(labels[par]) == {f"par-{i}" for i in range(len(CONCURRENT))}
