"""Requests longer than the device pool, in the real server: the hot set's rows borrowed from the
KV pool, the limits the server states and holds, and the pools back where they started.

Two servers on the embedded model in float32, one after the other: a dense one whose 4,096-token
pool holds the prompt whole, then the importance hot set (requests past 256 tokens; the guard
on, as the README's line) with a 1,024-token device pool, prefill chunks of a quarter of it and
HiCache's host pool at 4x, a ``file`` tier under it. The hot-set server takes a 2,400-token
prompt (2.4x its device pool): its prefill streams (every prompt token's logprob as dense's) and
it decodes on its hot set, the key ranges and codes of its pages in KV pages it borrowed and gave
back. Past the longest request it takes (what its device pool holds of one request's hot set
and rows, here), past the context, and a request whose own settings keep every page on the
device get an error naming why; aborted mid-prefill, a long request leaves nothing behind; the
server never reports a leak when idle.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_importance.client import generate, greedy, metrics_text
from sgl_importance.local_server import metric
from support.prompts import essay_text
from support.server import greedy_with_prompt_logprobs, importance_torch_args, prompt_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
DEVICE = 1024
LONG = 2400
MAX_NEW = 4
COMMON = ("--dtype", "float32", "--chunked-prefill-size", "256", "--enable-metrics")
HOT = importance_torch_args(
    PAGE, DEVICE, *COMMON, "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-storage-backend",
    "file", "--radix-eviction-policy", "importance", "--hot-set-policy", "importance", "--hot-set-threshold", "256",
)  # fmt: skip
LIMITS = re.compile(
    r"hot set: the longest request is (\d+) tokens \((.+?)\), the device pool holds (\d+) tokens, the host pool (\d+)"
)


@pytest.fixture(scope="module")
def prompt(token_ids) -> list[int]:
    return token_ids(essay_text(6), LONG)


@pytest.fixture(scope="module")
def dense(launch, prompt) -> dict:
    server = launch(importance_torch_args(PAGE, 4096, *COMMON))
    try:
        return greedy_with_prompt_logprobs(server.url, prompt, MAX_NEW, "long-0")
    finally:
        server.stop()  # one server at a time


@pytest.fixture(scope="module")
def hot(launch, dense, tmp_path_factory):
    storage = tmp_path_factory.mktemp("hicache")
    return launch(HOT, env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)})


def gauge(server, name: str) -> float:
    return metric(metrics_text(server.url), f"sgl_importance:hot_set_{name}")


def idle_and_clean(server) -> None:
    """The server idle (SGLang's leak check has run): no leak, no traceback, no row held."""
    time.sleep(3)
    log = server.log()
    assert "memory leak detected" not in log and "Traceback" not in log
    assert gauge(server, "borrowed_pages") == 0 and gauge(server, "range_rows_in_use") == 0


def test_the_server_states_its_limits_and_takes_requests_past_its_device_pool(hot):
    longest, bound, device, host = LIMITS.search(hot.log()).groups()
    assert int(device) == DEVICE - PAGE and 4 * int(device) <= int(host) <= 4 * DEVICE
    # Its hot set and rows (about 0.3 of a request in float32 with the guard) bind before the host pool.
    assert bound == "what the device pool holds of one request's hot set and rows", bound
    assert 2 * int(device) < LONG < int(longest) < int(host)
    assert "nothing set aside for its rows" in hot.log()


def test_a_prompt_longer_than_the_device_pool_prefills_as_dense_and_decodes(hot, dense, prompt):
    out = greedy_with_prompt_logprobs(hot.url, prompt, MAX_NEW, "long-0")
    assert len(out["output_ids"]) == MAX_NEW and out["meta_info"]["finish_reason"]["type"] == "length"
    got, want = prompt_logprobs(out)[1:], prompt_logprobs(dense)[1:]
    assert len(got) == LONG - 1
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst < 1e-3, f"prompt logprobs differ from dense prefill's by {worst}"
    assert out["output_ids"][0] == dense["output_ids"][0], "the first step reads every page, as dense"
    scrape = metrics_text(hot.url)
    assert metric(scrape, "sgl_importance:hot_set_prefill_chunks_released_total") >= 4
    assert metric(scrape, "sgl_importance:hot_set_steps_total") >= MAX_NEW - 1
    assert metric(scrape, "sgl_importance:hot_set_ranges_refused_total") == 0
    assert metric(scrape, "sgl_importance:hot_set_guard_refused_total") == 0
    idle_and_clean(hot)


def test_two_long_requests_at_once_both_get_rows_and_give_them_back(hot, prompt):
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda i: greedy_with_prompt_logprobs(hot.url, prompt[i:], MAX_NEW, f"two-{i}"), (0, 7)))
    assert all(len(o["output_ids"]) == MAX_NEW for o in outs)
    assert metric(metrics_text(hot.url), "sgl_importance:hot_set_ranges_refused_total") == 0
    idle_and_clean(hot)


def test_a_prompt_past_the_longest_request_is_refused_naming_the_flags(hot, token_ids):
    longest = int(LIMITS.search(hot.log()).group(1))
    ids = token_ids(essay_text(9), longest + 100)
    r = requests.post(hot.url + "/generate", json={"input_ids": ids, "sampling_params": greedy(2)}, timeout=300)
    assert r.status_code == 400 and str(longest - 5) in r.text, r.text
    assert "--hicache-ratio" in r.text and "--max-total-tokens" in r.text and "--hot-set-budget" in r.text


def test_a_prompt_past_the_context_gets_sglangs_error(hot, token_ids):
    ids = token_ids(essay_text(9), 8300)
    r = requests.post(hot.url + "/generate", json={"input_ids": ids, "sampling_params": greedy(2)}, timeout=300)
    assert r.status_code == 400 and "context length" in r.text, r.text


def test_a_request_that_keeps_every_page_is_refused_past_the_device_pool(hot, prompt):
    r = requests.post(
        hot.url + "/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {**greedy(2), "custom_params": {"hot_set": {"policy": "dense"}}},
        },
        timeout=300,
    )
    body = r.text
    assert "keeps every page" in body and "policy 'dense'" in body, body
    idle_and_clean(hot)


def test_a_long_request_aborted_mid_prefill_and_a_flush_leave_nothing_behind(hot, prompt):
    mark = len(hot.log())
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, hot.url, input_ids=prompt, sampling_params=greedy(4), rid="aborted", timeout=900)
        deadline = time.time() + 600
        while "Prefill batch" not in hot.log()[mark:] and time.time() < deadline:
            time.sleep(0.2)
        requests.post(hot.url + "/abort_request", json={"rid": "aborted"}, timeout=30)
        answer.result()
    # The answer can come back before the scheduler has dropped the aborted request; SGLang
    # refuses a flush (400) while it holds one. It must accept one soon after.
    deadline = time.time() + 60
    while (flushed := requests.post(hot.url + "/flush_cache", timeout=60)).status_code != 200:
        assert time.time() < deadline, flushed.text
        time.sleep(0.5)
    idle_and_clean(hot)
    short = generate(hot.url, input_ids=prompt[:100], sampling_params=greedy(2), timeout=300)
    assert len(short["output_ids"]) == 2
