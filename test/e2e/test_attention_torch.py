"""importance_torch inside the real server: torch_native's tokens, plus a page table.

Two servers run one after the other on the embedded model with 16-token pages:
SGLang's torch_native, then importance_torch recording every second decode step and
dumping its page table (SGL_IMPORTANCE_DUMP_DIR).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_importance.client import flush_cache
from support.page_table_dump import read_dump
from support.server import output_ids_and_logprobs

pytestmark = pytest.mark.e2e

PAGE = 16
MAX_NEW = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    # Several full pages of prompt.
    "Here is a long shared context about tiered caches and attention. " * 8 + "Summary:",
]
# Float32 pinned: the same tokens as torch_native and batched as alone; in bfloat16 on a CPU
# with AMX tiles the rounding depends on the batch's shapes (the long prompt parted at its
# fourth token, 2026-11-28, before and after that day's changes).
SERVER_ARGS = ["--page-size", str(PAGE), "--dtype", "float32"]


@pytest.fixture(scope="module")
def native_outputs(launch):
    server = launch([*SERVER_ARGS, "--attention-backend", "torch_native"])
    outputs = [output_ids_and_logprobs(server.generate(p, MAX_NEW)) for p in PROMPTS]
    # One server at a time: stop before the importance server starts.
    server.stop()
    return outputs


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("page_table")


@pytest.fixture(scope="module")
def importance_server(launch, native_outputs, dump_dir):
    return launch(
        [*SERVER_ARGS, "--attention-backend", "importance_torch", "--importance-sample-interval", "2"],
        env={"SGL_IMPORTANCE_DUMP_DIR": str(dump_dir)},
    )


@pytest.fixture(scope="module")
def importance_run(importance_server, dump_dir):
    """Sequential requests, then the table as it stands after the last decode step."""
    outputs = [output_ids_and_logprobs(importance_server.generate(p, MAX_NEW)) for p in PROMPTS]
    decode_steps = sum(len(ids) - 1 for ids, _ in outputs)  # the first token comes from prefill
    state = read_dump(dump_dir, lambda s: s["steps"] >= decode_steps)
    return outputs, decode_steps, state


def test_greedy_tokens_are_identical_to_torch_native(native_outputs, importance_run):
    outputs, _, _ = importance_run
    for prompt, (native_ids, native_lp), (ids, lp) in zip(PROMPTS, native_outputs, outputs):
        assert ids == native_ids, prompt
        # Same math, different rounding: SDPA and the float32 reference each round
        # to bf16 once per layer, and 1-ulp differences compound over 30 layers.
        assert lp == pytest.approx(native_lp, abs=0.3), prompt


def test_every_second_decode_step_is_recorded(importance_run):
    _, decode_steps, state = importance_run
    assert state["sample_interval"] == 2 and state["page_size"] == PAGE
    assert state["steps"] >= decode_steps
    assert state["recorded_steps"] == (state["steps"] + 1) // 2


def test_attended_pages_receive_importance(importance_run):
    _, _, state = importance_run
    accumulated, last = state["accumulated"], state["last"]
    assert (accumulated >= 0).all() and (last >= 0).all()
    assert accumulated[0] == 0, "padding page 0 is never attended"
    # The long prompt alone fills more than six pages the radix cache keeps.
    assert int((accumulated > 0).sum()) >= 6
    # Requests ran one at a time and a step's masses sum to 1 per request; pages
    # freed since (unfinished tail pages) took their share with them.
    assert 0 < float(accumulated.sum()) <= state["recorded_steps"] + 1e-3


def test_batched_requests_get_the_tokens_they_get_alone(importance_server, importance_run):
    outputs, _, _ = importance_run
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: importance_server.generate(p, MAX_NEW), PROMPTS))
    for prompt, (ids, _), response in zip(PROMPTS, outputs, batched):
        assert output_ids_and_logprobs(response)[0] == ids, prompt


def test_flush_cache_forgets_all_page_importance(importance_server, dump_dir):
    before = read_dump(dump_dir, lambda s: s["recorded_steps"] > 0)
    r = flush_cache(importance_server.url)
    assert r.status_code == 200, r.text
    # Longer than a page: a request's unfinished last page is freed when it ends.
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    ids, _ = output_ids_and_logprobs(importance_server.generate(prompt, 9))
    after = read_dump(dump_dir, lambda s: s["steps"] >= before["steps"] + len(ids) - 1)
    recorded_since = after["recorded_steps"] - before["recorded_steps"]
    # Only the one request after the flush contributed (at most 1 per recorded step).
    assert 0 < float(after["accumulated"].sum()) <= recorded_since + 1e-3
    assert float(before["accumulated"].sum()) > recorded_since + 1


def test_a_cached_long_prompt_decodes_to_the_same_logprobs_alone_and_beside_others(importance_server):
    # Every prompt is cached first, so the four decode together from their first step; the
    # long one spans many of the C kernel's splits. A split sized by the batch (before
    # 2026-12-04) gave it other last bits beside the others (2.6e-6 in a logprob). The first
    # token comes from the extend, whose matmuls over the batch's rows may round otherwise
    # (the suite's 2 threads): decoded tokens only.
    filler = "The tiered cache keeps pages that attention reads often and moves the rest to the host. "
    long_prompt = "Notes on a long meeting. " + filler * 40 + "In one sentence, the notes say"
    others = ["A story. " + filler * n + "The end. Next" for n in (10, 30, 50)]

    def ask(prompt: str) -> tuple[list[int], list[float]]:
        return output_ids_and_logprobs(importance_server.generate(prompt, MAX_NEW))

    alone = ask(long_prompt)
    for prompt in others:
        ask(prompt)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, [long_prompt, *others]))[0]
    assert together[0] == alone[0]
    assert together[1][1:] == alone[1][1:]
