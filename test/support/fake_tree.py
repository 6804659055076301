"""One hand-built radix tree for the unit tests: nodes, tree core and cache.

It mirrors SGLang's unified radix cache where the plugin reads it, under SGLang's
own attribute names (``UnifiedTreeNode``, ``UnifiedTreeCore``, ``UnifiedRadixCache``);
``test_sglang_contract.py`` checks that every attribute these fakes carry exists on
SGLang's real classes, so a rename in SGLang fails there instead of leaving the
fakes to test a tree that no longer exists. Each node's per-component data is
SGLang's own ``ComponentData``, so ``evicted`` / ``backuped`` are derived from it as
SGLang derives them.

Tests that need SGLang's real tree (its splits, its eviction walk) build a real
``UnifiedRadixCache`` instead; this fake is for the plugin's own logic.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional, Sequence

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import ComponentData
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import TreePathNodeInfo

from sgl_importance.node_state import node_state

FULL = int(ComponentType.FULL)


class FakeNode:
    """A radix-tree node with ``UnifiedTreeNode``'s attribute names."""

    def __init__(self, node_id: int, parent: Optional["FakeNode"], tokens: int) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[Any, FakeNode] = {}
        self.key = list(range(tokens))
        self.component_data = [ComponentData() for _ in ComponentType]
        self.last_access_time = 0.0
        self.creation_time = 0.0
        self.hit_count = 0
        self.hash_value: Optional[list[str]] = None
        if parent is not None:
            parent.children[node_id] = self

    @property
    def backuped(self) -> bool:
        return self.component_data[FULL].host_value is not None

    @property
    def evicted(self) -> bool:
        return self.parent is not None and self.component_data[FULL].value is None

    def __repr__(self) -> str:
        return f"FakeNode(id={self.id}, tokens={len(self.key)})"


def detached_node(**fields: Any) -> FakeNode:
    """A node outside any tree (for the strategy and aggregator, which read one node)."""
    node = FakeNode(-1, None, 0)
    _set(node, **fields)
    return node


def _set(
    node: FakeNode,
    *,
    last: Optional[float] = None,
    hits: Optional[int] = None,
    importance: Optional[float] = None,
    pinned: bool = False,
    hashes: Optional[Sequence[str]] = None,
) -> None:
    if last is not None:
        node.last_access_time = float(last)
    if hits is not None:
        node.hit_count = hits
    if importance is not None:
        # What a fold leaves on a node (importance/aggregator.py).
        state = node_state(node)
        state.importance, state.pinned = importance, pinned
    if hashes is not None:
        node.hash_value = list(hashes)


class FakeTreeCore:
    """The tree core: root, nodes by id, paths, evictable device leaves, the strategy.

    Node ids count up from 1 in the order nodes are added (the root is 0).
    """

    def __init__(self, eviction_strategy: Any = None, page_size: int = 16) -> None:
        self.root_node = FakeNode(0, None, 0)
        self.nodes: dict[int, FakeNode] = {}
        self.eviction_strategy = eviction_strategy
        self.page_size = page_size

    def add(
        self,
        parent: Optional[FakeNode] = None,
        tokens: int = 16,
        *,
        device: bool = True,
        first_slot: Optional[int] = None,
        host: bool = True,
        **fields: Any,
    ) -> FakeNode:
        """A child of ``parent`` (the root by default).

        Args:
            device: KV on the device (a FULL value); its slots start at ``first_slot``
                (0 when not given).
            host: KV backed up on the host (a FULL host value).
            fields: ``last``, ``hits``, ``importance`` / ``pinned``, ``hashes``.
        """
        node = FakeNode(len(self.nodes) + 1, parent or self.root_node, tokens)
        data = node.component_data[FULL]
        if device or first_slot is not None:
            start = first_slot or 0
            data.value = torch.arange(start, start + tokens, dtype=torch.int64)
        if host:
            data.host_value = torch.arange(tokens, dtype=torch.int64)
        _set(node, **fields)
        self.nodes[node.id] = node
        return node

    def node_by_id(self, node_id: int) -> FakeNode:
        if node_id == 0:
            return self.root_node
        return self.nodes[node_id]  # KeyError for a deleted node, as SGLang

    def collect_path_info(self, end_node_ids: Sequence[int]) -> tuple[tuple[TreePathNodeInfo, ...], ...]:
        """As SGLang's: each node's root-to-node path, token offsets counted from the root."""
        paths = []
        for node_id in end_node_ids:
            node = self.node_by_id(node_id)
            chain = []
            while node is not self.root_node:
                chain.append(node)
                node = node.parent
            path, start = [], 0
            for node in reversed(chain):
                end = start + len(node.key)
                value = node.component_data[FULL].value
                info = (node.id, node.parent.id, start, end, None if value is None else len(value), len(node.children))
                path.append(TreePathNodeInfo(*info))
                start = end
            paths.append(tuple(path))
        return tuple(paths)

    @property
    def evictable_device_leaves(self) -> set:
        return {
            n
            for n in self.nodes.values()
            if not n.evicted
            and all(c.evicted for c in n.children.values())
            and all(cd.lock_ref == 0 for cd in n.component_data)
        }


class FakeCache:
    """``UnifiedRadixCache`` as the plugin reads it: one rank, no metrics, no HiCache
    controller unless a test sets one; device room is ``free`` tokens."""

    def __init__(self, tree_core: FakeTreeCore, free_tokens: int = 0) -> None:
        self.tree_core = tree_core
        self.page_size = tree_core.page_size
        self.free = free_tokens
        self.token_to_kv_pool_allocator = types.SimpleNamespace(available_size=lambda: self.free)
        self.tp_world_size = 1
        self.tp_group = None
        self.metrics_collector = None
        self.cache_controller = None
        self.buffer_pipeline = None
        self.linker = None
        self.enable_storage = False
        self.loaded: list[int] = []

    def is_root(self, node_id: int) -> bool:
        return node_id == self.tree_core.root_node.id

    def inc_lock_ref(self, node_id: int) -> Any:
        self._lock(node_id, +1)
        return types.SimpleNamespace(to_dec_params=lambda: node_id)

    def dec_lock_ref(self, node_id: int, params: Any) -> None:
        self._lock(node_id, -1)

    def _lock(self, node_id: int, delta: int) -> None:
        # As SGLang: a lock holds the node and every ancestor below the root.
        node = self.tree_core.node_by_id(node_id)
        while node.parent is not None:
            node.component_data[FULL].lock_ref += delta
            node = node.parent

    def evictable_tokens(self) -> int:
        return sum(len(n.key) for n in self.tree_core.evictable_device_leaves)

    def load_back(self, node_id: int) -> bool:
        self.loaded.append(node_id)
        return True


class AdmissionCache(FakeCache):
    """The fake cache with SGLang's ``write_backup_storage`` behind the plugin's L3
    admission gate (as its AROUND hook makes it behave); writes are recorded.
    ``shared``: the importance other instances published, as the runtime hands it in."""

    def __init__(self, shared: Any = None, **config: Any) -> None:
        from sgl_importance.cache.state import CacheState
        from sgl_importance.cache.strategy import ImportanceStrategy

        super().__init__(FakeTreeCore(ImportanceStrategy(CacheState(config, shared=lambda: shared))))
        self.written: list[int] = []

    @property
    def aggregator(self) -> Any:
        return self.tree_core.eviction_strategy.state.aggregator

    def add(
        self,
        parent: Optional[FakeNode] = None,
        hits: int = 0,
        importance: Optional[float] = None,
        pinned: bool = False,
        backuped: bool = True,
        tokens: int = 16,
        hashes: Optional[Sequence[str]] = None,
    ) -> FakeNode:
        return self.tree_core.add(
            parent, tokens, host=backuped, hits=hits, importance=importance, pinned=pinned, hashes=hashes
        )

    def _original_write(self, cache: Any, node_id: int) -> None:
        self.written.append(node_id)

    def write_backup_storage(self, node_id: int) -> None:
        from sgl_importance.cache.admission import gate_storage_write

        gate_storage_write(self._original_write, self, node_id)


def scheduler_of(cache: Any, **fields: Any) -> types.SimpleNamespace:
    """A scheduler as the plugin's hooks see it: its tree cache and queues."""
    fields.setdefault("waiting_queue", [])
    fields.setdefault("disaggregation_mode", types.SimpleNamespace(value="null"))
    return types.SimpleNamespace(tree_cache=cache, **fields)


def request(**fields: Any) -> types.SimpleNamespace:
    """A scheduler request with the fields the plugin reads (``Req``'s names)."""
    defaults: dict[str, Any] = {
        "last_node": None,
        "host_hit_length": 0,
        "best_match_node": None,
        "extra_key": None,
        "cache_salt": None,
    }
    return types.SimpleNamespace(**{**defaults, **fields})


def decode_batch(reqs: Sequence[Any], decode: bool = True) -> types.SimpleNamespace:
    """A scheduler batch: its requests and whether it was a decode batch."""
    is_decode: Callable[[], bool] = lambda: decode  # noqa: E731
    return types.SimpleNamespace(reqs=list(reqs), forward_mode=types.SimpleNamespace(is_decode=is_decode))


def runtime_of(scheduler: Any, table: Any = None) -> Any:
    """The runtime the plugin hands scheduler hooks: ``scheduler``'s cache state (as
    ``Runtime.attach_scheduler`` finds it) and ``table`` as the page importance."""
    from sgl_importance.cache.state_of import state_of
    from sgl_importance.runtime import Runtime

    rt = Runtime()
    rt.cache_state = state_of(scheduler.tree_cache)
    rt.page_importance.current = table
    return rt
