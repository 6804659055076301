"""After each decode batch: fold the page importance table into the running requests' tree nodes.

Runs in the scheduler process right after ``Scheduler.process_batch_result`` (in the
overlap loop, while the next batch is already running), never on the eviction path:
eviction reads only the plain floats this leaves on the nodes.

A request's attended tree nodes are its ``last_node`` and every ancestor up to the
root — the prompt, checkpointed into the tree after prefill; generated tokens join
the tree when the request finishes. Nodes shared by several requests are folded
once (the page importance table already summed their masses). The nodes' physical
pages are ``cache/device_pages.py``'s.

Everything it needs comes from the runtime the plugin hands in: the page importance
table, the state of the scheduler's cache under ``importance`` (its aggregator and
the shared importance; None under other policies) and the metrics.

With tensor parallelism every rank runs this after every batch, but each rank's
table holds only its own heads' attention: the ranks agree on the gathered page
values (their mean) and the step count (the minimum) over the cache's tree group,
SGLang's CPU group for tree consensus, so every rank's tree gets identical
importance and makes identical eviction decisions. The early returns before that
collective depend only on what all ranks share (policy, batch, backend).

After the fold, deferred nodes that now qualify for the storage tier are written
(``cache/admission.py``).

The table is read as it stands after the step; under overlap it may already hold
the next batch's step. The signal is a moving average, so a step attributed one
batch late changes nothing that matters, and no GPU stream is waited on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Optional

from sgl_importance.cache.admission import admit_deferred
from sgl_importance.cache.device_pages import device_pages
from sgl_importance.cache.prefetch import mark_used
from sgl_importance.importance.aggregator import Observation
from sgl_importance.importance.page_importance import PageImportanceHolder
from sgl_importance.node_state import node_importance
from sgl_importance.runtime import Runtime
from sgl_importance.sglang_types.scheduler import Req, ScheduleBatch, Scheduler
from sgl_importance.sglang_types.tree import NodeHandle, TreeCache, TreeCore, TreeNode

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def fold_after_batch(runtime: Runtime, scheduler: Scheduler, batch: Optional[ScheduleBatch]) -> int:
    """Fold the latest recorded decode step into ``batch``'s tree nodes.

    Args:
        runtime: the process's runtime (the cache's state, the table, the metrics).
        scheduler, batch: ``Scheduler.process_batch_result``'s.

    Returns:
        Recorded steps folded (0 when the policy is not ``importance``, the batch
        was no decode batch, or no new step was recorded).
    """
    state = runtime.cache_state
    if state is None or batch is None or not batch.forward_mode.is_decode():
        return 0
    tree_cache = scheduler.tree_cache
    aggregator = state.aggregator
    table = runtime.page_importance.current
    if table is None:
        _warn_no_table(runtime.page_importance)
        return 0
    metrics = runtime.metrics.importance(tree_cache)
    observations = list(observe(tree_cache.tree_core, batch.reqs, table.page_size))
    mark_used(metrics, (o.node for o in observations))
    # Past this line every rank of the tree group must reach the collective.
    steps = aggregator.fold(table, observations, tree_group(tree_cache))
    if steps:
        # Deferred nodes that earned importance now go to the storage tier.
        admit_deferred(tree_cache, (o.node for o in observations))
        shared = state.shared
        if shared is not None:
            # Queued only; the shared store is written off this thread.
            for o in observations:
                hashes = o.node.hash_value
                if hashes:
                    shared.publish(hashes, node_importance(o.node), o.node.hit_count)
        if metrics is not None:
            normalised = [aggregator.normalised(o.node) for o in observations]
            metrics.folded(steps, aggregator.scale, normalised)
    return steps


def tree_group(tree_cache: TreeCache) -> Optional[torch.distributed.ProcessGroup]:
    """The process group whose ranks share ``tree_cache``'s tree, or None for one rank.

    SGLang's ``UnifiedRadixCache`` keeps its ``tp_cache_group`` (the CPU group of
    the ranks that run one batch) as ``tp_group`` and its size as ``tp_world_size``;
    its own rank consensus all-reduces over that group. None when the size is 1,
    so a single rank folds without any collective.
    """
    if tree_cache.tp_world_size <= 1:
        return None
    return tree_cache.tp_group


def observe(tree_core: TreeCore, reqs: Iterable[Req], page_size: int) -> Iterable[Observation]:
    """Each distinct device-resident node on the requests' paths, with its position."""
    seen: set[int] = set()
    for req in reqs:
        node = _resolve(tree_core, req.last_node)
        path = []
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        start = 0
        for node in reversed(path):
            length = len(node.key)
            if id(node) not in seen:
                seen.add(id(node))
                pages = device_pages(node, page_size)
                if pages is not None:
                    yield Observation(node, start, pages)
            start += length


def _resolve(tree_core: TreeCore, handle: Optional[NodeHandle]) -> Optional[TreeNode]:
    # The unified cache hands requests NodeIds; a node can be gone by the time a
    # finished request's handle is read.
    if handle is None:
        return None
    if isinstance(handle, int):
        try:
            return tree_core.node_by_id(handle)
        except KeyError:
            return None
    return handle


def _warn_no_table(page_importance: PageImportanceHolder) -> None:
    if not page_importance.warned_missing:
        page_importance.warned_missing = True
        logger.warning(
            "--radix-eviction-policy importance: no page importance is recorded with "
            "this attention backend; eviction falls back to recency and reuse. "
            "Use --attention-backend importance_torch (CPU) or importance_triton (GPU)."
        )
