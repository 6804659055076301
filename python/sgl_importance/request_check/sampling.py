"""One prompt's sampling parameters: the values the scheduler cannot serve are refused.

Only what SGLang's own ``SamplingParams.verify``/``normalize`` leave unchecked or
turn into something other than a 400: ``top_k`` above 2^31 - 1 (an int32 overflow
building the batch's sampling tensors), a ``stop_token_ids`` id outside the
vocabulary with ``min_new_tokens`` (an out-of-range scatter in the min-tokens
penalizer), a repetition penalty near 0 (the logits overflow), ``n`` beyond the
server's limit, a key ``SamplingParams`` does not take, and stop strings and
regexes (:mod:`request_check.stop`).
"""

from __future__ import annotations

from typing import Any, Mapping

from sgl_importance.request_check.fields import InvalidFieldError, RequestLimits, caller_field, check_int
from sgl_importance.request_check.stop import check_stop_regexes, check_stop_strings
from sgl_importance.validate import int_in, is_number

# torch builds top_k into an int32 tensor; -1 means "the whole vocabulary".
MAX_TOP_K = 2**31 - 1
# Below this the penalized logits overflow to inf and sampling slows to seconds per token.
MIN_REPETITION_PENALTY = 0.01


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
    check_int(
        "sampling_params.n",
        n,
        1,
        limits.max_sequences,
        f"an integer in [1, {limits.max_sequences}] (--request-max-sequences)",
    )
    top_k = params.get("top_k")
    if top_k is not None and not (int_in(top_k, -1, -1) or int_in(top_k, 1, MAX_TOP_K)):
        raise InvalidFieldError(
            caller_field("sampling_params.top_k"), top_k, f"-1 (the whole vocabulary) or an integer in [1, {MAX_TOP_K}]"
        )
    penalty = params.get("repetition_penalty")
    if is_number(penalty) and 0 < penalty < MIN_REPETITION_PENALTY:
        raise InvalidFieldError(
            caller_field("sampling_params.repetition_penalty"), penalty, f"a number in [{MIN_REPETITION_PENALTY}, 2]"
        )
    min_new = params.get("min_new_tokens")
    if min_new is not None:
        check_int("sampling_params.min_new_tokens", min_new, 0, limits.context_len)
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, (list, tuple, set, frozenset)):
            raise InvalidFieldError(caller_field("sampling_params.stop_token_ids"), stop_ids, "a list of token ids")
        for token in stop_ids:
            check_int(
                "sampling_params.stop_token_ids",
                token,
                0,
                limits.vocab_size - 1,
                f"token ids in the model's vocabulary [0, {limits.vocab_size})",
            )
    check_stop_strings(params.get("stop"))
    check_stop_regexes(params.get("stop_regex"))
    custom = params.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        raise InvalidFieldError(caller_field("sampling_params.custom_params"), custom, "an object")
