"""importance_triton inside the real server, its kernels under Triton's interpreter.

SGLang's TritonAttnBackend runs on torch_cpu when TRITON_INTERPRET=1 (its prefill and
metadata kernels interpret too), so the GPU backend's whole decode path, from the
parent's kv_indptr/kv_indices through DecodeImportanceWrapper to the page table, runs
here. The interpreter is slow, so the model is a two-layer Llama with random weights
(large enough init that greedy tokens vary and depend on attention), in float32 so both
backends agree to rounding. Reference: importance_torch on the same model.
"""

from __future__ import annotations

import pytest

from support.page_table_dump import read_dump
from support.server import output_ids_and_logprobs

pytestmark = pytest.mark.e2e

MAX_NEW = 8
PROMPTS = ["Hello there, my name is", "The capital of France is", "def fibonacci(n):"]
SERVER_ARGS = ["--dtype", "float32", "--max-total-tokens", "4096"]


@pytest.fixture(scope="module")
def torch_outputs(launch, tiny_model):
    server = launch(["--model-path", tiny_model, *SERVER_ARGS, "--attention-backend", "importance_torch"])
    outputs = [output_ids_and_logprobs(server.generate(p, MAX_NEW)) for p in PROMPTS]
    server.stop()
    return outputs


@pytest.fixture(scope="module")
def triton_run(launch, tiny_model, torch_outputs, tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("page_table")
    server = launch(
        ["--model-path", tiny_model, *SERVER_ARGS, "--attention-backend", "importance_triton"],
        env={"TRITON_INTERPRET": "1", "SGL_IMPORTANCE_DUMP_DIR": str(dump_dir)},
    )
    outputs = [output_ids_and_logprobs(server.generate(p, MAX_NEW)) for p in PROMPTS]
    decode_steps = sum(len(ids) - 1 for ids, _ in outputs)
    state = read_dump(dump_dir, lambda s: s["steps"] >= decode_steps)
    server.stop()
    return outputs, decode_steps, state


def test_greedy_tokens_match_importance_torch(torch_outputs, triton_run):
    outputs, _, _ = triton_run
    for prompt, (ref_ids, ref_lp), (ids, lp) in zip(PROMPTS, torch_outputs, outputs):
        assert ids == ref_ids, prompt
        assert lp == pytest.approx(ref_lp, abs=1e-3), prompt


def test_triton_decode_fills_the_page_table(triton_run):
    _, decode_steps, state = triton_run
    assert state["page_size"] == 1
    assert state["recorded_steps"] == state["steps"] >= decode_steps
    accumulated = state["accumulated"]
    assert (accumulated >= 0).all() and accumulated[0] == 0
    # Every recorded step hands out a request's whole mass (1) and page-size-1 slots
    # stay cached, so nearly all of it is still there.
    total = float(accumulated.sum())
    assert 0.9 * state["recorded_steps"] <= total <= state["recorded_steps"] + 1e-3
