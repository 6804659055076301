"""Checks on OpenAI-compatible requests that SGLang leaves to the caller.

SGLang's chat and completion endpoints answer whatever ``model`` a request
names, so a typo silently reaches the loaded model. Like OpenAI (and SGLang's
own Responses API) we answer an unknown name with 404 ``model_not_found``.
The names a caller may use are those ``/v1/models`` lists, the model path, the
LoRA adapters (alone or as ``base:adapter``), and SGLang's placeholder
``default`` for requests that omit the field.

A prompt the model cannot read is refused in the tokenizer manager
(``prompt.py``); around an OpenAI request we tell that check the name the
caller gave the prompt (``messages``, ``prompt`` or ``input``), so the 400 names it.
The same name tells the other checks which endpoint built the request, so their
400s use the endpoint's field names (``top_logprobs`` on chat, ``logprobs`` on
completions).

SGLang's chat request model reads ``response_format`` in a pydantic "before"
validator that assumes an object (``.get`` on a list raises ``AttributeError``,
a 500, before any handler runs). :func:`checked_json` looks at the parsed body
first, where FastAPI turns an ``HTTPException`` into the endpoint's 400.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from fastapi import Request
    from pydantic import BaseModel

# What the OpenAI protocol models put in `model` when a request omits it.
OMITTED_MODEL_NAMES = frozenset({"", "default"})
# Where OpenAI requests carry the prompt: chat, completions, embeddings/responses.
PROMPT_FIELDS = ("messages", "prompt", "input")
CHAT_PATH = "/v1/chat/completions"


def known_model_names(tokenizer_manager: Any) -> set[str]:
    names = {tokenizer_manager.served_model_name}
    model_path = tokenizer_manager.server_args.model_path
    if model_path:
        names.add(model_path)
    names.update(tokenizer_manager.lora_registry.get_all_adapters().keys())
    return names


def unknown_model(model: str | None, known: set[str]) -> bool:
    if model is None or model in OMITTED_MODEL_NAMES or model in known:
        return False
    base, _, adapter = model.partition(":")
    return not (adapter and (base in known) and (adapter in known))


async def reject_unknown_model(
    original: Callable[..., Any], handler: Any, request: BaseModel, raw_request: Request
) -> Any:
    """AROUND-hook for ``OpenAIServingBase.handle_request``."""
    model = getattr(request, "model", None)  # a rerank request names no model
    if isinstance(model, str) and unknown_model(model, known_model_names(handler.tokenizer_manager)):
        return handler.create_error_response(
            message=f"The model '{model}' does not exist",
            err_type="model_not_found",
            status_code=HTTPStatus.NOT_FOUND,
            param="model",
        )
    return await original(handler, request, raw_request)


def openai_prompt_field(request: BaseModel) -> str | None:
    """The field of an OpenAI request that holds its prompt (None if it has none)."""
    return next((name for name in PROMPT_FIELDS if hasattr(request, name)), None)


async def check_openai_request(
    original: Callable[..., Any], handler: Any, request: BaseModel, raw_request: Request
) -> Any:
    """AROUND-hook for ``OpenAIServingBase.handle_request``: every OpenAI check."""
    from sgl_importance.request_check.chat_template import check_chat_template_kwargs
    from sgl_importance.request_check.fields import InvalidFieldError, naming_prompt_field

    try:
        check_chat_template_kwargs(getattr(request, "chat_template_kwargs", None))
    except InvalidFieldError as err:
        return handler.create_error_response(message=str(err), param=err.field)
    problem = detokenize_problem(request, handler)
    if problem is not None:
        return handler.create_error_response(message=problem, param="tokens")

    field = openai_prompt_field(request)
    if field is None:
        return await reject_unknown_model(original, handler, request, raw_request)
    # Streaming handlers pull the first chunk before returning, so the prompt
    # check runs inside this block on both paths.
    with naming_prompt_field(field):
        return await reject_unknown_model(original, handler, request, raw_request)


def detokenize_problem(request: BaseModel, handler: Any) -> str | None:
    """Why ``/detokenize`` cannot decode ``tokens`` (a negative id or one past 2^32 overflowed the
    tokenizer: a 500), or None; other requests None."""
    from sglang.srt.entrypoints.openai.protocol import DetokenizeRequest

    from sgl_importance.request_check.prompt import first_bad_token

    if not isinstance(request, DetokenizeRequest):
        return None

    vocab_size = handler.tokenizer_manager.model_config.vocab_size
    rows = request.tokens if request.tokens and isinstance(request.tokens[0], list) else [request.tokens]
    for row in rows:
        bad = first_bad_token(row, vocab_size)
        if bad is not None:
            position, token = bad
            where = f"token id {token!r} at position {position}"
            return f"Invalid 'tokens': {where} is not in the model's vocabulary [0, {vocab_size})"
    return None


def chat_body_problem(body: Any) -> str | None:
    """Why SGLang's chat request model would raise on ``body`` (a 500), or None.

    Its ``set_json_schema`` validator indexes ``response_format`` and, for
    ``"type": "json_schema"``, its ``schema``, the schema's ``properties`` and their
    ``strict`` entry, as objects.
    """
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    response_format = body.get("response_format")
    if not response_format:
        return None
    if not isinstance(response_format, dict):
        return f"Invalid 'response_format': {response_format!r:.80} is not allowed; allowed: an object"
    if response_format.get("type") != "json_schema" or response_format.get("json_schema"):
        return None
    schema = response_format.get("schema")
    if not schema:
        return None
    if not isinstance(schema, dict):
        return f"Invalid 'response_format.schema': {schema!r:.80} is not allowed; allowed: an object"
    properties = schema.get("properties")
    if properties is None:
        return None
    if not isinstance(properties, dict):
        return f"Invalid 'response_format.schema.properties': {properties!r:.80} is not allowed; allowed: an object"
    strict = properties.get("strict")
    if strict and not isinstance(strict, dict):
        return f"Invalid 'response_format.schema.properties.strict': {strict!r:.80} is not allowed; allowed: an object"
    return None


async def checked_json(original: Callable[[Request], Awaitable[Any]], request: Request) -> Any:
    """AROUND-hook for ``ORJSONRequest.json``: the parsed body, refused with a 400
    where SGLang's own request model would fail on its shape with a 500."""
    body = await original(request)
    if request.url.path == CHAT_PATH:
        problem = chat_body_problem(body)
        if problem is not None:
            from fastapi import HTTPException

            raise HTTPException(status_code=HTTPStatus.BAD_REQUEST, detail=problem)
    return body
