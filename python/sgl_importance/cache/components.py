"""The FULL tree component the unified radix cache builds under ``importance``.

Three jobs:

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
- Counting evictions by tier, with the evicted node's importance
  (``sgl_importance:evicted_*``), when SGLang's metrics are on; noting nodes
  demoted while important (the prefetch's warm candidates) and prefetched nodes
  evicted before use (``cache/prefetch.py``), and remembering the importance of
  pages dropped to the storage tier (``cache/stored.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

from sgl_importance.cache.admission import split_state
from sgl_importance.cache.prefetch import mark_evicted
from sgl_importance.cache.strategy import POLICY_NAME
from sgl_importance.importance.persistent import ImportanceAggregator
from sgl_importance.metrics import importance_metrics


class ImportanceFullComponent(FullComponent):
    """SGLang's FULL component; splits also carry node importance, and evictions
    are counted by tier when SGLang's metrics are on."""

    def _aggregator(self) -> Optional[ImportanceAggregator]:
        return getattr(self.tree_core.eviction_strategy, "aggregator", None)

    def redistribute_on_node_split(self, new_parent: Any, child: Any) -> None:
        super().redistribute_on_node_split(new_parent, child)
        aggregator = self._aggregator()
        if aggregator is not None:
            aggregator.split(new_parent, child, len(new_parent.key), self.tree_core.page_size)
        split_state(new_parent, child)

    def evict_component(
        self,
        node: Any,
        device_frees: dict,
        host_frees: dict,
        cache_actions: list,
        target: EvictLayer = EvictLayer.DEVICE,
    ) -> tuple[int, int]:
        freed, host_freed = super().evict_component(
            node, device_frees, host_frees, cache_actions, target=target
        )
        if freed:
            mark_evicted(self.cache, node, freed)
            self._remember_if_warm(node)
        if host_freed and getattr(self.cache, "enable_storage", False):
            # Leaving the tree for good; the storage tier may bring it back.
            stored = getattr(self.tree_core.eviction_strategy, "stored", None)
            if stored is not None:
                stored.remember(node)
        if freed or host_freed:
            metrics = importance_metrics(self.cache)
            aggregator = self._aggregator()
            if metrics is not None and aggregator is not None:
                normalised = aggregator.normalised(node)
                if freed:
                    metrics.evicted("device", freed, normalised)
                if host_freed:
                    metrics.evicted("host", host_freed, normalised)
        return freed, host_freed

    def _remember_if_warm(self, node: Any) -> None:
        # Demoted (host copy kept) while important: a candidate to warm back.
        strategy = self.tree_core.eviction_strategy
        warm = getattr(strategy, "warm", None)
        aggregator = self._aggregator()
        if warm is None or aggregator is None or not node.backuped:
            return
        threshold = strategy.config.prefetch_min_importance
        if threshold > 0.0 and aggregator.normalised(node) >= threshold:
            warm.add(node)


def uses_importance_policy(params: Any) -> bool:
    return (getattr(params, "eviction_policy", None) or "").lower() == POLICY_NAME


def use_importance_components(params: Any) -> None:
    """Before ``UnifiedRadixCache(params)``: install the FULL override for ``importance``.

    Mutates ``params`` (a ``CacheInitParams``); other policies are left untouched.
    """
    if not uses_importance_policy(params) or getattr(params, "disable", False):
        return
    _require_single_tree_rank(params)
    params.component_registry_override = {
        **(params.component_registry_override or {}),
        ComponentType.FULL: ImportanceFullComponent,
    }


def _require_single_tree_rank(params: Any) -> None:
    # Each tensor-parallel rank sees different heads, so its importance differs;
    # eviction decisions must be identical on every rank or the trees diverge.
    # Until node importance is all-reduced over the tree-cache group, refuse.
    group = getattr(params, "tp_cache_group", None)
    if (
        group is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size(group=group) > 1
    ):
        raise ValueError(
            f"--radix-eviction-policy {POLICY_NAME} supports --tp-size 1 only "
            "(per-rank importance is not yet all-reduced across the tree-cache group)"
        )
