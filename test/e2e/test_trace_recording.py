"""--importance-trace-dir in the real server: same tokens, and a trace the simulator reads.

Two servers, one after the other, on the embedded model with 16-token pages and the
importance_torch backend: without recording, then recording into a trace directory.
The recording server is stopped with SIGTERM (its launcher SIGKILLs the scheduler);
the detached writer must still close a complete trace. Two of the sequential prompts
share their first whole pages, so the trace must show them sharing radix nodes.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.prefix import prepare_prefix, replay_prefix
from sgl_importance.trace.splits import resolve_splits
from sgl_importance.trace.table_io import read_accesses, read_all, read_meta
from support.server import output_ids_and_logprobs

pytestmark = pytest.mark.e2e

PAGE = 16
MAX_NEW = 12
SHARED = "Here is a long shared context about tiered caches and attention. " * 6
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    SHARED + "Summary:",
    SHARED + "In short, the key point is",
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
    tr = read_accesses(out)
    keys = tr.step * 1_000_003 + tr.request_id
    _, inverse = np.unique(keys, return_inverse=True)
    sums = np.bincount(inverse, weights=tr.importance.astype(np.float64))
    assert np.allclose(sums, 1.0, atol=1e-3), (sums.min(), sums.max())


def test_sequential_requests_record_every_decode_step_over_all_their_pages(recorded):
    responses, out = recorded
    tr = read_accesses(out)
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
    tr = read_accesses(out)
    labels = tr.columns()["request_id"]
    par = np.char.startswith(labels.astype(str), "par-")
    per_step = {s: len(set(labels[par & (tr.step == s)])) for s in np.unique(tr.step[par])}
    assert max(per_step.values()) > 1
    assert set(labels[par]) == {f"par-{i}" for i in range(len(CONCURRENT))}


# -- radix node ids and the requests table ------------------------------------------------


@pytest.fixture(scope="module")
def live(recorded):
    responses, out = recorded
    ts = read_all(out)
    requests, accesses = resolve_splits(ts.requests, ts.accesses)
    return responses, ts, requests, accesses


def _row(requests, rid):
    (i,) = np.flatnonzero(requests.labels().astype(str) == rid)
    return int(i)


def test_every_finished_request_has_one_row_with_the_servers_counts(live):
    responses, ts, requests, _ = live
    labels = list(requests.labels().astype(str))
    for rid in [f"seq-{i}" for i in range(len(PROMPTS))] + [f"par-{i}" for i in range(len(CONCURRENT))]:
        assert labels.count(rid) == 1, rid
    for i, response in enumerate(responses):
        r = _row(requests, f"seq-{i}")
        meta = response["meta_info"]
        n_out = len(response["output_ids"])
        assert requests.prompt_tokens[r] == meta["prompt_tokens"]
        assert requests.output_tokens[r] == n_out
        assert requests.cached_tokens[r] == meta["cached_tokens"]
        assert requests.arrival_step[r] <= requests.finish_step[r]
        assert 0 < requests.arrival_ns[r] < requests.finish_ns[r]
        # The path is what SGLang inserted at the finish: every whole page of prompt + output
        # (the last sampled token has no KV yet).
        _, tokens = requests.path(r)
        assert tokens.sum() == (meta["prompt_tokens"] + n_out - 1) // PAGE * PAGE


def test_requests_sharing_a_prefix_share_node_ids_and_pages_for_the_shared_pages(live):
    responses, ts, requests, accesses = live
    a, b = _row(requests, "seq-2"), _row(requests, "seq-3")
    # seq-3 arrived after seq-2 finished: SGLang matched the shared whole pages.
    shared_tokens = responses[3]["meta_info"]["cached_tokens"]
    assert shared_tokens >= 4 * PAGE
    ids_a, tok_a = requests.path(a)
    ids_b, tok_b = requests.path(b)
    ends_a, ends_b = np.cumsum(tok_a), np.cumsum(tok_b)
    assert shared_tokens in set(ends_a) and shared_tokens in set(ends_b)
    k = int(np.searchsorted(ends_a, shared_tokens)) + 1
    assert ids_a[:k].tolist() == ids_b[:k].tolist()
    assert ids_a[k:].size == 0 or ids_a[k] != ids_b[k]  # they part after the shared prefix
    labels = accesses.columns()["request_id"].astype(str)
    shared_pages = shared_tokens // PAGE
    views = {}
    for rid in ("seq-2", "seq-3"):
        rows = (labels == rid) & (accesses.position < shared_pages)
        views[rid] = {
            int(p): (int(n), int(pg))
            for p, n, pg in zip(accesses.position[rows], accesses.node_id[rows], accesses.page[rows])
        }
    assert len(views["seq-2"]) == len(views["seq-3"]) == shared_pages
    assert views["seq-2"] == views["seq-3"]  # same node id and same physical page, page by page
    assert all(n >= 0 for n, _ in views["seq-3"].values())


def test_each_access_row_names_a_node_on_its_requests_path(live):
    _, ts, requests, accesses = live
    labels = accesses.columns()["request_id"].astype(str)
    for i, rid in enumerate(requests.labels().astype(str)):
        rows = labels == rid
        if not rows.any():
            continue
        ids, _ = requests.path(i)
        named = set(accesses.node_id[rows].tolist()) - {-1}
        assert named <= set(ids.tolist()), rid
        # Whole prompt pages were inserted after prefill: they all have a node.
        prompt_pages = requests.prompt_tokens[i] // PAGE
        assert (accesses.node_id[rows & (accesses.position < prompt_pages)] >= 0).all(), rid


def test_the_prefix_regime_replays_the_live_trace_and_finds_the_servers_hits(live):
    responses, ts, requests, _ = live
    pd = prepare_prefix(ts.requests, ts.accesses)
    assert pd.has_importance
    _, hits = replay_prefix(pd, make_policy("lru"), pd.unique_tokens)
    # pd.request_id are codes (arrival order) into the labels of the table's string ids.
    by_rid = dict(zip(ts.requests.request_labels[pd.request_id].astype(str), hits.tolist()))
    # With room for everything, the replay hits exactly what the server matched
    # for requests that arrived after their prefix was inserted.
    for i in range(len(PROMPTS)):
        assert by_rid[f"seq-{i}"] == responses[i]["meta_info"]["cached_tokens"], i


def test_a_server_launched_with_no_page_size_or_backend_records_what_sglang_chose(launch, tmp_path):
    # SGLang 0.5.23 keeps its declared defaults beside the flags' fields (None when not
    # given): the recorder read page_size there, int(None), and the scheduler went down.
    out = tmp_path / "defaults"
    server = launch(["--importance-trace-dir", str(out)])
    assert len(server.generate(PROMPTS[0], MAX_NEW)["output_ids"]) == MAX_NEW
    server.stop()
    deadline = time.time() + 30
    while not read_meta(out).extra.get("complete") and time.time() < deadline:
        time.sleep(0.2)
    meta = read_meta(out)
    assert meta.page_size == 1 and meta.access_rows > 0  # SGLang's page on torch_cpu
    assert meta.extra["attention_backend"] == "importance_torch"
