"""A returning turn on ``importance_triton`` in the real server: its history, brought back from the
``file`` tier into the host pool, is read from there by SGLang's Triton extend kernel (staged with
the resident pages, ``attention/released_prefix.py``), never loaded back whole into device pages,
and the new turn's prefill writes what it writes after a load-back.

Under Triton's interpreter on this CPU, so the two-layer random Llama in float32. Two servers, one
after the other, alike but for ``--hot-set-prefill`` (a history is read from the host pool only
where prompts stream): the hot set for requests past 256 tokens, 128-token chunks, HiCache's host
pool with ``file`` storage, ``--radix-eviction-policy importance``. A first turn of 600 tokens;
once its pages are in the file tier, ``/flush_cache`` empties device and host; the second turn
(the history, the answer and a question) brings the history back from storage into the host
pool. Every token's logprob of the second turn past the history must be equal on both servers;
only the streaming one reads the history from the host (``history_pages_on_host``).
"""

from __future__ import annotations

import pytest

from sgl_importance.client import flush_cache, generate, greedy, metrics_text
from sgl_importance.local_server import metric
from support.prompts import essay_text
from support.server import importance_torch_args
from support.storage import settled
from support.tiny_llama import save_tiny_llama

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
FIRST_TURN = 600
QUESTION = 40
ARGS = [
    *importance_torch_args(PAGE, 4096, "--dtype", "float32", "--chunked-prefill-size", "128"),
    "--attention-backend", "importance_triton",  # the later flag wins
    "--radix-eviction-policy", "importance", "--enable-hierarchical-cache", "--hicache-ratio", "4",
    "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
    "--enable-metrics", "--hot-set-policy", "importance", "--hot-set-threshold", "256",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(model_path, tmp_path_factory) -> str:
    return save_tiny_llama(model_path, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def session(token_ids):
    ids = token_ids(essay_text(3), FIRST_TURN + QUESTION)
    return ids[:FIRST_TURN], ids[FIRST_TURN:]


def run(launch, tmp_path_factory, model: str, session, prefill: str) -> dict:
    storage = tmp_path_factory.mktemp(f"hicache_{prefill}")
    server = launch(
        ["--model-path", model, *ARGS, "--hot-set-prefill", prefill],
        env={"TRITON_INTERPRET": "1", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)},
    )
    try:
        history, question = session
        first = generate(server.url, input_ids=history, sampling_params=greedy(4), rid="turn-1", timeout=900)
        history = history + first["output_ids"]
        assert settled(storage), "nothing was written to the file tier"
        assert flush_cache(server.url).status_code == 200
        second = generate(
            server.url,
            input_ids=history + question,
            sampling_params=greedy(4),
            rid="turn-2",
            return_logprob=True,
            logprob_start_len=len(history),
            timeout=900,
        )
        counts = metrics_text(server.url)
        assert "Traceback" not in server.log()
    finally:
        server.stop()  # one server at a time
    return {
        "logprobs": [entry[0] for entry in second["meta_info"]["input_token_logprobs"]],
        "tokens": second["output_ids"],
        "cached": second["meta_info"]["cached_tokens"],
        "history_on_host": metric(counts, "sgl_importance:hot_set_history_pages_on_host_total"),
    }


@pytest.fixture(scope="module")
def loaded_back(launch, tmp_path_factory, tiny_model, session):
    return run(launch, tmp_path_factory, tiny_model, session, "dense")


@pytest.fixture(scope="module")
def read_from_host(launch, tmp_path_factory, tiny_model, session, loaded_back):
    return run(launch, tmp_path_factory, tiny_model, session, "stream")


def test_a_returning_turn_reads_its_history_from_the_host_pool_and_prefills_the_same(read_from_host, loaded_back):
    # Both matched the history brought back from the file tier; only one read it from the host.
    assert read_from_host["cached"] >= FIRST_TURN - PAGE and loaded_back["cached"] >= FIRST_TURN - PAGE
    assert read_from_host["history_on_host"] >= FIRST_TURN // PAGE - 1
    assert loaded_back["history_on_host"] == 0
    got, want = read_from_host["logprobs"], loaded_back["logprobs"]
    assert len(got) == len(want) >= QUESTION
    assert got[1:] == pytest.approx(want[1:], rel=1e-5, abs=1e-5)
    assert read_from_host["tokens"] == loaded_back["tokens"]
