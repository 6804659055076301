"""Generate-request fields the scheduler cannot serve are refused with the field, value and range named."""

from __future__ import annotations

import asyncio
import types

import pytest

from sgl_importance.request_check.control import (
    logging_problem,
    profile_problem,
    sleep_problem,
    start_expert_distribution_record,
)
from sgl_importance.request_check.fields import InvalidFieldError, RequestLimits, caller_field, naming_prompt_field
from sgl_importance.request_check.generate import check_generate_request
from sgl_importance.request_check.hook import checked_generate
from sgl_importance.request_check.sampling import MAX_TOP_K
from sgl_importance.request_check.stop import MAX_STOP_REGEX_PATHS, stop_regex_cost

VOCAB = 1000
LIMITS = RequestLimits(
    vocab_size=VOCAB,
    context_len=8192,
    max_sequences=8,
    max_logprobs=20,
    sampling_keys=frozenset(
        {
            "max_new_tokens",
            "n",
            "top_k",
            "stop",
            "stop_regex",
            "stop_token_ids",
            "min_new_tokens",
            "custom_params",
            "temperature",
            "repetition_penalty",
        }
    ),
)


def request(**fields):
    """A GenerateReqInput as an endpoint builds it, before SGLang normalises it."""
    values = {
        "text": "hello",
        "input_ids": None,
        "input_embeds": None,
        "sampling_params": {"max_new_tokens": 4},
        "return_logprob": None,
        "logprob_start_len": None,
        "top_logprobs_num": None,
        "token_ids_logprob": None,
    }
    values.update(fields)
    return types.SimpleNamespace(**values)


def refused(obj, limits=LIMITS) -> InvalidFieldError:
    with pytest.raises(InvalidFieldError) as err:
        check_generate_request(obj, limits)
    assert err.value.status_code == 400
    # SGLang answers a ValueError from the tokenizer manager with a 400.
    assert isinstance(err.value, ValueError)
    return err.value


def test_an_ordinary_request_passes():
    check_generate_request(request(return_logprob=True, top_logprobs_num=5), LIMITS)
    check_generate_request(request(text=["a", "b"], sampling_params=[{"n": 1}, {"top_k": -1}]), LIMITS)


@pytest.mark.parametrize("k", [VOCAB + 1, 21, 100000, -1])
def test_top_logprobs_above_the_cap_or_negative_are_refused_naming_the_cap_and_the_vocabulary(k):
    err = refused(request(return_logprob=True, top_logprobs_num=k))
    assert err.field == "top_logprobs_num" and err.value == k
    assert "[0, 20]" in str(err) and "--request-max-logprobs 20" in str(err) and f"vocabulary {VOCAB}" in str(err)


def test_the_top_logprobs_cap_is_never_above_the_vocabulary():
    limits = RequestLimits(vocab_size=VOCAB, context_len=8192, max_sequences=8, max_logprobs=10**6)
    check_generate_request(request(top_logprobs_num=VOCAB), limits)
    assert refused(request(top_logprobs_num=VOCAB + 1), limits).field == "top_logprobs_num"


def test_each_prompt_of_a_batch_has_its_top_logprobs_checked():
    err = refused(request(text=["a", "b"], return_logprob=True, top_logprobs_num=[5, 10**5]))
    assert err.value == 10**5


def test_on_chat_the_error_names_top_logprobs_and_on_completions_logprobs():
    with naming_prompt_field("messages"):
        assert refused(request(top_logprobs_num=10**5)).field == "top_logprobs"
    with naming_prompt_field("prompt"):
        assert refused(request(top_logprobs_num=10**5)).field == "logprobs"
        assert caller_field("sampling_params.max_new_tokens") == "max_tokens"
        assert caller_field("sampling_params.stop_token_ids") == "stop_token_ids"
    assert caller_field("sampling_params.top_k") == "sampling_params.top_k"


def test_too_many_token_ids_logprob_are_refused():
    err = refused(request(token_ids_logprob=list(range(21))))
    assert err.field == "token_ids_logprob" and "at most 20 ids" in str(err)


def test_a_logprob_start_below_minus_one_is_refused():
    check_generate_request(request(logprob_start_len=-1), LIMITS)
    assert refused(request(logprob_start_len=-5)).field == "logprob_start_len"


@pytest.mark.parametrize("bad", [VOCAB, 10**9, -1, True, "3"])
def test_a_stop_token_id_outside_the_vocabulary_is_refused(bad):
    err = refused(request(sampling_params={"stop_token_ids": [1, bad], "min_new_tokens": 2}))
    assert err.field == "sampling_params.stop_token_ids" and f"[0, {VOCAB})" in str(err)


@pytest.mark.parametrize("bad", [0, -2, MAX_TOP_K + 1, 2**40, 1.5])
def test_top_k_must_be_minus_one_or_fit_an_int32(bad):
    err = refused(request(sampling_params={"top_k": bad}))
    assert err.field == "sampling_params.top_k" and str(MAX_TOP_K) in str(err)


def test_top_k_at_the_int32_limit_and_minus_one_pass():
    check_generate_request(request(sampling_params={"top_k": MAX_TOP_K}), LIMITS)
    check_generate_request(request(sampling_params={"top_k": -1}), LIMITS)


@pytest.mark.parametrize("n", [0, -1, None, 9, 2.0])
def test_n_must_be_an_integer_within_the_sequence_cap(n):
    err = refused(request(sampling_params={"n": n}))
    assert err.field == "sampling_params.n" and "--request-max-sequences" in str(err)


def test_a_batch_times_n_above_the_sequence_cap_is_refused_naming_the_prompt_field():
    check_generate_request(request(text=["a"] * 4, sampling_params={"n": 2}), LIMITS)
    err = refused(request(text=["a"] * 5, sampling_params={"n": 2}))
    assert err.field == "text" and "at most 8 sequences" in str(err)
    assert refused(request(text=None, input_ids=[[1]] * 9)).field == "input_ids"


def test_sampling_params_must_hold_one_object_per_prompt_of_a_batch():
    assert refused(request(text=["a", "b"], sampling_params=[{}])).field == "sampling_params"
    assert refused(request(text=["a"], sampling_params=[{}, {}])).field == "sampling_params"
    assert refused(request(text="a", sampling_params=[{}])).field == "sampling_params"
    assert refused(request(text=["a", "b"], sampling_params=[{}, 3])).field == "sampling_params"


def test_per_prompt_lists_of_a_batch_must_match_its_length():
    assert refused(request(text=["a", "b"], return_logprob=[True])).field == "return_logprob"
    assert refused(request(text=["a", "b"], top_logprobs_num=[1, 2, 3])).field == "top_logprobs_num"
    assert refused(request(text=["a", "b"], token_ids_logprob=[[1]])).field == "token_ids_logprob"
    # One value for every prompt is fine.
    check_generate_request(request(text=["a", "b"], return_logprob=True, top_logprobs_num=2), LIMITS)


def test_a_single_prompt_gives_its_per_prompt_fields_as_single_values():
    assert refused(request(return_logprob=True, top_logprobs_num=[5])).field == "top_logprobs_num"
    assert refused(request(logprob_start_len=[0])).field == "logprob_start_len"
    with naming_prompt_field("messages"):
        assert refused(request(rid=["a", "b"])).field == "rid"


def test_a_batch_may_give_one_bootstrap_value_for_every_prompt():
    check_generate_request(request(text=["a", "b"], bootstrap_host="h", decode_tp_size=2), LIMITS)
    assert refused(request(text=["a", "b"], bootstrap_host=["h"])).field == "bootstrap_host"


@pytest.mark.parametrize("embeds", [[[]], [], [[[]]], "x", [[0.1], []]])
def test_empty_or_malformed_input_embeds_are_refused(embeds):
    assert refused(request(text=None, input_embeds=embeds)).field == "input_embeds"


def test_a_repetition_penalty_so_small_the_logits_overflow_is_refused():
    check_generate_request(request(sampling_params={"repetition_penalty": 0.5}), LIMITS)
    assert (
        refused(request(sampling_params={"repetition_penalty": 1e-300})).field == "sampling_params.repetition_penalty"
    )


def test_an_empty_list_of_sampling_params_is_refused_even_for_an_empty_batch():
    # Found by the fuzzer: SGLang reads the first entry's n (IndexError, a 500).
    assert refused(request(text=[], sampling_params=[])).field == "sampling_params"


def test_an_empty_batch_is_left_to_sglang():
    # SGLang answers an empty text batch with [] and refuses "input_ids": [] itself.
    check_generate_request(request(text=[]), LIMITS)


def test_session_params_with_an_unknown_key_or_a_wrong_type_are_refused():
    check_generate_request(request(session_params={"id": "s", "offset": 3, "replace": None}), LIMITS)
    assert refused(request(session_params={"zzz": 1})).field == "session_params.zzz"
    assert refused(request(session_params={"offset": "3"})).field == "session_params.offset"
    assert refused(request(session_params={"offset": True})).field == "session_params.offset"
    assert refused(request(session_params=[1])).field == "session_params"


def test_with_metrics_on_only_declared_custom_labels_are_accepted():
    with_metrics = RequestLimits(
        vocab_size=VOCAB, context_len=8192, max_sequences=8, max_logprobs=20, metric_labels=frozenset({"tenant"})
    )
    check_generate_request(request(custom_labels={"tenant": "a"}), with_metrics)
    err = refused(request(custom_labels={"a" * 10: "b"}), with_metrics)
    assert err.field == "custom_labels." + "a" * 10 and "tenant" in str(err)
    assert refused(request(custom_labels={"tenant": 5}), with_metrics).field == "custom_labels.tenant"
    # Without metrics the labels go nowhere.
    check_generate_request(request(custom_labels={"anything": "x"}), LIMITS)


def test_a_sampling_parameter_sglang_does_not_take_is_refused_by_name():
    err = refused(request(sampling_params={"choice": ["a"]}))
    assert err.field == "sampling_params.choice"


def test_embedding_overrides_from_a_json_body_are_refused():
    err = refused(request(positional_embed_overrides={"embeds": [[0.1]], "positions": [1]}))
    assert err.field == "positional_embed_overrides" and "Engine" in str(err)
    engine_object = types.SimpleNamespace(reconstruct=lambda *a: None)
    check_generate_request(request(positional_embed_overrides=engine_object), LIMITS)


def test_custom_params_must_be_an_object():
    assert refused(request(sampling_params={"custom_params": [1]})).field == "sampling_params.custom_params"


def test_too_many_or_too_long_stop_strings_are_refused():
    assert refused(request(sampling_params={"stop": ["x"] * 33})).field == "sampling_params.stop"
    assert refused(request(sampling_params={"stop": "x" * 257})).field == "sampling_params.stop"
    assert refused(request(sampling_params={"stop": [1]})).field == "sampling_params.stop"
    check_generate_request(request(sampling_params={"stop": ["\n\n", "END"]}), LIMITS)


@pytest.mark.parametrize(
    "pattern,why",
    [
        ("(", "not a valid pattern"),
        ("(a+)+b", "unbounded repetition"),
        ("a*b", "unbounded repetition"),
        ("(a{1,3}){1,3}", "nested repetition"),
        ("(a)\\1", "backreference"),
        ("(?=a)b", "lookahead"),
        ("[^a]", "negated single character"),
        ("x" * 257, "longer than 256 bytes"),
        (".{0,65}", "matches up to 65 characters"),
        ("a{0,8}b{0,8}c{0,8}", "729 ways"),
    ],
)
def test_a_stop_regex_that_could_stall_the_scheduler_is_refused_saying_why(pattern, why):
    err = refused(request(sampling_params={"stop_regex": pattern}))
    assert err.field == "sampling_params.stop_regex" and why in str(err)


def test_bounded_stop_regexes_pass():
    for pattern in ("\\d{1,5}\\.", "(yes|no)", "[A-Z][a-z]{0,20}:", "END$", "\\n\\n", "(ab|cd){0,4}"):
        check_generate_request(request(sampling_params={"stop_regex": pattern}), LIMITS)


def test_the_ways_to_match_are_summed_over_a_requests_stop_regexes():
    one = "a{0,15}b{0,3}"  # 16 x 4 = 64 ways
    assert stop_regex_cost(one) == (18, 64)
    check_generate_request(request(sampling_params={"stop_regex": [one] * (MAX_STOP_REGEX_PATHS // 64)}), LIMITS)
    assert refused(request(sampling_params={"stop_regex": [one] * (MAX_STOP_REGEX_PATHS // 64 + 1)})).field


def test_the_check_runs_on_the_first_step_of_generate_request_and_then_serves_as_usual():
    served = []

    async def original(manager, obj, raw=None):
        served.append(obj)
        yield "first"
        yield "second"

    manager = types.SimpleNamespace()

    async def collect(obj):
        return [out async for out in checked_generate(None, original, manager, obj, None, limits_for=lambda *_: LIMITS)]

    assert asyncio.run(collect(request())) == ["first", "second"]
    with pytest.raises(InvalidFieldError):
        asyncio.run(collect(request(top_logprobs_num=10**5)))
    assert len(served) == 1  # the refused request never reached SGLang


def test_an_embedding_request_is_not_checked():
    async def original(manager, obj, raw=None):
        yield "embedding"

    async def collect(obj):
        return [out async for out in checked_generate(None, original, None, obj, limits_for=lambda *_: LIMITS)]

    assert asyncio.run(collect(types.SimpleNamespace(text="x", sampling_params=None))) == ["embedding"]


def _real_limits() -> RequestLimits:
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_importance.request_check.hook import INTERNAL_SAMPLING_FIELDS

    return RequestLimits(
        vocab_size=VOCAB,
        context_len=8192,
        max_sequences=8,
        max_logprobs=20,
        sampling_keys=frozenset(SamplingParams.__struct_fields__) - INTERNAL_SAMPLING_FIELDS,
    )


def test_the_session_fields_checked_are_sglangs():
    from sglang.srt.managers.io_struct import SessionParams

    from sgl_importance.request_check.generate import SESSION_FIELDS

    assert set(SESSION_FIELDS) == set(SessionParams.__struct_fields__)


def test_every_sampling_parameter_the_generate_schema_admits_is_accepted_except_choice():
    from sglang.api.v1.api_types import SamplingParams as SchemaSamplingParams

    keys = _real_limits().sampling_keys
    admitted = set(SchemaSamplingParams.__struct_fields__)
    # SGLang's /generate schema takes `choice`, its SamplingParams does not (a 500 before).
    assert admitted - keys == {"choice"}


def test_sglangs_own_request_objects_are_checked_as_built_from_a_body():
    from sglang.srt.managers.io_struct import GenerateReqInput

    limits = _real_limits()
    check_generate_request(GenerateReqInput(text=["a", "b"], sampling_params={"max_new_tokens": 2, "n": 2}), limits)
    bad = GenerateReqInput(text="a", return_logprob=True, top_logprobs_num=VOCAB + 1)
    assert refused(bad, limits).field == "top_logprobs_num"
    assert refused(GenerateReqInput(input_ids=[[1], [2]], sampling_params=[{}]), limits).field == "sampling_params"


def test_chat_template_kwargs_may_not_set_the_template_calls_own_parameters():
    from sgl_importance.request_check.chat_template import check_chat_template_kwargs

    check_chat_template_kwargs({"enable_thinking": False, "custom": 3})
    for key in ("add_generation_prompt", "chat_template", "tokenize"):
        with pytest.raises(InvalidFieldError) as err:
            check_chat_template_kwargs({key: "x"})
        assert err.value.field == f"chat_template_kwargs.{key}"


def test_the_reserved_template_kwargs_are_the_tokenizers_apply_chat_template_parameters():
    import inspect

    from transformers import PreTrainedTokenizerBase

    from sgl_importance.request_check.chat_template import CHAT_TEMPLATE_PARAMETERS

    named = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert named <= CHAT_TEMPLATE_PARAMETERS


def test_an_openai_chat_request_with_a_reserved_template_kwarg_gets_a_400_naming_it():
    from sgl_importance.request_check.openai import check_openai_request

    errors = []

    def create_error_response(message, param=None, **kwargs):
        errors.append((message, param))
        return "400"

    handler = types.SimpleNamespace(create_error_response=create_error_response)
    chat = types.SimpleNamespace(model=None, messages=[], chat_template_kwargs={"chat_template": "{{ 1 }}"})

    async def original(*args):
        raise AssertionError("the request reached SGLang")

    assert asyncio.run(check_openai_request(original, handler, chat, None)) == "400"
    assert errors[0][1] == "chat_template_kwargs.chat_template"


@pytest.mark.parametrize(
    "response_format,field",
    [
        (["x"], "'response_format'"),
        ("json", "'response_format'"),
        ({"type": "json_schema", "schema": [1]}, "'response_format.schema'"),
        ({"type": "json_schema", "schema": {"properties": "strict"}}, "'response_format.schema.properties'"),
        (
            {"type": "json_schema", "schema": {"properties": {"strict": 1}}},
            "'response_format.schema.properties.strict'",
        ),
    ],
)
def test_a_chat_response_format_sglangs_model_would_500_on_is_a_400_naming_it(response_format, field):
    from fastapi import HTTPException

    from sgl_importance.request_check.openai import checked_json

    async def original(request):
        return {"messages": [], "response_format": response_format}

    request = types.SimpleNamespace(url=types.SimpleNamespace(path="/v1/chat/completions"))
    with pytest.raises(HTTPException) as err:
        asyncio.run(checked_json(original, request))
    assert err.value.status_code == 400 and field in err.value.detail


def test_a_well_formed_chat_body_and_other_paths_pass_through():
    from sgl_importance.request_check.openai import checked_json

    good = {"messages": [], "response_format": {"type": "json_schema", "schema": {"properties": {"a": {}}}}}

    async def original(request):
        return good

    for path in ("/v1/chat/completions", "/generate"):
        request = types.SimpleNamespace(url=types.SimpleNamespace(path=path))
        assert asyncio.run(checked_json(original, request)) is good


def test_the_shapes_refused_are_the_ones_sglangs_chat_model_raises_on():
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    from sgl_importance.request_check.openai import chat_body_problem

    body = {"messages": [{"role": "user", "content": "x"}], "response_format": ["x"]}
    assert chat_body_problem(body) is not None
    with pytest.raises(AttributeError):  # not a ValidationError: FastAPI answers 500
        ChatCompletionRequest.model_validate(body)


def test_a_refused_request_leaves_sglangs_abort_task_nothing_to_abort():
    obj = request(rid=["a", "b"], text=["x", "y"], top_logprobs_num=10**5)

    async def original(manager, obj, raw=None):
        yield "never"

    async def first():
        async for out in checked_generate(None, original, None, obj, limits_for=lambda *_: LIMITS):
            return out

    with pytest.raises(InvalidFieldError):
        asyncio.run(first())
    # What the abort task of a streamed /generate reads: one rid that nothing holds.
    assert obj.is_single is True and obj.rid is None


@pytest.mark.parametrize("mode", [None, "stat"])
def test_the_expert_record_reaches_sglang_only_where_the_server_has_a_recorder(mode):
    from fastapi import HTTPException

    calls = []
    manager = types.SimpleNamespace(server_args=types.SimpleNamespace(expert_distribution_recorder_mode=mode))
    if mode is None:
        with pytest.raises(HTTPException) as refused:
            start_expert_distribution_record(calls.append, manager)
        assert refused.value.status_code == 400 and "--expert-distribution-recorder-mode" in refused.value.detail
        assert calls == []
    else:
        start_expert_distribution_record(calls.append, manager)
        assert calls == [manager]


@pytest.mark.parametrize(
    "seconds, refused",
    [(None, False), (0, False), (-1.0, False), (0.5, False), (3600, False), (3600.5, True), (1e308, True)]
    + [(float("inf"), True), (float("nan"), True), (True, True), ("1", True)],
)
def test_a_forward_sleep_the_scheduler_cannot_take_is_refused(seconds, refused):
    assert (sleep_problem(seconds) is not None) == refused


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, None),
        ({"log_requests_level": 3, "log_requests_format": "json", "log_level": "debug"}, None),
        ({"log_requests_level": 99}, "log_requests_level"),
        ({"log_requests_level": -3}, "log_requests_level"),
        ({"log_requests_level": True}, "log_requests_level"),
        ({"log_requests_format": "xml"}, "log_requests_format"),
        ({"log_level": "chatty"}, "log_level"),
    ],
)
def test_a_logging_body_that_would_break_request_logging_is_refused_naming_its_field(body, field):
    fields = {"log_requests_level": None, "log_requests_format": None, "log_level": None, **body}
    problem = logging_problem(types.SimpleNamespace(**fields))
    assert (problem is None) == (field is None)
    assert field is None or problem.startswith(field)


@pytest.mark.parametrize(
    "activities, refused",
    [(None, False), (["CPU"], False), (["CPU", "GPU"], False), (["GPU"], True), (["MEM"], True), (["RPD"], True)]
    + [(["CPU", "MEM"], True), (["FOO"], True), ([], True)],
)
def test_profiler_activities_this_cpu_cannot_record_are_refused(activities, refused, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (profile_problem(activities) is not None) == refused
