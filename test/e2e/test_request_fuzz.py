"""Fuzz: no request body stops the server.

Random and adversarial bodies for ``/generate``, ``/v1/completions`` and
``/v1/chat/completions`` (hypothesis, a fixed seed): each documented field at its
limits and beyond, wrong types, nesting, huge values, unicode (lone surrogates
included), batches mixing good and bad prompts, streams the client drops after the
first chunk. One real server runs them with the importance hot set (a threshold low
enough that the longer fuzz prompts use it), the host tier and the ``file`` tier.

What must hold: every answer is 2xx or 4xx (never 5xx, never a dropped
connection the client did not drop itself), ``/health`` answers 200 throughout (a
thread polls it beside the requests: SGLang's ``/health`` runs a one-token
generation, so it proves the scheduler serves, and takes a second), a greedy
canary's output is the same at the end as at the start, the server log has no
traceback and no leak report, and the hot set decoded some of the longer prompts.

CI runs 300 examples; ``SGL_IMPORTANCE_FUZZ_EXAMPLES=5000`` runs a long fuzz by hand
and prints what it sent and got.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from sgl_importance.client import metrics_text
from sgl_importance.local_server import SERVED_NAME, metric

EXAMPLES = int(os.environ.get("SGL_IMPORTANCE_FUZZ_EXAMPLES", "300"))
# The suite's 900 s per test, or about 3 s per example for a long fuzz.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(max(900, 3 * EXAMPLES))]
VOCAB = 49152  # SmolLM2's embedding rows
CONTEXT = 8192
# The server's request caps (flags below), small so the fuzz reaches them cheaply.
MAX_SEQUENCES = 6
MAX_LOGPROBS = 16
HOT_SET_THRESHOLD = 64
CANARY = "Name three primary colours."
REQUEST_TIMEOUT_S = 120
FILLER = "The quick brown fox jumps over the lazy dog while it rains on the hills. "

# -- values ---------------------------------------------------------------------------

# Any JSON value, nested a little: what a confused or hostile client puts anywhere.
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=10,
)
# Unicode of every kind, lone surrogates and NUL included (json.dumps escapes them).
wild_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=24)


def around(*points: int) -> st.SearchStrategy[int]:
    """Integers at and next to each boundary."""
    return st.sampled_from(sorted({p + d for p in points for d in (-1, 0, 1)}))


def field(good: st.SearchStrategy, *edges: object) -> st.SearchStrategy:
    """A field's value: ordinary, at an edge, or any JSON at all (a third each)."""
    return st.one_of(good, *([st.sampled_from(edges)] if edges else []), json_value)


token_id = st.one_of(st.integers(0, VOCAB - 1), around(0, VOCAB), st.sampled_from([-(2**40), 2**40]))
prompt_text = st.one_of(
    st.sampled_from(["Hello", "What is the capital of France?", " ", "\n\n"]),
    wild_text,
    # Past the hot-set threshold (and with the host pool, pages released while decoding).
    st.integers(HOT_SET_THRESHOLD // 8, 12).map(lambda k: FILLER * k),
)
good_ids = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=24)
prompt_ids = st.one_of(
    good_ids,
    st.lists(token_id, min_size=0, max_size=8),
    st.integers(HOT_SET_THRESHOLD + 1, 200).map(lambda n: [(i * 7919) % (VOCAB - 1) + 1 for i in range(n)]),
)
stop_regexes = st.sampled_from(
    ["\\n\\n", "END$", "\\d{1,5}\\.", "(yes|no)", "[A-Z][a-z]{0,20}:", "(", "(a+)+b", "a*b", ".*x", "(a)\\1",
     "(?=a)b", "[^a]", "(a{1,3}){1,3}", "x" * 300, "a{0,8}b{0,8}c{0,8}", ""]
)  # fmt: skip
grammars = {
    "regex": st.sampled_from(["[ab]{1,4}", "(", "yes|no", "\\d{2}", "(a{1,40}){1,40}"]),
    "json_schema": st.sampled_from(
        [
            '{"type": "object"}',
            "not json",
            '{"type": "array", "items": {"type": "integer"}, "maxItems": 2}',
            "{}",
            json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
        ]
    ),  # fmt: skip
    "ebnf": st.sampled_from(['root ::= "a" | "b"', "garbage ::=", 'root ::= "x"*']),
}
hot_set_params = st.fixed_dictionaries(
    {},
    optional={
        "policy": st.sampled_from(["dense", "window", "quest", "lru", "importance", "off", "nope"]),
        "budget": st.sampled_from([0, 1, 4, 0.2, 1.0, 1.5, -1, "x"]),
        "window": around(1, 1 << 20),
        "sinks": around(0, 64),
        "guard_threshold": st.sampled_from([0.0, 0.1, 1.0, 1.1]),
        "reduce": st.sampled_from(["mean", "max", "min"]),
    },
)

# The sampling parameters (SGLang's names; the OpenAI endpoints translate a few).
SAMPLING = {
    "min_new_tokens": field(st.integers(0, 4), -1, 9, 10**6),
    "temperature": field(st.sampled_from([0.0, 0.7, 1.0]), -1.0, 1e-300, 1e300, 2.5),
    "top_p": field(st.sampled_from([0.5, 1.0]), 0.0, 1e-12, 1.1),
    "top_k": field(st.sampled_from([-1, 1, 5]), 0, -2, VOCAB, 2**31 - 1, 2**31, 2**62),
    "min_p": field(st.sampled_from([0.0, 0.1]), 1.0, 1.5, -0.1),
    "frequency_penalty": field(st.sampled_from([0.0, 0.5]), -2.0, 2.0, 2.1),
    "presence_penalty": field(st.sampled_from([0.0, 0.5]), -2.0, 2.0, -3.0),
    "repetition_penalty": field(st.sampled_from([1.0, 1.2]), 0.0, 1e-3, 2.0, 2.5),
    "n": field(st.sampled_from([1, 2]), 0, -1, MAX_SEQUENCES, MAX_SEQUENCES + 1, 2**40),
    "stop": field(st.one_of(st.sampled_from(["\n", "."]), st.lists(wild_text, max_size=3)), "", "x" * 300, ["."] * 33),
    "stop_token_ids": field(st.lists(token_id, max_size=4), [], list(range(100))),
    "stop_regex": field(st.one_of(stop_regexes, st.lists(stop_regexes, max_size=3)), ["\\n"] * 33),
    "ignore_eos": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "no_stop_trim": field(st.booleans()),
    "spaces_between_special_tokens": field(st.booleans()),
    "stream_interval": field(st.sampled_from([1, 2]), 0, -1, 10**9),
    "logit_bias": field(
        st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3),
        {"abc": 1.0},
        {"1.5": 1.0},
        {"5": 1e308},
        {"5": -1e308},
    ),
    "sampling_seed": field(st.integers(0, 100), -1, 2**63 - 1, 2**63, -(2**63) - 1),
    "custom_params": field(st.fixed_dictionaries({"hot_set": hot_set_params}), {}, [1], "x"),
    "beam_width": field(st.just(1), 0, 2),
    **{name: field(strategy) for name, strategy in grammars.items()},
}
logprob_fields = {
    "return_logprob": field(st.booleans()),
    "top_logprobs_num": field(st.integers(0, 4), MAX_LOGPROBS, MAX_LOGPROBS + 1, VOCAB, VOCAB + 1, -1, 10**9),
    "logprob_start_len": field(st.sampled_from([-1, 0, 1]), -2, 10**6),
    "token_ids_logprob": field(st.lists(token_id, max_size=4), list(range(MAX_LOGPROBS + 1)), [[1], [2]]),
}
# Never null: no limit is legal, and generates up to the context for one request.
json_not_null = json_value.filter(lambda v: v is not None)
max_tokens = st.one_of(st.integers(1, 8), st.sampled_from([0, -1, 10**9, 2**63]), json_not_null)
common = {
    "rid": field(st.text(min_size=1, max_size=8)),
    "extra_key": field(wild_text),
    "cache_salt": field(wild_text),
    "priority": field(st.integers(-5, 5), 2**62),
    "lora_path": field(st.just("nope")),
    "session_params": field(st.just({"id": "nope"})),
    "custom_logit_processor": field(st.just("x")),
    "return_hidden_states": field(st.booleans()),
    "return_routed_experts": field(st.booleans()),
    "routed_experts_start_len": field(st.integers(-1, 2)),
    "return_cached_tokens_details": field(st.booleans()),
    "return_prompt_token_ids": field(st.booleans()),
    "return_sampling_mask": field(st.booleans()),
    "routed_dp_rank": field(st.integers(-1, 2)),
    "bootstrap_host": field(st.just("127.0.0.1")),
    "bootstrap_room": field(st.integers(0, 3)),
    "custom_labels": field(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)),
    "kv_hints": field(st.just({"protocol_version": "1", "actions": [{"action_type": "x", "payload": {"a": 1}}]})),
    "max_thinking_tokens": field(st.integers(-1, 4)),
    "unknown_field": json_value,
}


def mutated(base: dict, fields: dict) -> st.SearchStrategy[dict]:
    """``base`` with up to four of ``fields`` set to drawn values."""
    names = sorted(fields)
    return st.lists(st.sampled_from(names), max_size=4, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({name: fields[name] for name in chosen}).map(
            lambda extra: {**base, **extra}
        )
    )


def generate_bodies() -> st.SearchStrategy[dict]:
    sampling = st.integers(1, 8).flatmap(
        lambda m: mutated({"max_new_tokens": m}, {**SAMPLING, "max_new_tokens": max_tokens})
    )
    single = st.one_of(
        st.fixed_dictionaries({"text": prompt_text, "sampling_params": sampling}),
        st.fixed_dictionaries({"input_ids": prompt_ids, "sampling_params": sampling}),
    )
    # Batches mixing good and bad prompts, sampling parameters per prompt or shared.
    batch = st.one_of(
        st.fixed_dictionaries(
            {
                "text": st.lists(prompt_text, min_size=0, max_size=4),
                "sampling_params": st.one_of(sampling, st.lists(sampling, min_size=0, max_size=5)),
            }
        ),
        st.fixed_dictionaries(
            {
                "input_ids": st.lists(prompt_ids, min_size=1, max_size=4),
                "sampling_params": st.one_of(sampling, st.lists(sampling, min_size=1, max_size=4)),
            }
        ),
    )
    top = {**logprob_fields, **common, "stream": field(st.booleans()), "return_text_in_logprobs": field(st.booleans())}
    return st.one_of(single, batch).flatmap(lambda body: mutated(body, top))


def openai_sampling() -> dict:
    renamed = {"min_new_tokens": "min_tokens", "sampling_seed": "seed"}
    return {renamed.get(name, name): strategy for name, strategy in SAMPLING.items() if name != "custom_params"} | {
        "custom_params": SAMPLING["custom_params"]
    }


def completion_bodies() -> st.SearchStrategy[dict]:
    prompt = st.one_of(
        prompt_text,
        st.lists(prompt_text, min_size=0, max_size=3),
        prompt_ids,
        st.lists(prompt_ids, min_size=1, max_size=3),
    )
    fields = {
        **openai_sampling(),
        **common,
        "model": field(st.just(SERVED_NAME), "nope", ""),
        "max_tokens": max_tokens,
        "logprobs": field(st.integers(0, 4), MAX_LOGPROBS, MAX_LOGPROBS + 1, VOCAB + 1, -1),
        "echo": field(st.booleans()),
        "best_of": field(st.integers(1, 3)),
        "suffix": field(st.text(max_size=4)),
        "stream": field(st.booleans()),
        "stream_options": field(st.just({"include_usage": True, "continuous_usage_stats": True})),
        "response_format": field(st.sampled_from([{"type": "json_object"}, {"type": "text"}])),
        "user": field(st.text(max_size=4)),
        "return_token_ids": field(st.booleans()),
    }
    return st.fixed_dictionaries(
        {"model": st.just(SERVED_NAME), "prompt": prompt, "max_tokens": st.integers(1, 8)}
    ).flatmap(lambda body: mutated(body, fields))


message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": prompt_text}),
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "wizard", "tool", "developer"]),
            "content": st.one_of(
                st.none(),
                wild_text,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": wild_text}), max_size=3),
                json_value,
            ),
        }
    ),
)


def chat_bodies() -> st.SearchStrategy[dict]:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    fields = {
        **openai_sampling(),
        **common,
        "model": field(st.just(SERVED_NAME), "nope"),
        "max_tokens": max_tokens,
        "max_completion_tokens": max_tokens,
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 4), MAX_LOGPROBS, MAX_LOGPROBS + 1, 20, 21, VOCAB + 1, -1),
        "stream": field(st.booleans()),
        "stream_options": field(st.just({"include_usage": True, "continuous_usage_stats": True})),
        "response_format": field(
            st.sampled_from(
                [
                    {"type": "json_object"},
                    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                ]
            )
        ),
        "tools": field(st.just([tool])),
        "tool_choice": field(
            st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "g"}}])
        ),
        "chat_template_kwargs": field(
            st.dictionaries(st.text(max_size=6), json_scalar, max_size=2),
            {"add_generation_prompt": "x"},
            {"chat_template": "{{ 1 }}"},
            {"enable_thinking": False},
        ),
        "continue_final_message": field(st.booleans()),
        "reasoning_effort": field(st.sampled_from(["low", "high", "none"]), 0.5, True),
        "separate_reasoning": field(st.booleans()),
        "input_ids": field(good_ids, [VOCAB], []),
        "return_meta_info": field(st.booleans()),
    }
    return st.fixed_dictionaries(
        {
            "model": st.just(SERVED_NAME),
            "messages": st.lists(message, min_size=0, max_size=3),
            "max_tokens": st.integers(1, 8),
        }
    ).flatmap(lambda body: mutated(body, fields))


BODIES = {
    "/generate": generate_bodies(),
    "/v1/completions": completion_bodies(),
    "/v1/chat/completions": chat_bodies(),
}

# -- the server and the calls -----------------------------------------------------------


@pytest.fixture(scope="module")
def server(launch, tmp_path_factory):
    storage = tmp_path_factory.mktemp("hicache")
    return launch(
        [
            "--page-size", "16",
            "--max-total-tokens", "2048",
            "--max-running-requests", "8",
            "--attention-backend", "importance_torch",
            "--radix-eviction-policy", "importance",
            "--hot-set-policy", "importance",
            "--hot-set-threshold", str(HOT_SET_THRESHOLD),
            "--enable-hierarchical-cache",
            "--hicache-storage-backend", "file",
            # Metrics on: a request's custom metric labels reach the tokenizer's series.
            "--enable-metrics",
            "--request-max-sequences", str(MAX_SEQUENCES),
            "--request-max-logprobs", str(MAX_LOGPROBS),
        ],
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)},
    )  # fmt: skip


def send(url: str, endpoint: str, body: dict, drop_stream: bool) -> tuple[int, str]:
    """POST ``body``; (HTTP status, start of the answer). A stream is read to its end,
    or dropped after its first chunk when ``drop_stream``."""
    data = json.dumps(body)
    stream = body.get("stream") is True
    headers = {"Content-Type": "application/json"}
    with requests.post(url + endpoint, data=data, headers=headers, timeout=REQUEST_TIMEOUT_S, stream=stream) as r:
        if stream and r.status_code == 200:
            lines = r.iter_lines()
            first = next(lines, b"")
            if not drop_stream:
                for _ in lines:
                    pass
            return r.status_code, first[:300].decode(errors="replace")
        return r.status_code, r.text[:300]


class HealthPoller(threading.Thread):
    """Polls ``/health`` until stopped; keeps every answer that was not 200."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.polls = 0
        self.failures: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                status = requests.get(self.url + "/health", timeout=60).status_code
                if status != 200:
                    self.failures.append(f"/health {status}")
            except requests.RequestException as err:
                self.failures.append(f"/health {err!r}")
            self.polls += 1
            self._halt.wait(0.5)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=120)


def canary(url: str) -> list[int]:
    body = {"text": CANARY, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    r = requests.post(url + "/generate", json=body, timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    return r.json()["output_ids"]


def test_no_request_body_stops_the_server(server):
    before = canary(server.url)
    answers: Counter = Counter()
    sent = [0]
    started = time.time()
    health = HealthPoller(server.url)
    health.start()

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        # No shrinking: once the server is down every later example fails too.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one_request(data):
        endpoint = data.draw(st.sampled_from(sorted(BODIES)), label="endpoint")
        body = data.draw(BODIES[endpoint], label="body")
        drop = data.draw(st.booleans(), label="drop stream")
        try:
            status, head = send(server.url, endpoint, body, drop)
        except requests.RequestException as err:
            pytest.fail(f"{endpoint} dropped the connection ({err!r}); log tail:\n{server.log()[-3000:]}")
        note(f"{endpoint} -> {status}: {head}")
        answers[(endpoint, status)] += 1
        sent[0] += 1
        assert status < 500, f"{endpoint} answered {status}: {head}\nlog tail:\n{server.log()[-3000:]}"
        assert not health.failures, f"{health.failures[:3]} after {endpoint} {body}"

    try:
        one_request()
    finally:
        health.stop()
    elapsed = time.time() - started
    assert health.polls > 0 and not health.failures, health.failures[:5]

    assert server.proc.poll() is None, server.log()[-3000:]
    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert canary(server.url) == before
    log = server.log()
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 2000) :][:6000]
    assert "memory leak detected" not in log
    # The longer prompts decoded through the hot set.
    scrape = metrics_text(server.url, timeout=30)
    hot_set_steps = metric(scrape, "sgl_importance:hot_set_steps_total")
    assert hot_set_steps > 0
    print(
        "\nfuzz: "
        + json.dumps(
            {
                "requests": sent[0],
                "health_polls": health.polls,
                "seconds": round(elapsed, 1),
                "answers": {f"{e} {s}": n for (e, s), n in sorted(answers.items())},
                "hot_set_steps": hot_set_steps,
            }
        )
    )
