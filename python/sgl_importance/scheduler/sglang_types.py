"""What the scheduler hooks use of SGLang's objects, as Protocols: one place to read it.

The hooks in ``scheduler/`` are handed SGLang's own objects (a request, its batch, the
scheduler, the radix tree cache and its tree core, the KV allocator, HiCache's host pool).
Each Protocol here stands for one of them and lists only the attributes and methods the
plugin reads, writes or calls on it, with the types SGLang 0.5.23 gives them (its class is
named in the docstring), so a field SGLang renames or retypes shows up in one place. They
are for typing only: nothing here imports SGLang (nor anything of the plugin), and no
object is checked against them at run time.

With SGLang's unified radix cache (HiCache's, the one the hot set's release needs) a tree
node is named by its ``NodeId`` (``tree_core.node_by_id`` finds the node); the fold also
serves the older caches, whose requests hold the node itself (``NodeHandle``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    import torch

NodeId = int  # a tree node's id in the unified radix cache (``unified_tree_core_interface.NodeId``)


class RadixKey(Protocol):
    """``mem_cache.radix_cache.RadixKey``: a node's tokens (the plugin builds one for a host insert)."""

    def __len__(self) -> int: ...


class NodeComponent(Protocol):
    """``unified_cache.components.base.ComponentData``: one component's data on a tree node."""

    host_value: Optional[torch.Tensor]  # host slots of its tokens; None without a host copy


class TreeNode(Protocol):
    """``unified_cache.unified_tree_core.UnifiedTreeNode`` (the fold also reads
    ``radix_cache.TreeNode``'s ``parent``, ``key``, ``hash_value`` and ``hit_count``)."""

    id: int
    parent: Optional[TreeNode]  # None: the root
    key: Optional[RadixKey]
    component_data: Sequence[NodeComponent]  # by ``ComponentType``
    hash_value: Optional[list[str]]  # its pages' storage hashes
    hit_count: int


NodeHandle = Union[NodeId, TreeNode]  # what a request holds of its node: a NodeId, or the node (older caches)


class LockReceipt(Protocol):
    """``base_prefix_cache.DecLockRefParams``: a lock's receipt, handed back to release it (opaque)."""


class HostLockResult(Protocol):
    """``base_prefix_cache.IncLockRefResult``: what taking a host lock returns."""

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


class TreeCore(Protocol):
    """``unified_cache.unified_tree_core_interface.UnifiedTreeCoreInterface`` (the Python
    core; the Rust one raises ``NotImplementedError`` from ``node_by_id``)."""

    is_eagle: bool

    def node_by_id(self, node_id: NodeId) -> TreeNode: ...

    def is_full_device_evicted(self, node_id: NodeId) -> bool: ...

    def insert_host(
        self, node_id: NodeId, key: RadixKey, host_value: torch.Tensor, hash_value: list[str]
    ) -> InsertResult: ...


class WriteThrough(Protocol):
    """``unified_radix_cache._OngoingWriteThrough``: a device → host copy of nodes in flight."""

    node_id: NodeId
    publish_node_ids: list[NodeId]


class DeviceKVPool(Protocol):
    """``mem_cache.memory_pool.KVCache``: the device KV pool (the allocator's)."""

    device: str


class KVAllocator(Protocol):
    """``mem_cache.allocator.base.BaseTokenToKVPoolAllocator``: the device KV slots."""

    page_size: int
    device: str

    def alloc(self, need_size: int) -> Optional[torch.Tensor]: ...  # None: not enough free

    def free(self, free_index: torch.Tensor) -> None: ...

    def get_kvcache(self) -> DeviceKVPool: ...


class ReqToTokenPool(Protocol):
    """``mem_cache.memory_pool.ReqToTokenPool``: each request row's KV slots."""

    req_to_token: torch.Tensor  # [rows, context] slots


class HostPool(Protocol):
    """HiCache's host KV pool (``mem_cache.memory_pool_host.HostKVCache``; on torch_cpu and
    torch_cuda ``platform/host_pool.TorchMHAHostPool``, which adds ``ledger`` and ``gather_layer``)."""

    size: int  # token slots
    layer_num: int
    slot_used: torch.Tensor  # a bool per slot: allocated
    ledger: object  # the hot set's ``hot_set/host_ledger`` check, or None

    def backup_from_device_all_layer(
        self, device_pool: DeviceKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None: ...

    def load_to_device_per_layer(
        self,
        device_pool: DeviceKVPool,
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

    def root_node_handle(self, extra_key: Optional[str] = None) -> NodeId: ...

    def path_device_indices(self, node: NodeId) -> torch.Tensor: ...

    def lock(self, node_id: NodeId) -> Optional[TreeLock]: ...

    def unlock(self, lock: Optional[TreeLock]) -> None: ...

    def inc_host_lock_ref(self, node_id: NodeId) -> HostLockResult: ...

    def dec_host_lock_ref(self, node_id: NodeId, params: LockReceipt) -> object: ...

    def evict_host(self, num_tokens: int) -> int: ...

    def write_backup_storage(self, node_id: NodeId) -> None: ...

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


class ModelConfig(Protocol):
    """``configs.model_config.ModelConfig``."""

    context_len: int


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
