"""L3 admission: which host-tier nodes are written to the storage tier.

SGLang writes every node to storage (``UnifiedRadixCache.write_backup_storage``)
as soon as its host backup is acknowledged. Under ``importance`` with
``storage_min_hits`` or ``storage_min_importance`` set, a node is written only once
it *qualifies*: it was hit at least ``storage_min_hits`` times, or its normalised
importance reached ``storage_min_importance``, or it is an attention-sink node.
A node that does not qualify at its acknowledgement is *deferred*: it stays on the
host tier as before, and each fold re-examines the deferred nodes it attended, so a
node that earns importance later is written then. One that never qualifies is not
written; when the host tier evicts it, it is gone, like a node without a storage
backend.

Guarantees:

- Prefix-closed: storage is looked up along a sequence's page-hash chain and stops
  at the first miss, so a node is written only with its deferred ancestors (root
  first), and an ancestor whose child is already admitted is admitted too.
- Only delays or skips writes not yet issued: a write once issued is never
  cancelled, an acknowledged storage copy is never removed, and the host copy is
  untouched (SGLang's host locks still guard the in-flight write).

With a shared storage tier (``storage/shared_importance.py``) hits and importance other
instances published for the node's pages count as well: ``hits`` is this
instance's plus the others', importance the larger of its own and the shared one.

With both thresholds at 0 (the default) every node is written, as in SGLang.
Duck-typed over SGLang's cache and nodes; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from sgl_importance.cache.state_of import state_of
from sgl_importance.importance.aggregator import ImportanceAggregator
from sgl_importance.node_state import node_pinned, node_state, peek_state

if TYPE_CHECKING:
    from sgl_importance.sglang_types.tree import NodeId, TreeCache, TreeNode
    from sgl_importance.storage.shared_importance import SharedImportance

# A node's ``NodeState.storage``: None (never decided), DEFERRED or ADMITTED.
DEFERRED = "deferred"
ADMITTED = "admitted"


class StorageAdmission:
    """The admission rule (see the module docstring).

    Args:
        min_hits: hits that qualify a node (0: hits never qualify on their own).
        min_importance: normalised importance in [0, 1] that qualifies a node
            (0: importance never qualifies on its own).
    """

    def __init__(self, *, min_hits: int = 0, min_importance: float = 0.0) -> None:
        self.min_hits = min_hits
        self.min_importance = min_importance

    @property
    def active(self) -> bool:
        return self.min_hits > 0 or self.min_importance > 0.0

    def qualifies(
        self, node: TreeNode, aggregator: ImportanceAggregator, shared: Optional[SharedImportance] = None
    ) -> bool:
        """Whether ``node`` may be written; ``shared``: the importance other instances
        published through a shared store (``storage/shared``), or None."""
        if not self.active or node_pinned(node):
            return True
        hashes = node.hash_value or ()
        if self.min_hits > 0:
            # Hits any instance sharing the storage tier saw count (theirs from the store).
            hits = node.hit_count + (shared.other_hits(hashes) if shared is not None else 0)
            if hits >= self.min_hits:
                return True
        if self.min_importance <= 0.0:
            return False
        if aggregator.normalised(node) >= self.min_importance:
            return True
        return shared is not None and _shared_normalised(shared, hashes, aggregator) >= self.min_importance


def _shared_normalised(shared: SharedImportance, hashes: Sequence[str], aggregator: ImportanceAggregator) -> float:
    """The pages' shared importance (their mean) on this instance's normalisation."""
    if not hashes or aggregator.scale <= 0.0:
        return 0.0
    values = [shared.importance(h) or 0.0 for h in hashes]
    return min(1.0, sum(values) / len(values) / aggregator.scale)


def _storage_decision(node: TreeNode) -> Optional[str]:
    state = peek_state(node)
    return None if state is None else state.storage


def _active_state(cache: TreeCache) -> Any:
    state = state_of(cache)
    return state if state is not None and state.admission.active else None


def gate_storage_write(original: Callable[[TreeCache, NodeId], None], cache: TreeCache, node_id: NodeId) -> None:
    """Around ``UnifiedRadixCache.write_backup_storage(node_id)``: write or defer."""
    state = _active_state(cache)
    if state is None:
        return original(cache, node_id)
    try:
        node = cache.tree_core.node_by_id(node_id)
    except KeyError:
        return original(cache, node_id)
    if _storage_decision(node) == ADMITTED:
        return original(cache, node_id)
    shared = state.shared
    if state.admission.qualifies(node, state.aggregator, shared) or any(
        _storage_decision(child) == ADMITTED for child in node.children.values()
    ):
        _count(state, cache, "admitted", node)
        node_state(node).storage = ADMITTED
        return original(cache, node_id)
    _count(state, cache, "deferred", node)
    node_state(node).storage = DEFERRED
    if shared is not None:
        # Read off this thread; the next fold that attends the node re-examines it.
        shared.want(node.hash_value or ())
    return None


def admit_deferred(cache: TreeCache, nodes: Iterable[TreeNode]) -> int:
    """Write the deferred nodes among ``nodes`` that now qualify, with their deferred
    ancestors first. Returns the number of nodes written."""
    state = _active_state(cache)
    if state is None:
        return 0
    written = 0
    for node in nodes:
        if (
            _storage_decision(node) != DEFERRED
            or not node.backuped
            or not state.admission.qualifies(node, state.aggregator, state.shared)
        ):
            continue
        chain = []
        cur = node
        while cur is not None and cur.parent is not None:
            if _storage_decision(cur) == DEFERRED and cur.backuped:
                chain.append(cur)
            cur = cur.parent
        for item in reversed(chain):
            # Marked first, so the gate lets the write through.
            node_state(item).storage = ADMITTED
            _count(state, cache, "late", item)
            cache.write_backup_storage(item.id)
            written += 1
    return written


def _count(state: Any, cache: TreeCache, decision: str, node: TreeNode) -> None:
    metrics = state.metrics.importance(cache)
    if metrics is not None:
        metrics.storage_decision(decision, len(node.key))


def split_state(prefix: TreeNode, suffix: TreeNode) -> None:
    """A split node's halves share its storage decision."""
    decision = _storage_decision(suffix)
    if decision is not None:
        node_state(prefix).storage = decision
