"""Prompts the model cannot read are refused before the scheduler sees them.

(So are per-request hot-set parameters the server cannot honour:
:func:`check_hot_set_request`, against the config of the process's runtime.)

SGLang 0.5.23 checks a prompt's length against the context but not its token
ids, and not that it is empty. A token id outside the embedding table (``-5``,
``10**9``) raises ``IndexError`` in the scheduler's forward pass, and an empty
prompt (``"text": ""`` tokenizes to nothing) fails to reshape a tensor of 0
elements; either exception ends the scheduler process, and with it the server,
for every user. We raise ``ValueError`` in the tokenizer manager instead, where
SGLang already turns one into a 400 with the endpoint's usual error body.

The check runs before ``TokenizerManager._validate_one_request``: SGLang calls it
once per tokenized prompt on every path (one request, each item of a batch,
batch tokenization, text or ``input_ids``), with the final token ids, after
chat templates and multimodal processing and before anything is dispatched.

The error names the field the caller used: ``text`` or ``input_ids`` for
``/generate``; ``prompt`` or ``messages`` for the OpenAI endpoints, which set
:data:`fields.PROMPT_FIELD` around their handling (``openai.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from sgl_importance.request_check.fields import PROMPT_FIELD, InvalidRequestError
from sgl_importance.validate import is_int

if TYPE_CHECKING:
    from sgl_importance.config import ImportanceConfig


class InvalidPromptError(InvalidRequestError):
    """A prompt the model cannot process."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"Invalid '{field}': {message}")
        self.field = field


def prompt_field(obj: Any) -> str:
    """The name the caller gave the prompt of the tokenizer manager's ``obj``."""
    named = PROMPT_FIELD.get()
    if named is not None:
        return named
    return "text" if obj.input_ids is None else "input_ids"


def first_bad_token(input_ids: Sequence[Any], vocab_size: int) -> Optional[tuple[int, Any]]:
    """(position, value) of the first id that is not an integer in [0, vocab_size), or None."""
    for position, token in enumerate(input_ids):
        if not (is_int(token) and 0 <= token < vocab_size):
            return position, token
    return None


def check_prompt(obj: Any, input_ids: Optional[Sequence[Any]], vocab_size: int) -> None:
    """Raise :class:`InvalidPromptError` unless ``input_ids`` is a prompt the model can read.

    Args:
        obj: SGLang's per-prompt request (``GenerateReqInput`` or ``EmbeddingReqInput``).
        input_ids: the prompt's token ids as the scheduler would receive them;
            None when the request carries ``input_embeds`` instead.
        vocab_size: rows of the model's embedding table.
    """
    if input_ids is None:
        return
    field = prompt_field(obj)
    if len(input_ids) == 0:
        raise InvalidPromptError(field, "the prompt is empty (no tokens after tokenization)")
    bad = first_bad_token(input_ids, vocab_size)
    if bad is not None:
        position, token = bad
        raise InvalidPromptError(
            field,
            f"token id {token!r} at position {position} is not in the model's vocabulary [0, {vocab_size})",
        )


def check_before_validation(tokenizer_manager: Any, obj: Any, input_ids: Optional[Sequence[Any]]) -> None:
    """BEFORE-hook for ``TokenizerManager._validate_one_request(obj, input_ids)``."""
    check_prompt(obj, input_ids, tokenizer_manager.model_config.vocab_size)


def check_hot_set_request(
    config: ImportanceConfig, tokenizer_manager: Any, obj: Any, input_ids: Optional[Sequence[Any]] = None
) -> None:
    """Raise :class:`InvalidRequestError` (a 400) for bad ``custom_params.hot_set`` values,
    and for a prompt past the longest request a hot-set server takes, naming what bounds it.

    The scheduler parses them again (``scheduler/hot_set_requests.py``); checking here
    turns a bad value into the caller's error instead of a scheduler failure.
    """
    from sgl_importance.choices import REQUEST_HOT_SET_KEY
    from sgl_importance.hot_set.params import request_hot_set_params

    check_length(config, tokenizer_manager, obj, input_ids)

    sampling = obj.sampling_params
    custom = sampling.get("custom_params") if isinstance(sampling, dict) else None
    if not isinstance(custom, dict) or REQUEST_HOT_SET_KEY not in custom:
        return
    try:
        request_hot_set_params(config, custom[REQUEST_HOT_SET_KEY])
    except ValueError as err:
        raise InvalidRequestError(str(err)) from None


def check_length(
    config: ImportanceConfig, tokenizer_manager: Any, obj: Any, input_ids: Optional[Sequence[Any]]
) -> None:
    """A prompt past the longest request a hot-set server takes (``scheduler/long_requests.py``:
    the model's context or the host pool, which holds a long request's whole KV) is refused
    with the limit and the flag that raises it; SGLang's own message names neither. A prompt
    past the model's context gets SGLang's message (it names ``--context-length``)."""
    if config.hot_set_policy == "off" or input_ids is None:
        return
    limit = tokenizer_manager.max_req_input_len
    if limit is None or len(input_ids) < limit:
        return
    context = tokenizer_manager.context_len
    if len(input_ids) >= context:
        return
    if tokenizer_manager.server_args.enable_hierarchical_cache:
        why = (
            "its host pool holds a long request's whole KV, --hicache-ratio or --hicache-size raises it; its "
            "device pool its hot set and rows, --max-total-tokens raises it, a smaller --hot-set-budget lowers them; "
            "the start-up log says which bounds it"
        )
    else:
        why = (
            "the device pool holds the whole request: --enable-hierarchical-cache lets the hot set keep a long "
            "request's KV in the host pool"
        )
    raise InvalidPromptError(
        prompt_field(obj),
        f"the prompt has {len(input_ids)} tokens; this server takes at most {limit} ({why})",
    )
