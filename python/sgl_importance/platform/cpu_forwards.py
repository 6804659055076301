"""torch_cpu's forwards for two of SGLang's fused ops: RMSNorm and rotary embedding.

SGLang runs an out-of-tree platform's ops through their ``forward_native`` torch paths,
6 tensor ops a norm and ~20 a rotary embedding, which at a decode step's few rows cost
their dispatches (~40 and ~120 us a call on this project's 2-core VM) rather than their
arithmetic. These hand float32 rows to one C call each (``sgl_kernel_ext.layer_ops``) and
keep SGLang's own ``forward_native`` for anything else (another dtype, a variant
setting, no C compiler). Registered per op class by ``plugin.py`` (hook kind
``forward``) in torch_cpu processes; each receives the op as ``self``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from sgl_kernel_ext.layer_ops import rms_norm, rotary

if TYPE_CHECKING:
    from sgl_importance.sglang_types import NormOp, RotaryOp

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
