"""Admission by footprint through the real server: long generations decode together where
SGLang's charge of their whole length would have admitted half of them.

A hot-set server (HiCache's host pool, release past a 128-token threshold, the guard off)
on a small device pool gets ``REQUESTS`` short prompts that each generate ``NEW`` tokens
(``ignore_eos``), sent at once. Charged prompt + ``max_new_tokens`` (SGLang, and
``--hot-set-admission length``), fewer than half fit the KV pool at once; charged what
each keeps (``scheduler/admission.py``) all of them do. What must hold: every request is
answered with all its tokens; one decode step runs all of them; each was counted as
admitted by footprint; SGLang never had to retract one (the charge was not optimistic
past the pool); the log is clean.

With the guard on, the same requests' selections want pages they released. On the CPU a
guarded layer reads those from their host copies in the same step (none missed), so the hot
sets stay at the budget admission charged and all four still decode together. (Where misses
grow hot sets, a GPU's kernels, the grown ones go back to their budget before SGLang would
retract anyone, ``scheduler/decode_room.py``: unit tests, ``test_hot_set_admission.py`` and
``test_hot_set_release.py``.)
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_importance.client import flush_cache, generate, greedy, metrics_text
from sgl_importance.local_server import metric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
REQUESTS = 4
PROMPT = 64
NEW = 256
# Charged by length (prompt + new + a page: 336 tokens) the pool holds two at once; charged
# their footprint (a 2-page window, 13 pages guarded: footprint.py) it holds all four.
ARGS = [
    "--attention-backend", "importance_torch", "--enable-hierarchical-cache",
    "--max-total-tokens", "960", "--page-size", str(PAGE), "--dtype", "float32",
    "--hot-set-policy", "importance", "--hot-set-budget", "0.2", "--hot-set-threshold", "128",
    "--hot-set-window", "2",
    "--hot-set-guard-threshold", "1", "--enable-metrics", "--decode-log-interval", "1",
]  # fmt: skip
RUNNING = re.compile(r"Decode batch, #running-req: (\d+)")


def _decode_together(launch, token_ids, args: list[str]):
    server = launch(args)
    log_text = server.log()
    kv_tokens = int(re.search(r"max_total_num_tokens=(\d+)", log_text).group(1))
    by_length = kv_tokens // (PROMPT + NEW + PAGE)  # what SGLang's charge admits at once
    assert by_length * 2 <= REQUESTS, f"the pool ({kv_tokens} tokens) would hold {by_length} by length"
    prompts = [token_ids(f"Story number {i}: once upon a time in a quiet town, ", PROMPT) for i in range(REQUESTS)]
    flush_cache(server.url)
    mark = len(server.log())

    def run(ids: list[int]) -> dict:
        return generate(server.url, input_ids=ids, sampling_params=greedy(NEW, ignore_eos=True), timeout=1800)

    with ThreadPoolExecutor(REQUESTS) as pool:
        results = list(pool.map(run, prompts))

    assert [len(r["output_ids"]) for r in results] == [NEW] * REQUESTS
    log = server.log()[mark:]
    peak = max(int(n) for n in RUNNING.findall(log))
    assert peak == REQUESTS, f"at most {peak} of {REQUESTS} decoded at once"
    scrape = metrics_text(server.url)
    assert metric(scrape, "sgl_importance:hot_set_admitted_by_footprint_total") == REQUESTS
    assert metric(scrape, "sgl_importance:hot_set_footprint_refused_total") == 0
    assert metric(scrape, "sgl_importance:hot_set_pages_released_total") > 0
    assert not re.search(r"(?i)retract", log), [line for line in log.splitlines() if "etract" in line][:5]
    assert "Traceback" not in log and not re.search(r"\bERROR\b", log), log[-4000:]
    assert server.proc.poll() is None
    return scrape


def test_long_generations_are_admitted_by_what_they_keep_and_decode_together(launch_here, token_ids):
    scrape = _decode_together(launch_here, token_ids, ARGS)
    assert metric(scrape, "sgl_importance:hot_set_hot_sets_shrunk_total") == 0  # guard off: nothing grows


def test_guarded_selections_read_released_pages_from_the_host_and_nothing_grows(launch_here, token_ids):
    at = ARGS.index("--hot-set-guard-threshold")
    guarded = ARGS[:at] + ARGS[at + 2 :]  # the default guard
    scrape = _decode_together(launch_here, token_ids, guarded)
    assert metric(scrape, "sgl_importance:hot_set_guard_checks_total") > 0
    # The selections chose released pages and read them from their host copies: no miss, so no
    # hot set grew past what admission charged and none had to shrink; nobody was retracted.
    assert metric(scrape, "sgl_importance:hot_set_pages_guard_from_host_total") > 0
    assert metric(scrape, "sgl_importance:hot_set_pages_missed_total") == 0
    assert metric(scrape, "sgl_importance:hot_set_hot_sets_shrunk_total") == 0
    assert metric(scrape, "sglang:num_retracted_requests_total") == 0
