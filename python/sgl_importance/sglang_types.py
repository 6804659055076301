"""What the plugin uses of SGLang's objects, as Protocols: one place to read it.

The scheduler hooks are handed SGLang's own objects (a request, its batch, the scheduler, the
radix tree cache and its tree core, the KV allocator, HiCache's host pool), and so are the
attention backends' shared code, the hot set's construction, the graph hooks and the KV
pool's sizing (the model runner and its KV pool, a forward batch, an attention layer, the
decode graph runner, the KV cache configurator). Each Protocol here stands for one SGLang
class and lists only the attributes and methods the plugin reads, writes or calls on it, with
the types SGLang 0.5.23 gives them (its class is named in the docstring), so a field SGLang
renames or retypes shows up in one place. They are for typing only: nothing here imports
SGLang (nor anything of the plugin), and no object is checked against them at run time. The
backends themselves subclass SGLang's backends and name SGLang's classes.

With SGLang's unified radix cache (HiCache's, the one the hot set's release needs) a tree
node is named by its ``NodeId`` (``tree_core.node_by_id`` finds the node); the fold also
serves the older caches, whose requests hold the node itself (``NodeHandle``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    import torch

NodeId = int  # a tree node's id in the unified radix cache (``unified_tree_core_interface.NodeId``)


class RadixKey(Protocol):
    """``mem_cache.radix_cache.RadixKey``: a node's tokens (the plugin builds one for a host insert)."""

    def __len__(self) -> int: ...


class NodeComponent(Protocol):
    """``unified_cache.components.base.ComponentData``: one component's data on a tree node."""

    host_value: Optional[torch.Tensor]  # host slots of its tokens; None without a host copy
    value: Optional[torch.Tensor]  # device slots of its tokens; None when evicted
    lock_ref: int  # requests holding it on the device


class TreeNode(Protocol):
    """``unified_cache.unified_tree_core.UnifiedTreeNode`` (the fold also reads
    ``radix_cache.TreeNode``'s ``parent``, ``key``, ``hash_value`` and ``hit_count``)."""

    id: int
    parent: Optional[TreeNode]  # None: the root
    children: dict[Any, TreeNode]  # by the child's first page of tokens
    key: Optional[RadixKey]
    component_data: Sequence[NodeComponent]  # by ``ComponentType``
    hash_value: Optional[list[str]]  # its pages' storage hashes
    hit_count: int
    last_access_time: float  # the eviction clock's tick (a numpy float64)

    @property
    def evicted(self) -> bool: ...  # no device copy (never the root)
    @property
    def backuped(self) -> bool: ...  # a host copy


NodeHandle = Union[NodeId, TreeNode]  # what a request holds of its node: a NodeId, or the node (older caches)


class LockReceipt(Protocol):
    """``base_prefix_cache.DecLockRefParams``: a lock's receipt, handed back to release it (opaque)."""


class HostLockResult(Protocol):
    """``base_prefix_cache.IncLockRefResult``: what taking a lock (device or host) returns."""

    def to_dec_params(self) -> LockReceipt: ...


class TreeLock(Protocol):
    """``base_prefix_cache.TreeLock``: a request's device lock on its matched node."""

    node: NodeId


class InsertResult(Protocol):
    """``base_prefix_cache.InsertResult``, of ``insert_host``."""

    prefix_len: int  # tokens of the key the tree held already
    cache_actions: list[object]  # for ``TreeCache._apply_cache_actions``
    host_insert_dropped: bool
    inserted_host_node: Optional[NodeId]


class TreePathNodeInfo(Protocol):
    """``unified_cache.unified_tree_core_interface.TreePathNodeInfo``: a node on a root-to-node path."""

    node_id: NodeId
    path_start: int  # its tokens' offsets from the root, half-open
    path_end: int


class TreeCore(Protocol):
    """``unified_cache.unified_tree_core_interface.UnifiedTreeCoreInterface`` (the Python
    core, ``UnifiedTreeCore``, adds ``evictable_device_leaves``; the Rust one raises
    ``NotImplementedError`` from ``node_by_id``)."""

    is_eagle: bool
    evictable_device_leaves: set[TreeNode]

    def node_by_id(self, node_id: NodeId) -> TreeNode: ...
    def is_full_device_evicted(self, node_id: NodeId) -> bool: ...
    def collect_path_info(self, end_node_ids: Sequence[NodeId]) -> tuple[tuple[TreePathNodeInfo, ...], ...]: ...
    def insert_host(
        self, node_id: NodeId, key: RadixKey, host_value: torch.Tensor, hash_value: list[str]
    ) -> InsertResult: ...


class WriteThrough(Protocol):
    """``unified_radix_cache._OngoingWriteThrough``: a device → host copy of nodes in flight."""

    node_id: NodeId
    publish_node_ids: list[NodeId]


class KVAllocator(Protocol):
    """``mem_cache.allocator.base.BaseTokenToKVPoolAllocator``: the device KV slots."""

    page_size: int
    device: str

    def alloc(self, need_size: int) -> Optional[torch.Tensor]: ...  # None: not enough free
    def free(self, free_index: torch.Tensor) -> None: ...
    def available_size(self) -> int: ...  # free tokens
    def get_kvcache(self) -> KVPool: ...


class HostPool(Protocol):
    """HiCache's host KV pool (``mem_cache.memory_pool_host.HostKVCache``; on torch_cpu and
    torch_cuda ``platform/host_pool.TorchMHAHostPool``, which adds ``ledger`` and ``gather_layer``)."""

    size: int  # token slots
    layer_num: int
    slot_used: torch.Tensor  # a bool per slot: allocated
    ledger: object  # the hot set's ``hot_set/host_ledger`` check, or None
    dtype: torch.dtype  # the storage tier's page geometry: dtype, page size, layout
    page_size: int
    layout: str

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor: ...  # the page at slot ``index``
    def get_dummy_flat_data_page(self) -> torch.Tensor: ...  # a scratch page of the flat shape
    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None: ...
    def backup_from_device_all_layer(
        self, device_pool: KVPool, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None: ...
    def load_to_device_per_layer(
        self,
        device_pool: KVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
    ) -> None: ...
    def gather_layer(self, layer_id: int, host_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class HostPoolEntry(Protocol):
    """``mem_cache.pool_host.group.PoolEntry``."""

    host_pool: HostPool


class HostPoolGroup(Protocol):
    """``mem_cache.pool_host.group.HostPoolGroup``: HiCache's host pools, the KV one the anchor."""

    anchor_entry: HostPoolEntry

    def alloc(self, need_size: int, *, reclaim: Optional[Callable[[int], object]] = None) -> Optional[torch.Tensor]: ...

    def free(self, indices: torch.Tensor) -> int: ...


class CacheController(Protocol):
    """``mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController``."""

    io_backend: str


class TreeCache(Protocol):
    """``mem_cache.unified_radix_cache.UnifiedRadixCache``: the radix tree cache (HiCache's
    with a host pool); the fold reads only ``tree_core``, ``tp_world_size`` and ``tp_group``."""

    token_to_kv_pool_allocator: KVAllocator
    req_to_token_pool: ReqToTokenPool
    tree_core: TreeCore
    cache_controller: Optional[CacheController]  # None without a host pool
    host_pool_group: HostPoolGroup  # set with the host pool
    ongoing_write_through: Mapping[int, WriteThrough]
    linker: Optional[object]  # only tested for None
    buffer_pipeline: Optional[object]  # only tested for None
    tp_world_size: int
    tp_group: Optional[torch.distributed.ProcessGroup]
    page_size: int

    def root_node_handle(self, extra_key: Optional[str] = None) -> NodeId: ...
    def is_root(self, node_id: NodeId) -> bool: ...
    def supports_swa(self) -> bool: ...
    def supports_mamba(self) -> bool: ...
    def path_device_indices(self, node: NodeId) -> torch.Tensor: ...
    def lock(self, node_id: NodeId) -> Optional[TreeLock]: ...
    def unlock(self, lock: Optional[TreeLock]) -> None: ...
    def inc_lock_ref(self, node_id: NodeId) -> HostLockResult: ...
    def dec_lock_ref(self, node_id: NodeId, params: LockReceipt) -> object: ...
    def inc_host_lock_ref(self, node_id: NodeId) -> HostLockResult: ...
    def dec_host_lock_ref(self, node_id: NodeId, params: LockReceipt) -> object: ...
    def load_back(self, node_id: NodeId) -> bool: ...  # False: not queued
    def evict_host(self, num_tokens: int) -> int: ...
    def write_backup_storage(self, node_id: NodeId) -> None: ...
    def _all_reduce(self, data: torch.Tensor, tp_reduce_op: torch.distributed.ReduceOp) -> None: ...
    def _apply_cache_actions(self, actions: list[object]) -> None: ...


class SamplingParams(Protocol):
    """``sampling.sampling_params.SamplingParams``."""

    max_new_tokens: Optional[int]
    min_new_tokens: int
    ignore_eos: bool
    custom_params: Optional[dict[str, Any]]  # JSON from the request


class ReqKvInfo(Protocol):
    """``managers.schedule_batch.ReqKvInfo``: the device KV a request holds (``Req.kv``)."""

    req_pool_idx: Optional[int]  # its ``req_to_token`` row
    cache_protected_len: int  # the tree owns [0, here) of the row
    kv_committed_len: int

    @property
    def holds_kv(self) -> bool: ...


class ReqTimeStats(Protocol):
    """``observability.req_time_stats.SchedulerReqTimeStats``: a request's clock in the scheduler."""

    scheduler_recv_time: float  # when the scheduler received it (0.0: not yet)


class Req(Protocol):
    """``managers.schedule_batch.Req``: a request in the scheduler."""

    rid: str
    sampling_params: SamplingParams
    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    full_untruncated_fill_ids: Sequence[int]  # the prompt, then what it generated
    extend_end: Optional[int]  # end of this extend; None outside one
    prefix_len: int  # matched prefix on the device
    host_hit_length: int
    swa_host_hit_length: int
    mamba_host_hit_length: int
    host_loaded_length: int
    kv: ReqKvInfo
    last_node: Optional[NodeHandle]
    best_match_node: NodeId
    lock: Optional[TreeLock]
    skip_radix_cache_insert: bool
    extra_key: Optional[str]
    cache_salt: Optional[str]
    cached_tokens: int  # of its prompt, matched in the cache
    time_stats: ReqTimeStats

    @property
    def auxiliary_swa_host_hit_length(self) -> int: ...
    @property
    def seqlen(self) -> int: ...
    def finished(self) -> bool: ...
    def refresh_fill_ids(self) -> None: ...
    def owned_kv_len(self) -> int: ...
    def set_finish_with_abort(self, error_msg: str) -> None: ...


class GenerateReqInput(Protocol):
    """``managers.io_struct.TokenizedGenerateReqInput``: a request as it reaches the scheduler."""

    rid: Optional[str]
    sampling_params: SamplingParams


class ForwardMode(Protocol):
    """``model_executor.forward_batch_info.ForwardMode``."""

    def is_decode(self) -> bool: ...


class ScheduleBatch(Protocol):
    """``managers.schedule_batch.ScheduleBatch``."""

    reqs: list[Req]
    seq_lens_cpu: Optional[torch.Tensor]
    forward_mode: ForwardMode
    req_to_token_pool: ReqToTokenPool
    tree_cache: TreeCache
    batch_is_full: bool


class PrefillAdmission(Protocol):
    """``managers.schedule_policy._PrefillAdmission``: the shape ``PrefillAdder`` chose for a prefill."""

    max_new_tokens: int
    is_chunked: bool


class Scheduler(Protocol):
    """``managers.scheduler.Scheduler``."""

    tree_cache: TreeCache
    running_batch: ScheduleBatch
    model_config: ModelConfig
    max_total_num_tokens: int  # the device KV pool's tokens
    max_req_len: int
    max_req_input_len: int
    chunked_prefill_size: Optional[int]
    max_new_tokens_limit: Optional[int]  # SGLANG_MAX_NEW_TOKENS_LIMIT
    waiting_queue: list[Req]  # head first
    disaggregation_mode: enum.Enum  # ``disaggregation.utils.DisaggregationMode``


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
