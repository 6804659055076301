"""Streamed prefill and returning turns on ``importance_triton`` in the real server: SGLang's
Triton extend kernel reads a prompt's released pages, and a returning turn's history, from staged
host copies (``attention/released_prefix.py``), and the output is dense prefill's.

Its kernels run under Triton's interpreter on this CPU (as in ``test_attention_triton.py``), so
the model is the two-layer Llama with random weights, in float32. Two servers, one after the
other, alike but for ``--hot-set-prefill`` (a history is read from the host pool only where
prompts stream): the importance hot set for requests past 128 tokens, 64-token prefill chunks,
HiCache's host pool with ``file`` storage, ``--radix-eviction-policy importance``, ``/metrics``.

- The same prompts (305-200 tokens, the first past the 256 tokens SGLang prefetches from
  storage at the least, for the returning turn: four to five chunks; the interpreter's extend costs grow
  with the square of a prompt's length) go to each, one at a time, rids pinned:
  every prompt token's logprob and every greedy token must be equal, and the streamed server must
  have released the middle chunks' pages (so its later chunks read them from the host) where the
  other released none.
- Then all of them at once (one prefilling while others decode, the scheduler's batches as they
  fall): the same tokens, the logprobs within float32 rounding (the batches differ from run to run).
  Several requests' staged prefixes in one extend are held by ``test/kernels/test_released_prefix.py``.
- Then a returning turn: once the first prompt's pages are in the file tier, ``/flush_cache``
  empties device and host, and the prompt, its answer and a question come back; the history is
  brought back from storage into the host pool, where the streaming server reads it (never loading
  it back whole: ``history_pages_on_host``) and the other loads it back. Its logprobs past the
  history and its tokens must be equal.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_importance.client import flush_cache, metrics_text
from sgl_importance.local_server import metric
from support.prompts import essay_text
from support.server import greedy_with_prompt_logprobs, importance_torch_args, prompt_logprobs
from support.storage import settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
CHUNK = 64
MAX_NEW = 4
PROMPTS = 4
QUESTION = 40
ARGS = [
    *importance_torch_args(PAGE, 4096, "--dtype", "float32", "--chunked-prefill-size", str(CHUNK)),
    "--attention-backend", "importance_triton",  # the later flag wins
    "--radix-eviction-policy", "importance", "--enable-hierarchical-cache", "--hicache-ratio", "4",
    "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
    "--enable-metrics", "--hot-set-policy", "importance", "--hot-set-threshold", "128",
]  # fmt: skip


@pytest.fixture(scope="module")
def prompts(token_ids):
    ids = token_ids(essay_text(6), 20_000)
    return [ids[i * 1000 : i * 1000 + 305 - 35 * i] for i in range(PROMPTS)] + [ids[-QUESTION:]]


def run(launch, tmp_path_factory, model: str, prompts, prefill: str) -> dict:
    storage = tmp_path_factory.mktemp(f"hicache_{prefill}")
    args = ["--model-path", model, *ARGS, "--hot-set-prefill", prefill]
    server = launch(args, env={"TRITON_INTERPRET": "1", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)})
    prompts, question = prompts[:-1], prompts[-1]
    try:

        def ask(i: int, ids: list[int], tag: str) -> tuple[list[int], list[float]]:
            out = greedy_with_prompt_logprobs(server.url, ids, MAX_NEW, f"{tag}-{i}")
            return out["output_ids"], prompt_logprobs(out)[1:]  # the first prompt token has none

        alone = [ask(i, ids, "alone") for i, ids in enumerate(prompts)]
        with ThreadPoolExecutor(PROMPTS) as pool:
            together = list(pool.map(lambda a: ask(*a, "together"), enumerate(prompts)))
        scrape = metrics_text(server.url)
        names = ("prefill_chunks_released", "steps", "pages_read_from_host", "history_pages_on_host")
        counts = {k: metric(scrape, f"sgl_importance:hot_set_{k}_total") for k in names}
        # The returning turn: its history only in the file tier, brought back into the host pool.
        history = prompts[0] + alone[0][0]
        assert settled(storage), "nothing was written to the file tier"
        assert flush_cache(server.url).status_code == 200
        out = greedy_with_prompt_logprobs(server.url, history + question, MAX_NEW, "returning", start=len(history))
        returning = {
            "tokens": out["output_ids"],
            "logprobs": prompt_logprobs(out)[1:],
            "cached": out["meta_info"]["cached_tokens"],
            "history_on_host": metric(metrics_text(server.url), "sgl_importance:hot_set_history_pages_on_host_total")
            - counts["history_pages_on_host"],
        }
        assert "Traceback" not in server.log()
        return {"alone": alone, "together": together, "counts": counts, "returning": returning}
    finally:
        server.stop()  # one server at a time


@pytest.fixture(scope="module")
def dense_prefill(launch, tmp_path_factory, tiny_model, prompts):
    return run(launch, tmp_path_factory, tiny_model, prompts, "dense")


@pytest.fixture(scope="module")
def streamed(launch, tmp_path_factory, tiny_model, prompts, dense_prefill):
    return run(launch, tmp_path_factory, tiny_model, prompts, "stream")


def test_the_triton_extend_over_staged_host_pages_writes_what_a_dense_prefill_writes(streamed, dense_prefill):
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(
        zip(streamed["alone"], dense_prefill["alone"], strict=True)
    ):
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5), f"prompt {i}: the prefill's output differs"
        assert tokens == want_tokens, f"prompt {i}"
    assert streamed["counts"]["prefill_chunks_released"] >= 2 * 2 * PROMPTS
    assert dense_prefill["counts"]["prefill_chunks_released"] == 0
    # The first decode step read the released pages back, as importance_torch's does.
    assert streamed["counts"]["pages_read_from_host"] > 0


def test_requests_sent_together_stream_the_same(streamed, dense_prefill):
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(
        zip(streamed["together"], dense_prefill["together"])
    ):
        assert logprobs == pytest.approx(want_logprobs, rel=1e-5, abs=1e-5), f"prompt {i}"
        assert tokens == want_tokens, f"prompt {i}"


def test_a_returning_turn_reads_its_history_from_the_host_pool_and_prefills_the_same(streamed, dense_prefill):
    got, want = streamed["returning"], dense_prefill["returning"]
    # Both matched the history brought back from the file tier; only one read it from the host.
    history = len(streamed["alone"][0][1]) + 1
    assert got["cached"] >= history - PAGE and want["cached"] >= history - PAGE
    assert got["history_on_host"] >= history // PAGE - 1 and want["history_on_host"] == 0
    assert len(got["logprobs"]) == len(want["logprobs"]) >= QUESTION - 1
    assert got["logprobs"] == pytest.approx(want["logprobs"], rel=1e-5, abs=1e-5)
    assert got["tokens"] == want["tokens"]
