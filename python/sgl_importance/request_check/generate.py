"""A generate request's fields, checked whole before SGLang normalises it (a batch before any item is sent).

:func:`check_generate_request` runs every check of one request: fields only SGLang's
Python Engine may fill (``positional_embed_overrides`` in a JSON body ends the
scheduler), ``session_params`` and custom metric labels, the batch's shape (per-prompt
lists of the wrong length, lists for a single prompt, ``sampling_params`` that do not
match the batch), each prompt's sampling parameters (:mod:`request_check.sampling`),
the sequences the request asks for (prompts x ``n``) and its log probabilities.
"""

from __future__ import annotations

from typing import Any, Optional

from sgl_importance.request_check.fields import PROMPT_FIELD, InvalidFieldError, RequestLimits, caller_field, check_int
from sgl_importance.request_check.sampling import check_sampling_params
from sgl_importance.validate import is_int

# Per-prompt fields a batch may give as a list, one entry per prompt (SGLang indexes
# them by item); sampling_params and token_ids_logprob are checked on their own.
PER_PROMPT_LIST_FIELDS = (
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "lora_path",
    "custom_logit_processor",
    "video_data",
    "audio_data",
    "modalities",
    "multi_item_delimiter_indices",
    "token_indices_to_pool",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
)
# Of those, the ones a single prompt must give as one value: SGLang passes a list
# through to the scheduler, which compares or hashes it as a number or string; the
# others are lists (media, indices) for one prompt too.
SINGLE_PROMPT_SCALAR_FIELDS = tuple(
    name
    for name in PER_PROMPT_LIST_FIELDS
    if name not in {"video_data", "audio_data", "modalities", "multi_item_delimiter_indices", "token_indices_to_pool"}
)
# SGLang's SessionParams and the type of each (its constructor takes any value, and
# raises TypeError, a 500, for any other key).
SESSION_FIELDS = {"id": str, "rid": str, "offset": int, "replace": bool, "drop_previous_output": bool}


def prompt_count(obj: Any) -> Optional[int]:
    """Prompts in a batch request, or None for a single prompt (SGLang's own rule)."""
    if obj.text is not None:
        return None if isinstance(obj.text, str) else len(obj.text)
    if obj.input_ids is not None:
        ids = obj.input_ids
        return None if not ids or not isinstance(ids[0], list) else len(ids)
    embeds = getattr(obj, "input_embeds", None)
    if isinstance(embeds, list) and embeds and isinstance(embeds[0], list) and embeds[0]:
        return len(embeds) if isinstance(embeds[0][0], list) else None
    return None


def _prompt_field(obj: Any) -> str:
    named = PROMPT_FIELD.get()
    if named is not None:
        return named
    return "text" if obj.text is not None else "input_ids"


def _sampling_dicts(obj: Any, prompts: Optional[int]) -> list[dict]:
    """The request's sampling parameters, one dict per prompt; refuses shapes SGLang cannot index."""
    params = obj.sampling_params
    field = caller_field("sampling_params")
    if params is None:
        return [{}]
    if isinstance(params, dict):
        return [params]
    if not isinstance(params, list):
        raise InvalidFieldError(field, params, "an object, or for a batch a list of one object per prompt")
    if prompts is None:
        raise InvalidFieldError(field, params, "an object for a single prompt (a list needs a batch of prompts)")
    if not params:
        # SGLang reads the first entry's n before it looks at the batch.
        raise InvalidFieldError(field, params, "an object, or a list of one object per prompt")
    if len(params) != prompts:
        raise InvalidFieldError(
            field, f"a list of {len(params)}", f"a list of exactly one object per prompt ({prompts})"
        )
    for item in params:
        if not isinstance(item, dict):
            raise InvalidFieldError(field, item, "an object per prompt")
    return params


def check_batch_shape(obj: Any, prompts: Optional[int]) -> None:
    """Per-prompt list fields of a batch must hold one entry per prompt; a single
    prompt's must be single values."""
    if prompts is None:
        for name in SINGLE_PROMPT_SCALAR_FIELDS:
            value = getattr(obj, name, None)
            if isinstance(value, (list, dict)):
                raise InvalidFieldError(caller_field(name), value, "one value for a single prompt")
        _check_embeds(obj)
        return
    _check_embeds(obj)
    for name in PER_PROMPT_LIST_FIELDS:
        value = getattr(obj, name, None)
        if value is None:
            continue
        if isinstance(value, list) and len(value) != prompts:
            raise InvalidFieldError(
                caller_field(name), f"a list of {len(value)}", f"one value, or a list of one per prompt ({prompts})"
            )
    token_ids = obj.token_ids_logprob
    if isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], list) and len(token_ids) != prompts:
        raise InvalidFieldError(
            caller_field("token_ids_logprob"),
            f"a list of {len(token_ids)} lists",
            f"one list of ids, or one list per prompt ({prompts})",
        )


def _check_embeds(obj: Any) -> None:
    """``input_embeds``: one prompt's rows of numbers, or a batch of them, none empty."""
    embeds = getattr(obj, "input_embeds", None)
    if embeds is None:
        return
    allowed = "a non-empty list of non-empty rows of numbers, or a batch of them"
    if not isinstance(embeds, list) or not embeds or not isinstance(embeds[0], list) or not embeds[0]:
        raise InvalidFieldError(caller_field("input_embeds"), embeds, allowed)
    prompts = embeds if isinstance(embeds[0][0], list) else [embeds]
    for rows in prompts:
        if not isinstance(rows, list) or not rows or not all(isinstance(row, list) and row for row in rows):
            raise InvalidFieldError(caller_field("input_embeds"), embeds, allowed)


def _per_prompt(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def check_logprob_fields(obj: Any, limits: RequestLimits) -> None:
    """top_logprobs_num, logprob_start_len and token_ids_logprob (each prompt's, in a batch)."""
    cap = limits.top_logprobs_cap
    for value in _per_prompt(obj.top_logprobs_num):
        if value is not None:
            check_int(
                "top_logprobs_num",
                value,
                0,
                cap,
                f"an integer in [0, {cap}] (--request-max-logprobs {limits.max_logprobs}, "
                f"vocabulary {limits.vocab_size})",
            )
    for value in _per_prompt(obj.logprob_start_len):
        if value is not None:
            check_int("logprob_start_len", value, -1, 2**63 - 1, "-1 (output tokens only) or a prompt position >= 0")
    token_ids = obj.token_ids_logprob
    if not token_ids:
        return
    lists = token_ids if isinstance(token_ids[0], list) else [token_ids]
    for ids in lists:
        if isinstance(ids, list) and len(ids) > cap:
            raise InvalidFieldError(
                caller_field("token_ids_logprob"),
                f"a list of {len(ids)} ids",
                f"at most {cap} ids (--request-max-logprobs {limits.max_logprobs})",
            )


def check_engine_only_fields(obj: Any) -> None:
    """Fields only SGLang's Python Engine can fill (objects, not JSON) must not come as JSON.

    ``positional_embed_overrides`` is typed ``Any`` on ``GenerateReqInput``, so a
    ``/generate`` body may carry it; the scheduler then calls a method of the
    ``PositionalEmbeds`` object it expects on a dict, and ends.
    """
    overrides = getattr(obj, "positional_embed_overrides", None)
    for item in overrides if isinstance(overrides, list) else [overrides]:
        if item is not None and not hasattr(item, "reconstruct"):
            raise InvalidFieldError(
                caller_field("positional_embed_overrides"),
                item,
                "only through SGLang's Python Engine, as PositionalEmbeds objects (not in an HTTP body)",
            )


def check_session_and_labels(obj: Any, limits: RequestLimits) -> None:
    """``session_params`` keys and types; custom metric labels the metrics accept.

    A label the tokenizer's Prometheus series were not declared with raises in its
    output loop, which ends the server (with ``--enable-metrics``).
    """
    session = getattr(obj, "session_params", None)
    if session is not None:
        field = caller_field("session_params")
        allowed = "an object with " + ", ".join(f"{key} ({kind.__name__})" for key, kind in SESSION_FIELDS.items())
        if not isinstance(session, dict):
            raise InvalidFieldError(field, session, allowed)
        for key, value in session.items():
            kind = SESSION_FIELDS.get(key)
            if kind is None or not (value is None or (is_int(value) if kind is int else isinstance(value, kind))):
                raise InvalidFieldError(f"{field}.{key}", value, allowed)
    labels = getattr(obj, "custom_labels", None)
    if labels and limits.metric_labels is not None:
        field = caller_field("custom_labels")
        allowed = "string values for the labels --tokenizer-metrics-allowed-custom-labels names: " + (
            ", ".join(sorted(limits.metric_labels)) or "none on this server"
        )
        if not isinstance(labels, dict):
            raise InvalidFieldError(field, labels, allowed)
        for key, value in labels.items():
            if key not in limits.metric_labels or not isinstance(value, str):
                raise InvalidFieldError(f"{field}.{key}", value, allowed)


def check_generate_request(obj: Any, limits: RequestLimits) -> None:
    """Raise :class:`InvalidFieldError` unless every field of ``obj`` is one this server serves.

    Args:
        obj: SGLang's ``GenerateReqInput`` as the endpoint built it, before
            ``normalize_batch_and_arguments`` (one prompt or a batch).
        limits: the model's and the server's limits.
    """
    check_engine_only_fields(obj)
    check_session_and_labels(obj, limits)
    prompts = prompt_count(obj)
    check_batch_shape(obj, prompts)
    sampling = _sampling_dicts(obj, prompts)
    for params in sampling:
        check_sampling_params(params, limits)
    n = sampling[0].get("n", 1)
    sequences = (prompts or 1) * n
    if sequences > limits.max_sequences:
        raise InvalidFieldError(
            caller_field("sampling_params.n") if prompts is None else _prompt_field(obj),
            f"{prompts or 1} prompt(s) x n={n}",
            f"at most {limits.max_sequences} sequences per request (--request-max-sequences)",
        )
    check_logprob_fields(obj, limits)
