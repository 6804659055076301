"""The hot set's pools inside the memory budget, in the real server.

Two servers on the embedded model, one after the other, with 16-token pages and a
2048-token device pool (``--max-total-tokens``): without a hot set (the KV pool
alone), then with the importance hot set for requests past 128 tokens and pools of
256 tokens (16 pages of key ranges and of key codes). The second's KV pool is smaller
by the whole pages that hold the pools' bytes (and the page importance table's); its
start-up line and ``/metrics`` state their size; a request whose full pages do not fit
in the pools is served dense with every page kept, and counted. No host pool: the
pools' size here is stated, not auto, and a server without one starts on a machine
short of RAM. The arithmetic reads the dtype the server picked from its log.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import requests

from sgl_importance.client import metrics_text
from sgl_importance.local_server import metric
from support.server import generate_ids, importance_torch_args

pytestmark = pytest.mark.e2e

PAGE = 16
DEVICE_TOKENS = 2048
GUARD_TOKENS = 256  # 16 pages
THRESHOLD = 128
MAX_NEW = 4
HOT_SET_ARGS = [
    "--hot-set-policy", "importance", "--hot-set-threshold", str(THRESHOLD), "--hot-set-budget", "0.5",
    "--hot-set-guard-tokens", str(GUARD_TOKENS), "--enable-metrics",
]  # fmt: skip


def server_tokens(server) -> int:
    """The KV pool's tokens as the scheduler reports them."""
    info = requests.get(server.url + "/server_info", timeout=60).json()
    return int(info["max_total_num_tokens"])


def model_shape(model_path: str, log: str) -> "KVShape":  # noqa: F821
    """The KV pool's shape from the model's config and the dtype the server's log names."""
    # Imported here: importing sgl_importance.hot_set at collection would import triton
    # before test/kernels/conftest.py sets TRITON_INTERPRET for the workers.
    from benchmark.long_context.bench_capacity import model_shape as shape_of

    config = json.loads((Path(model_path) / "config.json").read_text())
    return shape_of(config, re.search(r"KV Cache is allocated\. dtype: torch\.(\w+),", log).group(1))


@pytest.fixture(scope="module")
def kv_tokens_alone(launch) -> int:
    server = launch(importance_torch_args(PAGE, DEVICE_TOKENS))
    tokens = server_tokens(server)
    server.stop()  # one server at a time
    return tokens


@pytest.fixture(scope="module")
def guarded(launch, kv_tokens_alone):
    return launch(importance_torch_args(PAGE, DEVICE_TOKENS, *HOT_SET_ARGS))


def gauge(server, name: str) -> float:
    return metric(metrics_text(server.url), f"sgl_importance:hot_set_{name}")


def test_the_kv_pool_gives_up_the_pages_that_hold_the_guard_and_says_so(guarded, kv_tokens_alone, model_path):
    assert kv_tokens_alone == DEVICE_TOKENS
    log = guarded.log()
    from sgl_importance.hot_set.guard_budget import plan_guard

    shape = model_shape(model_path, log)
    expected = plan_guard(kv_tokens_alone, shape, guard_tokens=GUARD_TOKENS, ranges=True)
    assert expected.guard_pages == expected.range_pages == GUARD_TOKENS // PAGE and expected.kv_tokens_given_up > 0
    assert server_tokens(guarded) == expected.kv_tokens < kv_tokens_alone
    line = re.search(r"hot set: pools of .*", log).group(0)
    assert f"pools of {GUARD_TOKENS} tokens ({GUARD_TOKENS // PAGE} pages" in line
    assert f"{kv_tokens_alone} -> {expected.kv_tokens} (--max-total-tokens {DEVICE_TOKENS} bound it)" in line
    assert gauge(guarded, "guard_capacity_pages") == gauge(guarded, "range_capacity_pages") == GUARD_TOKENS // PAGE
    assert gauge(guarded, "guard_bytes") == expected.guard_bytes
    assert gauge(guarded, "range_bytes") == expected.range_bytes


def test_the_benchmarks_know_the_kv_pool_a_hot_set_servers_flags_make(guarded, model_path):
    # bench_capacity and bench_sessions give every server dense's host pool through a ratio
    # of the KV pool each server will make: their prediction against the server's own.
    from benchmark.long_context.bench_capacity import server_kv_tokens

    shape = model_shape(model_path, guarded.log())
    assert server_kv_tokens(DEVICE_TOKENS, shape, HOT_SET_ARGS) == server_tokens(guarded) < DEVICE_TOKENS
    assert server_kv_tokens(DEVICE_TOKENS, shape, []) == DEVICE_TOKENS


def filler(topic: str) -> str:
    return " ".join(f"Note {i} on {topic}: item {i} sits in box {i * 7 % 13} of row {i % 5}." for i in range(120))


def test_a_request_the_pools_cannot_hold_is_served_dense_and_counted(guarded, token_ids):
    refused_before = metric(metrics_text(guarded.url), "sgl_importance:hot_set_ranges_refused_total")
    # 12 full pages: within the pools' 16.
    small = generate_ids(guarded, token_ids(filler("apples"), 200), MAX_NEW, timeout=600)
    assert len(small["output_ids"]) == MAX_NEW
    assert 0 < gauge(guarded, "guard_pages_in_use") <= GUARD_TOKENS // PAGE
    assert 0 < gauge(guarded, "range_pages_in_use") <= GUARD_TOKENS // PAGE
    # 37 full pages: more than the pools hold, and they do not grow.
    large = generate_ids(guarded, token_ids(filler("pears"), 600), MAX_NEW, timeout=600)
    assert len(large["output_ids"]) == MAX_NEW
    after = metrics_text(guarded.url)
    assert metric(after, "sgl_importance:hot_set_ranges_refused_total") - refused_before == 1
    assert metric(after, "sgl_importance:hot_set_guard_capacity_pages") == GUARD_TOKENS // PAGE
    # The first request's rows went back when it left; the refused one holds none.
    assert metric(after, "sgl_importance:hot_set_guard_pages_in_use") == 0
    assert metric(after, "sgl_importance:hot_set_range_pages_in_use") == 0
    assert "no room in the key-range pool" in guarded.log()


def test_a_request_refused_ranges_goes_back_on_its_hot_set_once_rows_free_up(guarded, token_ids):
    # Two 12-page prompts over 16 rows: the second, sent while the first decodes, is refused;
    # once the first finishes (it generates fewer tokens) the second gets its rows back.
    import threading

    from sgl_importance.client import generate, greedy

    before = metrics_text(guarded.url)
    first_ids, second_ids = token_ids(filler("plums"), 200), token_ids(filler("figs"), 200)
    out = {}

    def ask(name: str, ids: list[int], new: int) -> None:
        out[name] = generate(guarded.url, input_ids=ids, sampling_params=greedy(new, ignore_eos=True), timeout=600)

    first = threading.Thread(target=ask, args=("first", first_ids, 40))
    first.start()
    deadline = time.time() + 300
    while gauge(guarded, "range_pages_in_use") == 0 and first.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    ask("second", second_ids, 48)  # 200 + 48 tokens: 15 full pages at most, within the 16 rows
    first.join()
    after = metrics_text(guarded.url)
    assert len(out["first"]["output_ids"]) == 40 and len(out["second"]["output_ids"]) == 48

    def delta(name: str) -> float:
        return metric(after, f"sgl_importance:hot_set_{name}_total") - metric(
            before, f"sgl_importance:hot_set_{name}_total"
        )

    assert delta("ranges_refused") == 1 and delta("ranges_regained") == 1
    # The first's rows went back; the second's wait for the next decode batch (its record is
    # dropped where a batch no longer holds it).
    assert 0 < metric(after, "sgl_importance:hot_set_range_pages_in_use") <= (200 + 48) // PAGE
