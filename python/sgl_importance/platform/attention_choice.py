"""Which attention backend the torch_cpu platform serves a model with.

Unnamed, it is ``importance_torch``: the plugin's decode (the C kernel of ``sgl_kernel_ext``,
reading each page once straight from the pool) for every model whose attention it reads
exactly as SGLang's ``torch_native`` would: decoder self-attention over the whole sequence
(no sliding window, no chunked local attention, no cross-attention) with K and V kept per
KV head (MHA or GQA). Any other model is served by ``torch_native``, and one start-up line
says why. Named, ``importance_torch`` is refused at start-up, with the reason, where it
cannot read the model's KV pool at all (MLA, a model without attention); a model with some
windowed or cross-attention layers keeps its per-layer fallback to torch_native there.

Decided in the launcher from SGLang's ``ModelConfig`` (the model's configuration, before
any weight loads), so a refusal costs nothing and the servers' processes inherit the choice.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional

DEFAULT_BACKEND = "importance_torch"
FALLBACK_BACKEND = "torch_native"
# The flags that may name a backend (prefill / decode split off the first).
BACKEND_FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
# SGLang's own default for a CPU device, set before a platform's defaults run; it needs
# SGLang's compiled CPU kernels, which torch_cpu runs without, so there it means unset.
SGLANG_CPU_DEFAULT = "intel_amx"

logger = logging.getLogger(__name__)


class Unserved(NamedTuple):
    """Why ``importance_torch`` does not serve a model exactly.

    Attributes:
        reason: what about the model, for the start-up line or error.
        fatal: it cannot read the model's attention at all (named, it is refused); else it
            serves the model with some layers left to torch_native (named, it runs).
    """

    reason: str
    fatal: bool


def unserved(model_config: Any) -> Optional[Unserved]:
    """Why ``importance_torch`` cannot serve ``model_config`` (SGLang's ``ModelConfig``)
    exactly, or None where it can."""
    arch = getattr(model_config.attention_arch, "name", str(model_config.attention_arch))
    if arch != "MHA":
        return Unserved(f"its attention is {arch}, not K and V per KV head (MHA/GQA)", fatal=True)
    if model_config.is_encoder_decoder:
        return Unserved("it is an encoder-decoder model (cross-attention layers)", fatal=False)
    if getattr(model_config, "is_hybrid_swa", False) or getattr(model_config, "sliding_window_size", None):
        return Unserved("its configuration sets a sliding attention window", fatal=False)
    if getattr(model_config, "attention_chunk_size", None):
        return Unserved("it attends in local chunks (attention_chunk_size)", fatal=False)
    if getattr(model_config, "linear_attn_registry_result", None) is not None:
        return Unserved("it has linear-attention layers", fatal=False)
    if getattr(model_config, "use_alibi", False):
        return Unserved("it adds ALiBi position biases to attention", fatal=False)
    return None


def model_config_for(server_args: Any) -> Any:
    """SGLang's ``ModelConfig`` of the server args (reads the model's configuration only)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args)


def choose_attention_backend(server_args: Any, config_of: Optional[Callable[[Any], Any]] = None) -> None:
    """Set ``server_args.attention_backend`` where the user left it unset; refuse a named
    ``importance_torch`` that cannot read the model.

    Args:
        server_args: SGLang's server args (the platform's defaults hook writes them).
        config_of: builds the model's ``ModelConfig`` from them (default: ``model_config_for``).

    Raises:
        ValueError: a backend flag names ``importance_torch`` for a model it cannot read,
            naming the flag, the backend and the reason.
    """
    unset = server_args.attention_backend in (None, SGLANG_CPU_DEFAULT)
    named = [flag for flag in BACKEND_FLAGS if getattr(server_args, flag, None) == DEFAULT_BACKEND]
    if not unset and not named:
        return  # another backend, named: SGLang checks it
    try:
        why = unserved((config_of or model_config_for)(server_args))
    except Exception as e:  # noqa: BLE001 - any failure to read the config: the safe backend
        # SGLang reads the same configuration later and reports its own error there.
        why = Unserved(f"its configuration could not be read ({type(e).__name__}: {e})", fatal=False)
    for flag in named:
        if why is not None and why.fatal:
            raise ValueError(
                f"--{flag.replace('_', '-')} {DEFAULT_BACKEND} cannot serve {server_args.model_path}: "
                f"{why.reason}; use --{flag.replace('_', '-')} {FALLBACK_BACKEND}"
            )
    if unset:
        server_args.attention_backend = FALLBACK_BACKEND if why is not None else DEFAULT_BACKEND
        if why is not None:
            logger.warning("torch_cpu: attention backend %s, not %s: %s", FALLBACK_BACKEND, DEFAULT_BACKEND, why.reason)
        else:
            logger.info("torch_cpu: attention backend %s (the plugin's decode)", DEFAULT_BACKEND)
