"""SGLang's model side as the plugin uses it: the model runner, its config and its KV and
req_to_token pools, a forward batch, an attention layer, the decode graph runner and its
variants, what sizes the KV pool, and the layers and ops torch_cpu's C forwards stand in for."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol, Union

if TYPE_CHECKING:
    import torch


class KVPool(Protocol):
    """``mem_cache.memory_pool.KVCache``: the device KV pool, one K and one V buffer per layer."""

    size: int  # token slots
    device: str

    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...  # [slots, kv_heads, D]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...  # [slots, kv_heads, Dv]

    def set_kv_buffer(
        self, layer: AttentionLayer, loc: object, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None: ...  # loc: the slots, or a ``KVWriteLoc``


class MHAPool(KVPool, Protocol):
    """``mem_cache.memory_pool.MHATokenToKVPool``: what a direct KV write reads of it."""

    k_buffer: list[torch.Tensor]  # per layer of this rank, [slots, kv_heads, D]
    v_buffer: list[torch.Tensor]
    start_layer: int
    dtype: torch.dtype
    store_dtype: torch.dtype
    is_quantized_kv_cache: bool


class ReqToTokenPool(Protocol):
    """``mem_cache.memory_pool.ReqToTokenPool``: each request row's KV slots."""

    size: int  # request rows
    req_to_token: torch.Tensor  # [rows, context] slots


class ModelConfig(Protocol):
    """``configs.model_config.ModelConfig``."""

    context_len: int
    num_hidden_layers: int
    head_dim: int
    v_head_dim: int

    def get_num_kv_heads(self, tensor_parallel_size: int, dcp_size: int = 1) -> int: ...


class ModelRunner(Protocol):
    """``model_executor.model_runner.ModelRunner``."""

    model: torch.nn.Module  # its RadixAttention modules are the attention layers
    model_config: ModelConfig
    token_to_kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool
    page_size: int
    max_total_num_tokens: int  # the KV pool's tokens
    kv_cache_dtype: torch.dtype
    dtype: torch.dtype  # the model's
    sliding_window_size: Optional[int]  # None: no window
    forward_stream: Union[torch.cuda.Stream, torch.cpu.Stream]  # its device module's Stream


class AttentionLayer(Protocol):
    """``layers.radix_attention.RadixAttention``: one attention layer."""

    layer_id: int
    tp_q_head_num: int  # query heads on this rank
    qk_head_dim: int
    v_head_dim: int
    scaling: float
    is_cross_attention: bool
    attn_type: enum.Enum  # ``radix_attention.AttentionType``
    sliding_window_size: int  # -1: no window (the plugin takes None as none too)


class ForwardMode(Protocol):
    """``model_executor.forward_batch_info.ForwardMode``."""

    def is_decode(self) -> bool: ...


class ForwardBatch(Protocol):
    """``model_executor.forward_batch_info.ForwardBatch``: one forward's batch."""

    batch_size: int
    rids: Optional[list[str]]  # the requests' ids; None: not recorded
    req_pool_indices: torch.Tensor  # their ``req_to_token`` rows, on the device
    seq_lens: torch.Tensor  # on the device
    seq_lens_cpu: Optional[torch.Tensor]  # the host's copy; None where SGLang keeps none
    extend_seq_lens_cpu: Optional[list[int]]  # an extend's new tokens per request


class AttentionGraphVariants(Protocol):
    """``layers.attention.graph_variants.AttentionGraphVariants``: which captured decode graph
    a batch replays."""

    capture_labels: ClassVar[tuple[str, ...]]  # in capture order

    def select(self, forward_batch: ForwardBatch) -> str: ...  # one of ``capture_labels``


class DecodeGraphRunner(Protocol):
    """``model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner`` (its
    ``attn_backend`` and ``capture_bs`` are read with ``getattr``, as other runners may lack them)."""

    require_mlp_sync: bool  # ranks must agree on graph or eager (DP attention, gathered buffers)


class ModelLayerInfo(Protocol):
    """``model_executor.model_runner_components.layer_setup.ModelLayerInfo``."""

    num_effective_layers: int  # the layers this rank's pool holds


class MemoryPoolConfig(Protocol):
    """``model_executor.pool_configurator.MemoryPoolConfig``: the pools' sizes SGLang chose."""

    max_total_num_tokens: int


class KVCacheConfigurator(Protocol):
    """``mem_cache.kv_cache_configurator.KVCacheConfigurator``: what sizes the KV pool."""

    model_config: ModelConfig
    layer_info: ModelLayerInfo
    kv_cache_dtype: torch.dtype
    page_size: int


class NormOp(Protocol):
    """``layers.layernorm.RMSNorm``: what torch_cpu's C forward reads of it."""

    weight: torch.Tensor
    variance_epsilon: float
    variance_size_override: Optional[int]
    override_orig_dtype: Optional[torch.dtype]

    def forward_native(self, x: torch.Tensor, *args: object) -> Any: ...


class RotaryOp(Protocol):
    """``layers.rotary_embedding.base.RotaryEmbedding``: what torch_cpu's C forward reads of it."""

    head_size: int
    rotary_dim: int
    is_neox_style: bool
    cos_sin_cache: torch.Tensor

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, *args: object) -> Any: ...


class LinearLayer(Protocol):
    """``layers.linear.LinearBase`` (or the ``VocabParallelEmbedding`` an LM head is):
    what torch_cpu's C linear reads of it (``use_intel_amx_backend``, a packed weight's
    flag SGLang sets on the layer, is read with ``getattr``)."""

    weight: torch.Tensor


class LinearMethod(Protocol):
    """``layers.quantization.unquant.UnquantizedLinearMethod``: the method torch_cpu's C
    linear stands in for (it reads nothing of it but hands it back to SGLang's ``apply``)."""


class LogitsProcessor(Protocol):
    """``layers.logits_processor.LogitsProcessor``: the LM-head options torch_cpu's C
    linear must leave to SGLang."""

    use_fp32_lm_head: bool
    rl_on_policy_target: Optional[str]
