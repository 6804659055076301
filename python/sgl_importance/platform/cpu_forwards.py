"""torch_cpu's forwards for SGLang's RMSNorm, rotary embedding, linear layers and LM head.

SGLang runs an out-of-tree platform's ops through their ``forward_native`` torch paths,
6 tensor ops a norm and ~20 a rotary embedding, which at a decode step's few rows cost
their dispatches (~40 and ~120 us a call on this project's 2-core VM) rather than their
arithmetic. These hand float32 rows to one C call each (``sgl_kernel_ext.layer_ops``) and
keep SGLang's own ``forward_native`` for anything else (another dtype, a variant
setting, no C compiler). Registered per op class by ``plugin.py`` (hook kind
``forward``) in torch_cpu processes; each receives the op as ``self``.

The unquantized linear layers and the LM head are ``around`` hooks (plugin.py): at a decode
step's few float32 rows (inside ``EagerRunner._execute_decode``: ``decode_forward``) they are
one C call (``sgl_kernel_ext.linear``, 1.2-2.9x torch's matmul there), and SGLang's own code
otherwise (an extend's rows, another dtype, a packed weight, LoRA, a bias on the LM head,
SGLang's float32 LM-head options).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

from sgl_importance import runtime
from sgl_kernel_ext.layer_ops import rms_norm, rotary
from sgl_kernel_ext.linear import linear

if TYPE_CHECKING:
    from sgl_importance.sglang_types.model import LinearLayer, LinearMethod, LogitsProcessor, NormOp, RotaryOp

Pair = tuple[torch.Tensor, torch.Tensor]


def rms_norm_forward(
    self: NormOp,
    x: torch.Tensor,
    residual: Optional[torch.Tensor] = None,
    post_residual_addition: Optional[torch.Tensor] = None,
    quant_linear: object = None,
) -> Union[torch.Tensor, Pair]:
    """``RMSNorm.forward`` (SGLang's ``layers.layernorm``): the output, and with a residual
    the new residual (``x + residual``), written into ``x`` and ``residual`` as SGLang's own
    CPU and CUDA add-norm kernels do (``forward_native`` alone returns fresh tensors)."""
    if post_residual_addition is None and self.variance_size_override is None and self.override_orig_dtype is None:
        done = rms_norm(x, self.weight, self.variance_epsilon, residual)
        if done is not None:
            return done[0] if residual is None else done
    return self.forward_native(x, residual, post_residual_addition, quant_linear)


def rotary_forward(
    self: RotaryOp,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    offsets: Optional[torch.Tensor] = None,
    fused_set_kv_buffer_arg: object = None,
) -> Pair:
    """``RotaryEmbedding.forward`` (SGLang's ``layers.rotary_embedding``) for classes
    whose ``forward_native`` is the base class's: query and key rotated in place (as
    SGLang's compiled rotary kernels do) and returned."""
    # sin_cos_cache: a per-batch table NPU code sets on the op (a plain attribute), read instead.
    if (
        offsets is None
        and fused_set_kv_buffer_arg is None
        and "sin_cos_cache" not in vars(self)
        and rotary(positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim, self.is_neox_style)
    ):
        return query, key
    return self.forward_native(positions, query, key, offsets, fused_set_kv_buffer_arg)


def decode_forward(original: Callable[..., object], runner: object, *args: object, **kwargs: object) -> object:
    """``EagerRunner._execute_decode`` (SGLang's ``model_executor.runner.eager_runner``): the
    linear layers and the LM head take the C kernel inside it only. An extend's few rows (the
    last page a prefix read back from a tier leaves to compute) then take torch's matmul, as
    the same rows did in the whole prompt's prefill: the two sum in another order, and a
    tiered prefix must answer as computed."""
    rt = runtime.current()
    rt.decode_forward = True
    try:
        return original(runner, *args, **kwargs)
    finally:
        rt.decode_forward = False


def linear_apply(
    original: Callable[..., torch.Tensor],
    method: LinearMethod,
    layer: LinearLayer,
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``UnquantizedLinearMethod.apply`` (SGLang's ``layers.quantization.unquant``): a decode
    step's rows through the C kernel; a weight SGLang packed for its AMX kernel, and
    anything the kernel does not take, through SGLang's own method."""
    if runtime.current().decode_forward and not getattr(layer, "use_intel_amx_backend", False):
        out = linear(x, layer.weight, bias)
        if out is not None:
            return out
    return original(method, layer, x, bias)


def lm_head_logits(
    original: Callable[..., torch.Tensor],
    processor: LogitsProcessor,
    hidden_states: torch.Tensor,
    lm_head: LinearLayer,
    embedding_bias: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``LogitsProcessor._compute_lm_head`` (SGLang's ``layers.logits_processor``): its plain
    branch, ``hidden_states @ lm_head.weight.T`` for a head SGLang itself multiplies as it
    stands (its own ``should_apply_lm_head_quant_method`` says no quantized method), with no
    LoRA, no bias and none of its float32 or on-policy options, through the C kernel at a decode
    step's rows (into ``out`` when SGLang hands one of the right shape)."""
    plain = (
        runtime.current().decode_forward
        and embedding_bias is None
        and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        and not hasattr(lm_head, "set_lora")
        and not getattr(lm_head, "use_intel_amx_backend", False)
        and not processor.use_fp32_lm_head
        and processor.rl_on_policy_target is None
    )
    if plain and hidden_states.dtype == lm_head.weight.dtype:
        fits = out is not None and out.shape == (hidden_states.shape[0], lm_head.weight.shape[0])
        logits = linear(hidden_states, lm_head.weight, out=out if fits else None)
        if logits is not None:
            return logits
    return original(processor, hidden_states, lm_head, embedding_bias, out=out)
