"""SGLang's radix tree cache as the plugin uses it: the tree core and its nodes, locks and
their receipts, a host insert's result, the device KV allocator, HiCache's host pool and its
group, and the tree cache that holds them.

With SGLang's unified radix cache (HiCache's, the one the hot set's release needs) a tree
node is named by its ``NodeId`` (``tree_core.node_by_id`` finds the node); the fold also
serves the older caches, whose requests hold the node itself (``NodeHandle``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    import torch

    from sgl_importance.sglang_types.model import KVPool, ReqToTokenPool


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
    free_group: Optional[list[torch.Tensor]]  # None: a free frees at once; a list: held until free_group_end

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


class CacheMetricsCollector(Protocol):
    """``observability.metrics_collector.RadixCacheMetricsCollector``: the cache's series."""

    labels: dict[str, str]  # the rank's labels


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
    metrics_collector: Optional[CacheMetricsCollector]  # None unless --enable-metrics

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
