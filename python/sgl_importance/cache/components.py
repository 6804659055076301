"""The FULL tree component the unified radix cache builds under ``importance``.

Four jobs:

- A radix split (``UnifiedTreeCore._split_node``) creates a new prefix node and
  leaves the suffix in the old object; SGLang's FULL component divides the KV
  indices, this subclass also hands the node's importance to the new prefix
  (:meth:`ImportanceAggregator.split`: both halves keep the density) and its
  storage-admission decision (``cache/admission.py``). Demotion to
  the host tier and load-back keep the node object, so they need nothing here.
- Being a component override at all: SGLang builds the Rust tree core by default,
  which never calls a Python eviction strategy; a FULL override makes SGLang's own
  selection (``tree_core_registry._rust_fallback_reason``) choose the Python core,
  for this cache only and only when the policy is ``importance``.
- Recording each new leaf's tokens on the cache's ``TurnoverClock`` (with the device
  pool's size), the clock of the priority's ``credit`` form.
- Counting evictions by tier, with the evicted node's importance
  (``sgl_importance:evicted_*``), when SGLang's metrics are on; noting nodes
  demoted while important (the prefetch's warm candidates) and prefetched nodes
  evicted before use (``cache/prefetch.py``), and remembering the importance of
  pages dropped to the storage tier (``cache/stored.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

from sgl_importance.cache.admission import split_state
from sgl_importance.cache.prefetch import mark_evicted
from sgl_importance.cache.state import CacheState
from sgl_importance.importance.priority import POLICY_NAME

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_importance.sglang_types.tree import InsertResult, TreeCache, TreeNode


class ImportanceFullComponent(FullComponent):
    """SGLang's FULL component; splits also carry node importance, and evictions
    are counted by tier when SGLang's metrics are on."""

    @property
    def _state(self) -> CacheState:
        # Installed only under ``importance`` (use_importance_components), so the tree
        # core built this cache's strategy from the policy name: always ours.
        return self.tree_core.eviction_strategy.state

    def redistribute_on_node_split(self, new_parent: TreeNode, child: TreeNode) -> None:
        super().redistribute_on_node_split(new_parent, child)
        self._state.aggregator.split(new_parent, child, len(new_parent.key), self.tree_core.page_size)
        split_state(new_parent, child)

    def commit_insert_component_data(
        self, node: TreeNode, is_new_leaf: bool, params: InsertParams, result: InsertResult, cache_actions: list
    ) -> None:
        super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)
        if is_new_leaf:
            turnover = self._state.turnover
            if not turnover.pool_tokens:
                turnover.pool_tokens = float(self.cache.token_to_kv_pool_allocator.size)
            turnover.record(node.last_access_time, len(node.key))

    def evict_component(
        self,
        node: TreeNode,
        device_frees: dict,
        host_frees: dict,
        cache_actions: list,
        target: EvictLayer = EvictLayer.DEVICE,
    ) -> tuple[int, int]:
        freed, host_freed = super().evict_component(node, device_frees, host_frees, cache_actions, target=target)
        state = self._state
        metrics = state.metrics.importance(self.cache) if freed or host_freed else None
        if freed:
            mark_evicted(metrics, node, freed)
            self._remember_if_warm(node)
        if host_freed and self.cache.enable_storage:
            # Leaving the tree for good; the storage tier may bring it back.
            state.stored.remember(node)
        if freed or host_freed:
            if metrics is not None:
                normalised = state.aggregator.normalised(node)
                if freed:
                    metrics.evicted("device", freed, normalised)
                if host_freed:
                    metrics.evicted("host", host_freed, normalised)
        return freed, host_freed

    def _remember_if_warm(self, node: TreeNode) -> None:
        # Demoted (host copy kept) while important: a candidate to warm back.
        state = self._state
        if not node.backuped:
            return
        threshold = state.config.prefetch_min_importance
        if threshold > 0.0 and state.aggregator.normalised(node) >= threshold:
            state.warm.add(node)


def uses_importance_policy(params: CacheInitParams) -> bool:
    return (params.eviction_policy or "").lower() == POLICY_NAME


def use_importance_components(cache: TreeCache, params: CacheInitParams) -> None:
    """Before ``UnifiedRadixCache(params)``: install the FULL override for ``importance``.

    Mutates ``params`` (a ``CacheInitParams``; ``cache`` is the one being built, not
    read); other policies are left untouched.
    """
    if not uses_importance_policy(params) or params.disable:
        return
    _require_consistent_tree_ranks(params)
    params.component_registry_override = {
        **(params.component_registry_override or {}),
        ComponentType.FULL: ImportanceFullComponent,
    }


def _require_consistent_tree_ranks(params: CacheInitParams) -> None:
    # Every rank sharing a tree must make the same eviction decisions. Tensor
    # parallelism is safe: the fold agrees on page values over the tree-cache group
    # (scheduler/fold.py). These layouts are not, so refuse them at start-up:
    # - pipeline parallelism: each stage records only its own layers, and SGLang
    #   propagates tree decisions along the pipeline, which the fold does not;
    # - attention context parallelism and decode context parallelism: a rank holds
    #   only part of a sequence's KV, so its pages and page ids mean something else.
    refused = []
    if params.pp_size > 1:
        refused.append(f"--pp-size {params.pp_size}")
    if params.attn_cp_size > 1:
        refused.append(f"--attn-cp-size {params.attn_cp_size}")
    dcp_size = _dcp_size()
    if dcp_size > 1:
        refused.append(f"--dcp-size {dcp_size}")
    if refused:
        raise ValueError(
            f"--radix-eviction-policy {POLICY_NAME} does not support {', '.join(refused)}: "
            "importance is agreed across tensor-parallel ranks only "
            "(--tp-size N is supported; pipeline and context parallelism are not)"
        )


def _dcp_size() -> int:
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_dcp_size)
    except (RuntimeError, ValueError):
        # Nothing published (a cache built outside a server, as in tests): no DCP.
        return 1
