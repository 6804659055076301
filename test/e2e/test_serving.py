"""The embedded model served by the real SGLang server on torch_cpu, used over HTTP."""

from __future__ import annotations

import base64
import json
import pickle
import re
import time

import pytest
import requests
import torch

from sgl_importance.local_server import SERVED_NAME, model_path
from support.server import output_ids_and_logprobs

pytestmark = pytest.mark.e2e

# Long enough to fill several 16-token pages, so a repeat can hit the radix cache.
LONG_PREFIX = "Here is a long shared context about tiered caches. " * 20


@pytest.fixture(scope="module")
def server(launch):
    return launch(["--page-size", "16", "--enable-cache-report"], env={"SGL_IMPORTANCE_ANNOUNCE": "1"})


def chat(server, content: str, **extra) -> requests.Response:
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
        **extra,
    }
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=300)


def test_chat_completion_names_paris_as_capital_of_france(server):
    r = chat(server, "What is the capital of France?")
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer


def test_text_completion_returns_generated_text(server):
    r = requests.post(
        server.url + "/v1/completions",
        json={"model": SERVED_NAME, "prompt": "The sky is", "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"].strip()
    assert body["usage"]["completion_tokens"] > 0


def test_native_generate_returns_text_and_token_ids(server):
    out = server.generate("Once upon a time", max_new_tokens=6)
    assert out["text"].strip()
    assert len(out["output_ids"]) == 6


def test_streaming_chat_delivers_chunks_then_done(server):
    r = chat(server, "Count from one to five.", stream=True)
    assert r.status_code == 200
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    pieces = [
        json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if json.loads(e)["choices"]
    ]
    assert len(pieces) > 1 and "".join(pieces).strip()


def test_health_and_models_endpoints_answer(server):
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    models = requests.get(server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]


def test_greedy_output_is_deterministic(server):
    prompt = "List three primary colors:"
    first = output_ids_and_logprobs(server.generate(prompt, max_new_tokens=12))
    second = output_ids_and_logprobs(server.generate(prompt, max_new_tokens=12))
    assert first[0] == second[0]
    assert first[1] == pytest.approx(second[1], abs=1e-5)


def test_repeated_long_prefix_is_served_from_radix_cache(server):
    first = server.generate(LONG_PREFIX + "Question one?")
    second = server.generate(LONG_PREFIX + "Question two?")
    assert first["meta_info"]["cached_tokens"] == 0
    # Everything up to the last full page of the shared prefix is reused.
    assert second["meta_info"]["cached_tokens"] >= 16 * 10


def test_malformed_json_is_rejected_with_4xx(server):
    r = requests.post(
        server.url + "/v1/chat/completions",
        data="{not json",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert 400 <= r.status_code < 500


def test_prompt_longer_than_context_is_rejected_with_4xx(server):
    r = requests.post(
        server.url + "/v1/completions",
        json={"model": SERVED_NAME, "prompt": "word " * 9000, "max_tokens": 4},
        timeout=300,
    )
    assert 400 <= r.status_code < 500
    assert "context" in r.text.lower() or "length" in r.text.lower()


def test_unknown_model_name_is_rejected_with_404(server):
    r = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": "gpt-imaginary", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 404
    assert "gpt-imaginary" in r.json()["message"]


def test_server_stays_healthy_after_bad_requests(server):
    requests.post(server.url + "/generate", data="][", timeout=30)
    requests.post(server.url + "/v1/completions", json={"prompt": 17}, timeout=30)
    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert chat(server, "Say hello.").status_code == 200


# Prompts the model cannot read (issue #9): each of these once ended the
# scheduler, and the whole server with it. (path, body, the field the 400 names)
OUT_OF_VOCABULARY = 1_000_000_000
UNREADABLE_PROMPTS = {
    "completion_token_id_beyond_vocabulary": (
        "/v1/completions", {"prompt": [[1, OUT_OF_VOCABULARY]], "max_tokens": 4}, "prompt"),
    "streamed_completion_token_id_beyond_vocabulary": (
        "/v1/completions", {"prompt": [1, OUT_OF_VOCABULARY], "max_tokens": 4, "stream": True}, "prompt"),
    "completion_batch_with_an_empty_prompt": (
        "/v1/completions", {"prompt": ["The sky is", ""], "max_tokens": 4}, "prompt"),
    "generate_negative_token_id": ("/generate", {"input_ids": [1, -5]}, "input_ids"),
    "generate_batch_with_one_token_id_beyond_vocabulary": (
        "/generate", {"input_ids": [[1, 2, 3], [1, OUT_OF_VOCABULARY]]}, "input_ids"),
    # SGLang's own normalisation refuses this one before our check.
    "generate_empty_input_ids": ("/generate", {"input_ids": []}, "input_ids"),
    "generate_empty_text": ("/generate", {"text": ""}, "text"),
    "generate_batch_with_an_empty_text": ("/generate", {"text": ["Once upon a time", ""]}, "text"),
}  # fmt: skip


def error_message(path: str, body: dict) -> str:
    # SGLang's shapes: OpenAI {"object": "error", "message", "type", "code"};
    # native {"error": {"message"}}.
    if path.startswith("/v1/"):
        assert body["object"] == "error" and body["code"] == 400, body
        return body["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("case", sorted(UNREADABLE_PROMPTS))
def test_an_unreadable_prompt_is_refused_with_400_naming_the_field_and_the_server_keeps_serving(server, case):
    path, body, field = UNREADABLE_PROMPTS[case]
    if path.startswith("/v1/"):
        body = {"model": SERVED_NAME, **body}
    r = requests.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert field in error_message(path, r.json()), r.text

    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert len(server.generate("The sky is", max_new_tokens=2)["output_ids"]) == 2


def test_sglangs_profiler_endpoint_writes_a_trace_and_the_server_keeps_serving(server, tmp_path):
    # /start_profile asks the platform for its profiler activity; the plugin's platforms
    # lacked the answer and the scheduler raised, taking the server down.
    body = {"output_dir": str(tmp_path), "num_steps": 2, "activities": ["CPU"]}
    r = requests.post(server.url + "/start_profile", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(server.generate("Profile these steps:", max_new_tokens=8)["output_ids"]) == 8
    deadline = time.time() + 120
    while not list(tmp_path.glob("*.trace.json.gz")) and time.time() < deadline:
        time.sleep(0.5)
    assert list(tmp_path.glob("*.trace.json.gz")), server.log()[-3000:]
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert len(server.generate("The sky is", max_new_tokens=2)["output_ids"]) == 2


def test_sglangs_memory_release_and_resume_answer_and_the_server_keeps_serving(server):
    # SGLang's scheduler exits on an exception from a control request: a resume with nothing
    # released (KeyError), a release on torch_cpu (its closing sync named CUDA), a release while
    # a request decodes (its idleness assertion). scheduler/control.py.
    def post(path: str, body: dict) -> int:
        return requests.post(server.url + path, json=body, timeout=120).status_code

    before = server.generate("The capital of France is", max_new_tokens=6)["output_ids"]
    assert post("/resume_memory_occupation", {}) == 200  # nothing released
    assert post("/release_memory_occupation", {"tags": ["kv_cache"]}) == 200
    assert post("/release_memory_occupation", {}) == 200  # every kind, the weights too
    assert post("/resume_memory_occupation", {}) == 200
    assert post("/resume_memory_occupation", {"tags": ["kv_cache"]}) == 200  # resumed already
    sampling = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}
    body = {"text": "Tell me a long story.", "stream": True, "sampling_params": sampling}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=300) as streamed:
        lines = (line for line in streamed.iter_lines() if line.startswith(b"data:") and line != b"data: [DONE]")
        next(lines)  # its first token: the request is decoding
        assert post("/release_memory_occupation", {"tags": ["kv_cache"]}) == 200
        last = [json.loads(line[5:]) for line in lines][-1]
    assert last["meta_info"]["completion_tokens"] == 96
    assert "release_memory_occupation refused: requests are running" in server.log()
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert server.generate("The capital of France is", max_new_tokens=6)["output_ids"] == before


def test_sglangs_expert_record_endpoints_answer_400_naming_the_flag_and_the_server_keeps_serving(server):
    # Without --expert-distribution-recorder-mode SGLang's recorder raises in the scheduler,
    # which exits on a control request's exception (request_check/control.py).
    for action in ("start", "stop", "dump"):
        for method in (requests.get, requests.post):
            answer = method(f"{server.url}/{action}_expert_distribution_record", timeout=60)
            assert answer.status_code == 400, (action, answer.text)
            assert "--expert-distribution-recorder-mode" in answer.json()["message"]
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert len(server.generate("The sky is", max_new_tokens=2)["output_ids"]) == 2


def test_sglangs_control_requests_that_killed_the_scheduler_are_answered_and_the_server_keeps_serving(server, tmp_path):
    # Each took the server down (request_check/control.py, scheduler/control.py).
    def post(path: str, body: dict) -> requests.Response:
        return requests.post(server.url + path, json=body, timeout=300)

    before = server.generate("The capital of France is", max_new_tokens=6)["output_ids"]
    assert post("/slow_down", {"forward_sleep_time": 1e308}).status_code == 400  # time.sleep overflowed
    answer = post("/configure_logging", {"log_requests": True, "log_requests_level": 99})
    assert answer.status_code == 400 and "log_requests_level" in answer.text  # every later request failed to log
    assert post("/open_session", {"capacity_of_str_len": 1000, "session_id": "s1"}).status_code == 200
    turn = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}, "session_params": {"id": "s1"}}
    assert post("/generate", turn).status_code == 200
    again = {**turn, "session_params": {"id": "s1", "replace": True}}  # no rid: the whole session afresh
    assert post("/generate", again).status_code == 200  # the scheduler cleared a dict it iterated
    assert post("/close_session", {"session_id": "s1"}).status_code == 200
    answer = post("/update_weights_from_disk", {"model_path": model_path(), "load_format": "nonsense"})
    assert answer.status_code == 400 and "nonsense" in answer.text  # raised before SGLang's try
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    answer = post("/update_weights_from_disk", {"model_path": str(broken)})
    assert answer.status_code == 400 and "Reloaded" in answer.text  # SGLang's rollback re-read the broken path
    if not torch.cuda.is_available():  # torch's profiler asserted, CUDA's memory history raised
        for activities in (["GPU"], ["MEM"]):
            assert post("/start_profile", {"activities": activities}).status_code == 400
    assert post("/begin_weight_update", {}).status_code == 200
    for unreadable in ([], [base64.b64encode(b"not a pickle").decode()]):  # IndexError, UnpicklingError
        answer = post("/update_weights_from_tensor", {"serialized_named_tensors": unreadable})
        assert answer.status_code == 400 and "deserialize" in answer.text
    a_number = [base64.b64encode(pickle.dumps(5)).decode()]  # TypeError in SGLang's load
    answer = post("/update_weights_from_tensor", {"serialized_named_tensors": a_number})
    assert answer.status_code == 400 and "did not load" in answer.text
    assert post("/end_weight_update", {}).status_code == 200
    no_group = {"master_address": "127.0.0.1", "ports": "1", "group_name": "never-made"}
    assert post("/send_weights_to_remote_instance", no_group).status_code == 400  # KeyError
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert server.generate("The capital of France is", max_new_tokens=6)["output_ids"] == before
    assert post("/update_weights_from_disk", {"model_path": model_path()}).status_code == 200


def test_detokenize_refuses_ids_outside_the_vocabulary_with_400(server):
    # A negative id or one past 2^32 overflowed the tokenizer: a 500 (request_check/openai.py).
    def detokenize(tokens) -> requests.Response:
        return requests.post(server.url + "/v1/detokenize", json={"tokens": tokens}, timeout=60)

    for tokens in ([-1], [[1, 2], [3, 2**40]], [10**9]):
        answer = detokenize(tokens)
        assert answer.status_code == 400 and "Invalid 'tokens'" in answer.text, (tokens, answer.text)
    hello = server.generate("Hello", max_new_tokens=1)["output_ids"]
    assert detokenize(hello).status_code == 200


def test_plugin_is_loaded_in_every_server_process(server):
    pids = set(re.findall(r"\[sgl-importance\] plugin loaded \(pid (\d+)\)", server.log()))
    # launcher/HTTP server, scheduler and detokenizer
    assert len(pids) >= 3, server.log()[-2000:]


def test_with_no_backend_named_the_server_decodes_with_the_plugins_attention(server):
    # torch_cpu's default for a plain decoder (platform/attention_choice.py), said once at start-up.
    assert server.log().count("torch_cpu: attention backend importance_torch") == 1, server.log()[-2000:]
    info = requests.get(server.url + "/get_server_info", timeout=60).json()
    assert info["attention_backend"] == "importance_torch"


def test_server_shuts_down_cleanly_on_sigterm(server):
    # Last in the module: stops the shared server.
    code = server.stop()
    assert code is not None, "server did not exit within 60 s of SIGTERM"
    assert code in (0, -15), server.log()[-3000:]
    assert "Traceback" not in server.log()
