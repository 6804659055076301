"""The AROUND-hook body for ``TokenizerManager.generate_request``: check, then serve as usual.

The request is checked against the limits of the server the tokenizer manager
belongs to (:func:`limits_of`) on the generator's first step, where SGLang raises
its own request errors, so every endpoint answers a refused request with a 400.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from sgl_importance.request_check.fields import RequestLimits
from sgl_importance.request_check.generate import check_generate_request

if TYPE_CHECKING:
    from sgl_importance.config import ImportanceConfig

# SamplingParams fields SGLang fills in itself (normalize); never a caller's.
INTERNAL_SAMPLING_FIELDS = frozenset(
    {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized", "ebnf_full_assistant"}
)


def is_generate_request(obj: Any) -> bool:
    """Whether the tokenizer manager's ``obj`` is a generate request (not an embedding one)."""
    return hasattr(obj, "top_logprobs_num") and hasattr(obj, "sampling_params")


def limits_of(config: ImportanceConfig, tokenizer_manager: Any) -> RequestLimits:
    """The limits of the server a tokenizer manager belongs to (``config``: its flags,
    from the process's runtime)."""
    server_args = tokenizer_manager.server_args
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
    config: ImportanceConfig,
    original: Callable[..., Any],
    tokenizer_manager: Any,
    obj: Any,
    *args: Any,
    limits_for: Callable[[ImportanceConfig, Any], RequestLimits] = limits_of,
    **kwargs: Any,
) -> AsyncIterator[Any]:
    """AROUND-hook body for ``TokenizerManager.generate_request``: the request is checked
    on the first step, where SGLang raises its own request errors, then served as usual."""
    from contextlib import aclosing

    try:
        if is_generate_request(obj):
            check_generate_request(obj, limits_for(config, tokenizer_manager))
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
