"""Generate requests the scheduler cannot serve safely are refused before it sees them.

SGLang 0.5.23 checks many request fields, but some values it lets through end
the scheduler process, and with it the server, for every tenant (seen on
``torch_cpu``, stock SGLang as well): ``top_logprobs_num`` above the vocabulary
(``topk`` out of range in the logprob processor), or given as a list for one
prompt (as is ``logprob_start_len``); a ``stop_token_ids`` id outside the
vocabulary with ``min_new_tokens`` (an out-of-range scatter in the min-tokens
penalizer); ``top_k`` above 2^31 - 1 (an int32 overflow building the batch's
sampling tensors); ``positional_embed_overrides`` in a JSON body; a custom
metric label the tokenizer's series were not declared with. Others are legal but
unbounded: ``n`` and batch size multiply the work one request asks for, top log
probabilities are copied to Python lists per position, a repetition penalty
near 0 overflows the logits, and a stop regex runs in the scheduler on every
decode step with Python's backtracking engine, where ``(a+)+b`` over a few dozen
characters takes seconds and doubles with each one. Malformed shapes (a
``sampling_params`` list that does not match the batch, a key SGLang's
``SamplingParams`` or ``SessionParams`` does not take, an invalid stop regex, a
chat template keyword that is the template call's own) raise something other
than ``ValueError`` and become 500s.

:func:`check_generate_request` checks every such field of one request, before
SGLang normalises it (a batch is checked whole, before any item is sent), and
raises :class:`InvalidFieldError`, which SGLang answers with a 400 and the
endpoint's usual body. The message names the field as the caller spelled it
(``top_logprobs`` on chat, ``logprobs`` on completions, ``sampling_params.top_k``
on ``/generate``), its value and what is allowed. README.md ("Behaviour on every
platform") lists each check with its limit and what it replaced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Optional

from sgl_importance.prompt_check import PROMPT_FIELD, InvalidRequestError

try:  # Python >= 3.11 keeps the regex parser here
    import re._constants as _sre
    import re._parser as _sre_parse
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# torch builds top_k into an int32 tensor; -1 means "the whole vocabulary".
MAX_TOP_K = 2**31 - 1
# SGLang's own caps (sampling_params.py), repeated so the message can name them.
MAX_STOP_STRINGS = 32
MAX_STOP_REGEXES = 32
MAX_STOP_REGEX_BYTES = 256
# A stop string also widens the tail SGLang decodes and matches every step.
MAX_STOP_CHARS = 256
# A stop regex must match at most this many characters (SGLang then only searches
# a tail of that many tokens) and leave its backtracking at most this many ways to
# match from one position; both bound the work a pattern costs per decode step.
MAX_STOP_REGEX_SPAN = 64
MAX_STOP_REGEX_PATHS = 256

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
# through to the scheduler, which compares or hashes it as a number or string.
SINGLE_PROMPT_SCALAR_FIELDS = (
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "lora_path",
    "custom_logit_processor",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
)
# The tokenizer's apply_chat_template parameters: SGLang passes chat_template_kwargs
# as **kwargs beside its own, so a key among them is a TypeError (a 500), and
# `chat_template` would render a caller's Jinja template in the server.
CHAT_TEMPLATE_PARAMETERS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
# Below this the penalized logits overflow to inf and sampling slows to seconds per token.
MIN_REPETITION_PENALTY = 0.01

# How the OpenAI endpoints spell what they translate into a generate request.
# Other sampling parameters keep their name at the top level of the body.
CHAT_FIELDS = {
    "top_logprobs_num": "top_logprobs",
    "return_logprob": "logprobs",
    "sampling_params.max_new_tokens": "max_completion_tokens",
    "sampling_params.min_new_tokens": "min_tokens",
    "sampling_params.sampling_seed": "seed",
}
COMPLETION_FIELDS = {
    "top_logprobs_num": "logprobs",
    "return_logprob": "logprobs",
    "sampling_params.max_new_tokens": "max_tokens",
    "sampling_params.min_new_tokens": "min_tokens",
    "sampling_params.sampling_seed": "seed",
}
OPENAI_FIELDS = {"messages": CHAT_FIELDS, "prompt": COMPLETION_FIELDS}
# SGLang's SessionParams and the type of each (its constructor takes any value, and
# raises TypeError, a 500, for any other key).
SESSION_FIELDS = {"id": str, "rid": str, "offset": int, "replace": bool, "drop_previous_output": bool}
# SamplingParams fields SGLang fills in itself (normalize); never a caller's.
INTERNAL_SAMPLING_FIELDS = frozenset(
    {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized", "ebnf_full_assistant"}
)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of this server.

    Args:
        vocab_size: rows of the model's embedding table.
        context_len: the model's context length in tokens.
        max_sequences: sequences one request may ask for: prompts x ``n``
            (``--request-max-sequences``).
        max_logprobs: top log probabilities per position, and ``token_ids_logprob``
            ids per prompt (``--request-max-logprobs``); never more than the vocabulary.
        sampling_keys: the keys SGLang's ``SamplingParams`` accepts from a caller
            (None: not checked).
        metric_labels: the custom metric labels a request may set
            (``--tokenizer-metrics-allowed-custom-labels``); None when metrics are
            off and the labels go nowhere.
    """

    vocab_size: int
    context_len: int
    max_sequences: int
    max_logprobs: int
    sampling_keys: Optional[frozenset[str]] = None
    metric_labels: Optional[frozenset[str]] = None

    @property
    def top_logprobs_cap(self) -> int:
        return min(self.max_logprobs, self.vocab_size)


class InvalidFieldError(InvalidRequestError):
    """A field whose value the server refuses; SGLang answers it with a 400."""

    def __init__(self, field: str, value: Any, allowed: str, why: str = "is not allowed") -> None:
        super().__init__(f"Invalid '{field}': {_short(value)} {why}; allowed: {allowed}")
        self.field = field
        self.value = value
        self.allowed = allowed


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'"


def caller_field(path: str) -> str:
    """The caller's name for the generate-request field ``path`` on the current endpoint.

    ``path`` is the native ``/generate`` spelling (``top_logprobs_num``,
    ``sampling_params.top_k``); inside an OpenAI request (``prompt_check.PROMPT_FIELD``
    set by ``serving.py``) the endpoint's own name is returned.
    """
    endpoint = PROMPT_FIELD.get()
    if endpoint is None:
        return path
    named = OPENAI_FIELDS.get(endpoint, {}).get(path)
    if named is not None:
        return named
    return path.removeprefix("sampling_params.")


def _is_int(value: Any) -> bool:
    # bool is an int to Python; as a count or a token id it is a caller's mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(path: str, value: Any, low: int, high: int, allowed: Optional[str] = None) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise InvalidFieldError(caller_field(path), value, allowed or f"an integer in [{low}, {high}]")


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
            _check_int(
                "top_logprobs_num",
                value,
                0,
                cap,
                f"an integer in [0, {cap}] (--request-max-logprobs {limits.max_logprobs}, "
                f"vocabulary {limits.vocab_size})",
            )
    for value in _per_prompt(obj.logprob_start_len):
        if value is not None:
            _check_int("logprob_start_len", value, -1, 2**63 - 1, "-1 (output tokens only) or a prompt position >= 0")
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


def check_sampling_params(params: Mapping[str, Any], limits: RequestLimits) -> None:
    """Raise :class:`InvalidFieldError` for a sampling parameter the scheduler cannot serve.

    Only what SGLang's own ``SamplingParams.verify``/``normalize`` leave unchecked or
    turn into something other than a 400; the rest is theirs.
    """
    if limits.sampling_keys is not None:
        unknown = sorted(str(key) for key in params if key not in limits.sampling_keys)
        if unknown:
            raise InvalidFieldError(
                caller_field(f"sampling_params.{unknown[0]}"),
                params[unknown[0]],
                "a sampling parameter this server knows: " + ", ".join(sorted(limits.sampling_keys)),
            )
    n = params.get("n", 1)
    _check_int(
        "sampling_params.n",
        n,
        1,
        limits.max_sequences,
        f"an integer in [1, {limits.max_sequences}] (--request-max-sequences)",
    )
    top_k = params.get("top_k")
    if top_k is not None and not (_is_int(top_k) and (top_k == -1 or 1 <= top_k <= MAX_TOP_K)):
        raise InvalidFieldError(
            caller_field("sampling_params.top_k"), top_k, f"-1 (the whole vocabulary) or an integer in [1, {MAX_TOP_K}]"
        )
    penalty = params.get("repetition_penalty")
    if isinstance(penalty, (int, float)) and not isinstance(penalty, bool) and 0 < penalty < MIN_REPETITION_PENALTY:
        raise InvalidFieldError(
            caller_field("sampling_params.repetition_penalty"), penalty, f"a number in [{MIN_REPETITION_PENALTY}, 2]"
        )
    min_new = params.get("min_new_tokens")
    if min_new is not None:
        _check_int("sampling_params.min_new_tokens", min_new, 0, limits.context_len)
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, (list, tuple, set, frozenset)):
            raise InvalidFieldError(caller_field("sampling_params.stop_token_ids"), stop_ids, "a list of token ids")
        for token in stop_ids:
            _check_int(
                "sampling_params.stop_token_ids",
                token,
                0,
                limits.vocab_size - 1,
                f"token ids in the model's vocabulary [0, {limits.vocab_size})",
            )
    _check_stop_strings(params.get("stop"))
    _check_stop_regexes(params.get("stop_regex"))
    custom = params.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        raise InvalidFieldError(caller_field("sampling_params.custom_params"), custom, "an object")


def _strings(path: str, value: Any, count: int) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise InvalidFieldError(caller_field(path), value, "a string or a list of strings")
    if len(items) > count:
        raise InvalidFieldError(caller_field(path), f"a list of {len(items)}", f"at most {count} entries")
    return items


def _check_stop_strings(value: Any) -> None:
    if value is None:
        return
    for item in _strings("sampling_params.stop", value, MAX_STOP_STRINGS):
        if len(item) > MAX_STOP_CHARS:
            raise InvalidFieldError(
                caller_field("sampling_params.stop"), item, f"stop strings of at most {MAX_STOP_CHARS} characters"
            )


class _Unsafe(Exception):
    pass


# Exactly the constructs SGLang's own length bound (sampling_params.get_max_seq_length)
# understands: for any other it searches the whole output on every step.
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT}
_ONE_CHAR = {_sre.LITERAL, _sre.ANY, _sre.IN}
_ZERO_WIDTH = {_sre.AT}
_UNBOUNDED_NAMES = {
    "NOT_LITERAL": "a negated single character [^c]",
    "ASSERT": "a lookahead or lookbehind",
    "ASSERT_NOT": "a negative lookahead or lookbehind",
    "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive repetition",
}


@dataclass(frozen=True)
class _Cost:
    span: int  # longest match, in characters
    paths: int  # ways backtracking may try to match from one position
    repeats: bool  # holds a repetition


def _cap(value: int) -> int:
    # Only compared against small limits; capped so huge products stay cheap.
    return min(value, 1 << 40)


def _cost(items: Any) -> _Cost:
    span, paths, repeats = 0, 1, False
    for op, arg in items:
        if op in _ONE_CHAR:
            part = _Cost(1, 1, False)
        elif op in _ZERO_WIDTH:
            part = _Cost(0, 1, False)
        elif op == _sre.SUBPATTERN:
            part = _cost(arg[-1])
        elif op == _sre.BRANCH:
            branches = [_cost(branch) for branch in arg[1]]
            part = _Cost(
                max(b.span for b in branches),
                _cap(sum(b.paths for b in branches)),
                any(b.repeats for b in branches),
            )
        elif op in _REPEATS:
            low, high, body = arg
            if high == _sre.MAXREPEAT:
                raise _Unsafe("unbounded repetition (*, +, {n,}); a bounded one such as {0,16} is allowed")
            inner = _cost(body)
            if inner.repeats:
                raise _Unsafe("nested repetition (a repeated group that holds a repetition)")
            if inner.paths == 1:
                ways = high - low + 1
            else:
                ways = sum(_cap(inner.paths**k) for k in range(low, min(high, 64) + 1))
            part = _Cost(high * inner.span, _cap(ways), True)
        elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
            raise _Unsafe("a backreference")
        else:
            name = str(op)
            raise _Unsafe(f"{_UNBOUNDED_NAMES.get(name, name)}, whose length SGLang cannot bound")
        span, paths, repeats = span + part.span, _cap(paths * part.paths), repeats or part.repeats
    return _Cost(span, paths, repeats)


STOP_REGEX_RULE = (
    f"at most {MAX_STOP_REGEXES} Python regular expressions of at most {MAX_STOP_REGEX_BYTES} bytes, "
    f"each matching at most {MAX_STOP_REGEX_SPAN} characters, built from characters, classes, ., "
    "anchors, groups, | and bounded repetition ({m,n}, ?) that is not nested, with at most "
    f"{MAX_STOP_REGEX_PATHS} ways to match at one position over all of them"
)


def stop_regex_cost(pattern: str) -> tuple[int, int]:
    """(longest match in characters, ways to match at one position) of a stop regex.

    SGLang searches each stop regex with Python's backtracking engine over the
    output's tail on every decode step, in the scheduler. A bounded match length
    keeps that tail short (SGLang sizes it from the pattern with the same rules),
    and without nested repetition or backreferences the tries per position are
    the product of the repetition ranges and alternatives.

    Raises:
        ValueError: why the pattern cannot be a stop regex at all.
    """
    if len(pattern.encode("utf-8", "surrogatepass")) > MAX_STOP_REGEX_BYTES:
        raise ValueError(f"is longer than {MAX_STOP_REGEX_BYTES} bytes")
    try:
        re.compile(pattern)
        parsed = _sre_parse.parse(pattern)
        cost = _cost(parsed)
    except (re.error, OverflowError, ValueError) as err:
        raise ValueError(f"is not a valid pattern ({err})") from None
    except RecursionError:
        raise ValueError("nests too deeply") from None
    except _Unsafe as err:
        raise ValueError(f"has {err}") from None
    return cost.span, cost.paths


def _check_stop_regexes(value: Any) -> None:
    if value is None:
        return
    field = caller_field("sampling_params.stop_regex")
    total = 0
    for pattern in _strings("sampling_params.stop_regex", value, MAX_STOP_REGEXES):
        try:
            span, paths = stop_regex_cost(pattern)
        except ValueError as err:
            raise InvalidFieldError(field, pattern, STOP_REGEX_RULE, why=str(err)) from None
        if span > MAX_STOP_REGEX_SPAN:
            raise InvalidFieldError(field, pattern, STOP_REGEX_RULE, why=f"matches up to {span} characters")
        total += paths
        if total > MAX_STOP_REGEX_PATHS:
            raise InvalidFieldError(field, value, STOP_REGEX_RULE, why=f"has {total} ways to match at one position")


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
            if kind is None or not (
                value is None or (isinstance(value, kind) and (kind is bool or not isinstance(value, bool)))
            ):
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


def is_generate_request(obj: Any) -> bool:
    """Whether the tokenizer manager's ``obj`` is a generate request (not an embedding one)."""
    return hasattr(obj, "top_logprobs_num") and hasattr(obj, "sampling_params")


def check_chat_template_kwargs(kwargs: Any) -> None:
    """A chat request's ``chat_template_kwargs`` must not set the template call's own
    parameters (the template itself included)."""
    if not isinstance(kwargs, dict):
        return  # pydantic refuses it first
    taken = sorted(key for key in kwargs if key in CHAT_TEMPLATE_PARAMETERS)
    if taken:
        raise InvalidFieldError(
            f"chat_template_kwargs.{taken[0]}",
            kwargs[taken[0]],
            "variables for the chat template other than " + ", ".join(sorted(CHAT_TEMPLATE_PARAMETERS)),
            why="is a parameter of the template call, not a template variable",
        )


def limits_of(tokenizer_manager: Any) -> RequestLimits:
    """The limits of the server a tokenizer manager belongs to."""
    from sgl_importance.config import config_of

    server_args = tokenizer_manager.server_args
    config = config_of(server_args)
    keys = getattr(tokenizer_manager.sampling_params_class, "__struct_fields__", None)
    labels = getattr(server_args, "tokenizer_metrics_allowed_custom_labels", None) or ()
    return RequestLimits(
        vocab_size=tokenizer_manager.model_config.vocab_size,
        context_len=tokenizer_manager.context_len,
        max_sequences=config.request_max_sequences,
        max_logprobs=config.request_max_logprobs,
        sampling_keys=None if keys is None else frozenset(keys) - INTERNAL_SAMPLING_FIELDS,
        metric_labels=frozenset(labels) if getattr(server_args, "enable_metrics", False) else None,
    )


async def checked_generate(
    original: Callable[..., Any],
    tokenizer_manager: Any,
    obj: Any,
    *args: Any,
    limits_for: Callable[[Any], RequestLimits] = limits_of,
    **kwargs: Any,
) -> AsyncIterator[Any]:
    """AROUND-hook body for ``TokenizerManager.generate_request``: the request is checked
    on the first step, where SGLang raises its own request errors, then served as usual."""
    from contextlib import aclosing

    try:
        if is_generate_request(obj):
            check_generate_request(obj, limits_for(tokenizer_manager))
        async with aclosing(original(tokenizer_manager, obj, *args, **kwargs)) as responses:
            async for response in responses:
                yield response
    except ValueError:
        leave_nothing_to_abort(obj)
        raise


def leave_nothing_to_abort(obj: Any) -> None:
    """Let SGLang's abort task of a streamed ``/generate`` find nothing to abort.

    The task reads ``obj.is_single`` and ``obj.rid``, which normalisation sets; a
    request refused before it (here, or by SGLang's own first checks) has neither,
    and the task's ``AttributeError`` was a traceback after every such refusal
    (found by the fuzzer). Nothing of the request reached SGLang's state.
    """
    if not hasattr(obj, "is_single"):
        obj.is_single = True
        obj.rid = None
