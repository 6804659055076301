"""What every request check shares: the limits, the errors, the caller's names for fields.

A check names a field as the caller spelled it (``top_logprobs`` on chat,
``logprobs`` on completions, ``sampling_params.top_k`` on ``/generate``):
:func:`caller_field` turns the native ``/generate`` spelling into the endpoint's,
from :data:`PROMPT_FIELD`, which the OpenAI endpoints set around their handling
(``openai.py``). Every refusal is an :class:`InvalidRequestError`, a ``ValueError``
SGLang already answers with a 400 and the endpoint's usual body.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Iterator, Optional

from sgl_importance.validate import int_in

# The caller's name for the prompt when an OpenAI endpoint built the request
# (``messages``, ``prompt`` or ``input``, which also tells which endpoint it was);
# None on the native endpoints, where the request's own field is the name.
PROMPT_FIELD: ContextVar[Optional[str]] = ContextVar("sgl_importance_prompt_field", default=None)


@contextmanager
def naming_prompt_field(field: str) -> Iterator[None]:
    """Within this block, request errors name fields as the endpoint whose prompt is ``field`` does."""
    token = PROMPT_FIELD.set(field)
    try:
        yield
    finally:
        PROMPT_FIELD.reset(token)


class InvalidRequestError(ValueError):
    """A request the server cannot serve; SGLang answers it with ``status_code``."""

    status_code = HTTPStatus.BAD_REQUEST


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
    ``sampling_params.top_k``); inside an OpenAI request (:data:`PROMPT_FIELD`
    set by ``openai.py``) the endpoint's own name is returned.
    """
    endpoint = PROMPT_FIELD.get()
    if endpoint is None:
        return path
    named = OPENAI_FIELDS.get(endpoint, {}).get(path)
    if named is not None:
        return named
    return path.removeprefix("sampling_params.")


def check_int(path: str, value: Any, low: int, high: int, allowed: Optional[str] = None) -> None:
    """Raise :class:`InvalidFieldError` for ``path`` unless ``value`` is an integer in [low, high].

    ``allowed`` replaces the message's default description of the range.
    """
    if not int_in(value, low, high):
        raise InvalidFieldError(caller_field(path), value, allowed or f"an integer in [{low}, {high}]")
