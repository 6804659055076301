"""Streamed prefill in the real server: a long prompt's pages leave the device chunk by chunk
and the output is dense prefill's.

Two servers on the embedded model in float32, one after the other, alike but for
``--hot-set-prefill``: the importance hot set for requests past 256 tokens, 128-token prefill
chunks, HiCache's host pool, ``/metrics`` on. The same 5 prompts (500-540 tokens: four to five
chunks) are sent one at a time to each with their rids pinned (the guard's page sample is
drawn by the rid): every prompt token's logprob (the prefill's output at each position) and
every greedy token must be equal; the streamed server must have released the middle chunks'
pages and never held much more than a chunk while it prefilled, where the other held the
whole prompt. A long prompt aborted mid-prefill leaves nothing of it behind. A third server,
streaming with ``--hot-set-first-step seeded``, prefills the same and reads its released pages back
far less (its first decode steps read their hot sets, not every page).
"""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_importance.client import flush_cache, generate, greedy, metrics_text
from sgl_importance.local_server import metric
from support.prompts import essay_text
from support.server import greedy_with_prompt_logprobs, importance_torch_args, prompt_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
CHUNK = 128
DEVICE_TOKENS = 4096
MAX_NEW = 4
PROMPTS = 5
ARGS = importance_torch_args(
    PAGE, DEVICE_TOKENS,
    "--dtype", "float32", "--chunked-prefill-size", str(CHUNK), "--enable-hierarchical-cache", "--enable-metrics",
    "--hot-set-policy", "importance", "--hot-set-threshold", "256",
)  # fmt: skip
# A prefill chunk with more to come (the last one's line is written after the first decode step,
# once the hot set was promoted).
USAGE = re.compile(r"Prefill batch, .*token usage: ([\d.]+), .*#pending-token: ([1-9]\d*),")
POOL = re.compile(r"the KV pool \d+ -> (\d+) tokens")


@pytest.fixture(scope="module")
def prompts(token_ids):
    ids = token_ids(essay_text(12), 40_000)
    return [ids[i * 1500 : i * 1500 + 500 + 10 * i] for i in range(PROMPTS)]


def run(launch, prompts, prefill: str, *extra: str) -> dict:
    server = launch([*ARGS, "--hot-set-prefill", prefill, *extra])
    try:
        outputs = []
        for i, ids in enumerate(prompts):
            out = greedy_with_prompt_logprobs(server.url, ids, MAX_NEW, f"streamed-{i}")
            outputs.append((out["output_ids"], prompt_logprobs(out)))
        aborted = abort_mid_prefill(server, prompts) if prefill == "stream" and not extra else None
        log = server.log()
        pool = int(POOL.search(log).group(1))
        usage = [float(u) * pool for u, _ in USAGE.findall(log)]
        scrape = metrics_text(server.url)
        names = ("prefill_chunks_released", "steps", "warmups", "pages_read_from_host")
        counts = {k: metric(scrape, f"sgl_importance:hot_set_{k}_total") for k in names}
        return {"outputs": outputs, "peak_tokens": max(usage), "pool": pool, "counts": counts, "aborted": aborted}
    finally:
        server.stop()  # one server at a time


def abort_mid_prefill(server, prompts) -> dict:
    """A long prompt aborted (``/abort_request``) once some of its chunks left the device,
    then a short request: what the hot set still holds after it."""
    long_prompt = sum(prompts[:5], [])[:2400]  # 19 chunks
    # Its first prompt's pages may still sit in the tree: matched, they would stay on the device
    # under the aborted request's lock (and be counted in its peak), so it starts from nothing.
    assert flush_cache(server.url)
    mark = len(server.log())
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            generate, server.url, input_ids=long_prompt, sampling_params=greedy(4), rid="aborted", timeout=900
        )
        deadline = time.time() + 300
        # Aborted after its fourth chunk: the log's count of its chunks (the counter moves at decode steps).
        while len(USAGE.findall(server.log()[mark:])) < 4 and not answer.done() and time.time() < deadline:
            time.sleep(0.1)
        requests.post(server.url + "/abort_request", json={"rid": "aborted"}, timeout=60).raise_for_status()
        try:
            finish = answer.result()["meta_info"]["finish_reason"]["type"]
        except requests.HTTPError as e:  # SGLang answers an aborted request with an error status
            finish = f"http {e.response.status_code}"
    after = generate(server.url, input_ids=prompts[0][:64], sampling_params=greedy(2), timeout=300)
    scrape = metrics_text(server.url)
    gauges = {k: metric(scrape, f"sgl_importance:hot_set_{k}") for k in ("range_rows_in_use", "tracked_requests")}
    chunks = len(USAGE.findall(server.log()[mark:]))
    return {"chunks": chunks, "finish": finish, "after": after["output_ids"], **gauges}


@pytest.fixture(scope="module")
def dense_prefill(launch, prompts):
    return run(launch, prompts, "dense")


@pytest.fixture(scope="module")
def streamed(launch, prompts, dense_prefill):
    return run(launch, prompts, "stream")


def test_a_streamed_prefill_writes_what_a_dense_one_writes_and_decodes_the_same_tokens(streamed, dense_prefill):
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(
        zip(streamed["outputs"], dense_prefill["outputs"])
    ):
        assert logprobs == want_logprobs, f"prompt {i}: the prefill's output differs"
        assert tokens == want_tokens, f"prompt {i}"
    # Both decoded on their hot sets; only one streamed: four to six chunks, the last kept.
    assert streamed["counts"]["steps"] > 0 and dense_prefill["counts"]["steps"] > 0
    assert streamed["counts"]["prefill_chunks_released"] >= 3 * PROMPTS
    assert dense_prefill["counts"]["prefill_chunks_released"] == 0


def test_a_streamed_prefill_holds_about_a_chunk_of_the_device(streamed, dense_prefill, prompts):
    # What the server's own "token usage" said for each chunk with more to come: a chunk, the
    # sinks and window the hot set keeps (1 + 4 pages by default), a partial page and the KV
    # pages the released pages' rows borrow (a token slot of key range and 1/15 of a page of
    # codes each in float32, and a page of stock for each store), within the line's rounding
    # (a hundredth of the pool). Dense held four chunks at its longest prompts' fifth.
    # Imported here, not at the top: collected before test/kernels/conftest.py sets
    # TRITON_INTERPRET, a module-level import would build the Triton kernels for a GPU in this worker.
    from sgl_importance.hot_set.guard.key_codes import code_rows_per_page

    full = max(len(ids) for ids in prompts) // PAGE
    rows = math.ceil(full / PAGE) + math.ceil(full / code_rows_per_page(4)) + 2
    assert streamed["peak_tokens"] <= CHUNK + (6 + rows) * PAGE + streamed["pool"] / 100
    assert dense_prefill["peak_tokens"] >= 4 * CHUNK


def test_a_request_aborted_mid_prefill_leaves_nothing_behind(streamed):
    # Some of its chunks had left the device; the server goes on, its pools empty again
    # (its key ranges back; SGLang's own checks and the host-slot ledger would have failed it
    # had a page been freed twice).
    aborted = streamed["aborted"]
    assert 4 <= aborted["chunks"] < 18 and aborted["finish"] in ("abort", "http 400")
    assert len(aborted["after"]) == 2
    assert aborted["range_rows_in_use"] == 0 and aborted["tracked_requests"] == 0


@pytest.fixture(scope="module")
def seeded(launch, prompts, streamed):
    return run(launch, prompts, "stream", "--hot-set-first-step", "seeded")


def test_a_first_step_seeded_by_the_streamed_prefill_reads_its_hot_set_not_the_whole_prompt(seeded, streamed):
    # ``--hot-set-first-step seeded``: the prefill is the same (every prompt token's logprob, the
    # first token); no request's first step was a dense warm-up, and the released pages read
    # back from the host over the whole run are fewer than the streamed server's first steps'.
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(seeded["outputs"], streamed["outputs"])):
        assert logprobs == want_logprobs and tokens[:1] == want_tokens[:1], f"prompt {i}"
    assert streamed["counts"]["warmups"] >= PROMPTS and seeded["counts"]["warmups"] == 0
    assert seeded["counts"]["prefill_chunks_released"] >= 3 * PROMPTS
    assert seeded["counts"]["pages_read_from_host"] < streamed["counts"]["pages_read_from_host"] / 2
