"""Prompts the model cannot read are refused with the caller's field named (request_check/prompt.py)."""

from __future__ import annotations

import asyncio
import types

import pytest

from sgl_importance.request_check.fields import naming_prompt_field
from sgl_importance.request_check.openai import check_openai_request, openai_prompt_field
from sgl_importance.request_check.prompt import InvalidPromptError, check_prompt

VOCAB = 100


def request(text=None, input_ids=None):
    return types.SimpleNamespace(text=text, input_ids=input_ids)


def test_token_ids_inside_the_vocabulary_pass():
    check_prompt(request(input_ids=[0, 5, VOCAB - 1]), [0, 5, VOCAB - 1], VOCAB)


@pytest.mark.parametrize("bad", [VOCAB, 10**9, -1, -5])
def test_a_token_id_outside_the_vocabulary_is_refused_naming_input_ids_the_id_and_its_position(bad):
    with pytest.raises(InvalidPromptError) as e:
        check_prompt(request(input_ids=[1, bad]), [1, bad], VOCAB)
    assert e.value.field == "input_ids"
    assert "'input_ids'" in str(e.value) and str(bad) in str(e.value) and "position 1" in str(e.value)
    assert f"[0, {VOCAB})" in str(e.value)
    assert e.value.status_code == 400
    # SGLang turns a ValueError from the tokenizer manager into a 400.
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("bad", [True, 1.0, "7", None])
def test_a_token_id_that_is_not_an_integer_is_refused(bad):
    with pytest.raises(InvalidPromptError, match="position 0"):
        check_prompt(request(input_ids=[bad]), [bad], VOCAB)


def test_an_empty_text_prompt_is_refused_naming_text():
    with pytest.raises(InvalidPromptError, match="'text'.*empty") as e:
        check_prompt(request(text=""), [], VOCAB)
    assert e.value.field == "text"


def test_empty_input_ids_are_refused_naming_input_ids():
    with pytest.raises(InvalidPromptError, match="'input_ids'.*empty"):
        check_prompt(request(input_ids=[]), [], VOCAB)


def test_a_request_carrying_embeddings_instead_of_ids_is_not_checked():
    check_prompt(types.SimpleNamespace(text=None, input_ids=None, input_embeds=[[0.1]]), None, VOCAB)


def test_inside_an_openai_request_the_error_names_the_openai_field():
    with naming_prompt_field("prompt"):
        with pytest.raises(InvalidPromptError, match="'prompt'"):
            check_prompt(request(input_ids=[VOCAB]), [VOCAB], VOCAB)
    # ... and only inside it.
    with pytest.raises(InvalidPromptError, match="'input_ids'"):
        check_prompt(request(input_ids=[VOCAB]), [VOCAB], VOCAB)


@pytest.mark.parametrize(
    "fields,expected",
    [({"messages": []}, "messages"), ({"prompt": "x"}, "prompt"), ({"input": "x"}, "input"), ({}, None)],
)
def test_the_openai_prompt_field_is_the_one_the_request_carries(fields, expected):
    assert openai_prompt_field(types.SimpleNamespace(model="m", **fields)) == expected


def test_an_openai_handler_refuses_a_bad_prompt_naming_its_own_field():
    from sglang.srt.lora.lora_registry import LoRARegistry

    manager = types.SimpleNamespace(
        served_model_name="m", server_args=types.SimpleNamespace(model_path="/models/m"), lora_registry=LoRARegistry()
    )
    handler = types.SimpleNamespace(tokenizer_manager=manager)
    completion = types.SimpleNamespace(model="m", prompt=[[1, VOCAB]])

    async def original(handler, openai_request, raw_request):
        # Stands in for SGLang's handler, which reaches the tokenizer manager's check.
        try:
            check_prompt(request(input_ids=[1, VOCAB]), [1, VOCAB], VOCAB)
        except ValueError as e:
            return str(e)

    assert "'prompt'" in asyncio.run(check_openai_request(original, handler, completion, None))


def _config_and_manager(**config):
    from sgl_importance.config import ImportanceConfig

    # The config comes from the HTTP process's runtime, the manager rides along.
    return ImportanceConfig(**config), types.SimpleNamespace()


def test_bad_per_request_hot_set_parameters_are_a_400_naming_the_key():
    from sgl_importance.request_check.prompt import InvalidRequestError, check_hot_set_request

    manager = _config_and_manager(hot_set_policy="importance")
    obj = types.SimpleNamespace(sampling_params={"custom_params": {"hot_set": {"budget": 0}}})
    with pytest.raises(InvalidRequestError, match=r"custom_params\.hot_set\.budget 0 is invalid") as err:
        check_hot_set_request(*manager, obj)
    assert err.value.status_code == 400


def test_good_or_absent_per_request_hot_set_parameters_pass():
    from sgl_importance.request_check.prompt import check_hot_set_request

    manager = _config_and_manager(hot_set_policy="importance")
    for sampling in (None, {}, {"custom_params": None}, {"custom_params": {"hot_set": {"policy": "dense"}}}):
        check_hot_set_request(*manager, types.SimpleNamespace(sampling_params=sampling))


def test_per_request_hot_set_parameters_on_a_server_without_the_hot_set_are_refused():
    from sgl_importance.request_check.prompt import InvalidRequestError, check_hot_set_request

    obj = types.SimpleNamespace(sampling_params={"custom_params": {"hot_set": {"policy": "dense"}}})
    with pytest.raises(InvalidRequestError, match="--hot-set-policy"):
        check_hot_set_request(*_config_and_manager(), obj)
