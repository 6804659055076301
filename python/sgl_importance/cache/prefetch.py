"""Host→device prefetch under ``importance``, riding SGLang's batch load-back.

When the scheduler builds a prefill batch it calls
``UnifiedRadixCache.ready_to_load_host_cache()``, which merges every load-back
queued so far into one host→device copy with per-layer completion events; the
batch's forward waits on those events layer by layer, so the copies overlap its
compute (and, in the overlap loop, the previous batch's). This module queues more
load-backs just before that call, so they join the same copy and the same events —
no extra slot in SGLang's load-back event ring, and no later batch can read a page
before its copy landed:

1. ``waiting``: host-resident prefixes matched by requests still in the waiting
   queue, which a later batch will need (SGLang would load them at admission,
   stalling that batch's prefill on the copy).
2. ``warm``: the most important host-resident nodes — demoted from the device
   when they were important — back into device memory, highest importance first,
   so their next request hits the device tier. Only nodes whose eviction priority
   is above that of a fresh request's KV: anything below would be the next victim
   of the batch's own allocations, a copy wasted.

Rules, both for the memory the batch was promised and for what is evicted:

- Budget: a load takes device memory that SGLang's admission has not handed out,
  i.e. it must fit the prefill adder's remaining budget (free + evictable minus
  the admitted and running requests' reservations) less one page, and at most
  ``prefetch_max_tokens`` per batch. A load costs its tokens plus the resident
  ancestors it locks (a locked node is not evictable, so it is not room either).
  The admitted requests' matched prefixes are locked meanwhile, so they are
  neither counted as room nor evicted before the batch locks them itself. Loaded nodes stay locked until SGLang's
  ``loading_check`` acknowledges the copy, then are ordinary evictable nodes.
- Never evict something more important than what comes in: when free pages do
  not suffice, SGLang's load-back evicts device leaves in the policy's order;
  the prefetch is issued only if every leaf that walk would take (replayed here,
  parents exposed as their children go) has a lower eviction priority than the
  node brought in.
- Rank consensus: with several tree ranks the plan (node ids) is compared with a
  MIN all-reduce of its digest before anything is issued; a mismatch issues
  nothing on any rank.

Prefetched nodes carry their reason (``NodeState.prefetched``) until a fold sees a running
request attend them (``used``) or the device tier evicts them first (``wasted``);
both are counted in ``sgl_importance:prefetch_tokens_total``. A node whose
prefetch was wasted is not warmed again until a request attends it.

Duck-typed over SGLang's cache and nodes; the hooks in ``plugin.py`` feed it the
scheduler and the batch's prefill adder.
"""

from __future__ import annotations

import heapq
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Iterable, Optional

import torch

from sgl_importance.cache.state_of import state_of
from sgl_importance.node_state import node_importance, node_state, peek_state

if TYPE_CHECKING:
    from sgl_importance.importance.aggregator import ImportanceAggregator
    from sgl_importance.metrics import ImportanceMetrics
    from sgl_importance.sglang_types.scheduler import PrefillAdder, PrefillBudget, Req
    from sgl_importance.sglang_types.tree import LockReceipt, NodeId, TreeCache, TreeCore, TreeNode

logger = logging.getLogger(__name__)

# Requests at the head of the waiting queue whose host matches are considered.
WAITING_SCAN = 16
# Host nodes considered for warming per batch (the most important ones).
WARM_SCAN = 16


def note_prefill_adder(adder: PrefillAdder) -> None:
    """After ``PrefillAdder.__init__``: the budget of the batch being built."""
    state = state_of(adder.tree_cache)
    if state is not None:
        state.note_adder(adder)


@dataclass
class Candidate:
    """A host-resident node to load, and what loading it costs."""

    node: TreeNode
    reason: str
    # Device-evicted nodes from ``node`` up to its first device-resident ancestor:
    # what one load-back of ``node`` copies.
    path: list[TreeNode]
    tokens: int
    priority: tuple[int, float, float]  # ``ImportanceStrategy.get_priority``'s


def evicted_path(node: TreeNode) -> list[TreeNode]:
    """``node`` and its device-evicted ancestors (below the first resident one)."""
    path = []
    while node is not None and node.parent is not None and node.evicted:
        path.append(node)
        node = node.parent
    return path


def _unlocked(node: TreeNode) -> bool:
    return not any(cd.lock_ref > 0 for cd in node.component_data)


def resident_ancestors(path: list[TreeNode]) -> list[TreeNode]:
    """The device-resident nodes above an evicted ``path``, up to the root."""
    out = []
    node = path[-1].parent if path else None
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def lock_cost(path: list[TreeNode], already_locked: AbstractSet[int] = frozenset()) -> int:
    """Device tokens a load-back of ``path`` takes from SGLang's room until its
    copy is acknowledged: the loaded tokens, plus every unlocked resident ancestor,
    which the load-back locks with it (locked nodes are not evictable)."""
    cost = sum(len(n.key) for n in path)
    for node in resident_ancestors(path):
        if node.id not in already_locked and _unlocked(node):
            cost += len(node.key)
    return cost


def _loadable(node: Optional[TreeNode]) -> bool:
    return node is not None and node.parent is not None and node.evicted and node.backuped


def _in_tree(tree_core: TreeCore, node: TreeNode) -> bool:
    try:
        return tree_core.node_by_id(node.id) is node
    except KeyError:
        return False


def warm_candidates(
    tree_core: TreeCore, index: WarmIndex, aggregator: ImportanceAggregator, min_importance: float
) -> list[TreeNode]:
    """Host-resident nodes of normalised importance ≥ ``min_importance``, most
    important first (at most ``WARM_SCAN``)."""
    if min_importance <= 0.0:
        # 0 would warm never-attended nodes: nothing says they will be used.
        return []
    nodes = [
        n
        for n in index.nodes()
        if _in_tree(tree_core, n) and not _prefetch_wasted(n) and aggregator.normalised(n) >= min_importance
    ]
    nodes.sort(key=node_importance, reverse=True)
    return nodes[:WARM_SCAN]


def _prefetch_wasted(node: TreeNode) -> bool:
    # A warm prefetch of the node was evicted unused: it is not warmed again until a
    # request attends it (no load/evict churn on a node nobody asks for).
    state = peek_state(node)
    return state is not None and state.prefetch_wasted


def waiting_candidates(tree_core: TreeCore, waiting_queue: Iterable[Req]) -> list[TreeNode]:
    """Host-matched anchors of the requests at the head of the waiting queue."""
    nodes = []
    for i, req in enumerate(waiting_queue):
        if i >= WAITING_SCAN:
            break
        if req.host_hit_length <= 0:
            continue
        node_id = req.best_match_node
        if node_id is None:
            continue
        try:
            node = tree_core.node_by_id(node_id) if isinstance(node_id, int) else node_id
        except KeyError:
            continue
        if _loadable(node):
            nodes.append(node)
    return nodes


def victims_less_important(
    tree_core: TreeCore,
    priority_of: Callable[[TreeNode], tuple[int, float, float]],
    bound: tuple[int, float, float],
    needed: int,
    protected: set[int],
    gone: Optional[set[int]] = None,
) -> bool:
    """Can ``needed`` device tokens be freed evicting only leaves of priority < ``bound``?

    Replays SGLang's device eviction walk over the current evictable leaves: the
    smallest priority goes first and a parent joins once all its device-resident
    children went. ``protected`` (ids of the incoming node's ancestors, which the
    load-back locks) is never taken. ``gone`` holds the ids already evicted for
    earlier loads of the same batch; on success the ones taken here join it.
    """
    if needed <= 0:
        return True
    earlier = gone if gone is not None else set()
    heap = [
        (priority_of(leaf), leaf.id, leaf)
        for leaf in tree_core.evictable_device_leaves
        if leaf.id not in protected and leaf.id not in earlier
    ]
    heapq.heapify(heap)
    taken: set = set()
    freed = 0
    while freed < needed:
        if not heap:
            return False
        priority, _, leaf = heapq.heappop(heap)
        if not priority < bound:
            return False
        taken.add(leaf.id)
        freed += len(leaf.key)
        parent = leaf.parent
        if (
            parent is not None
            and parent.parent is not None
            and parent.id not in protected
            and parent.id not in earlier
            and not parent.evicted
            and all(child.id in taken or child.id in earlier or child.evicted for child in parent.children.values())
            and _unlocked(parent)
        ):
            heapq.heappush(heap, (priority_of(parent), parent.id, parent))
    earlier.update(taken)
    return True


class WarmIndex:
    """Nodes demoted from the device while important: the warm candidates.

    Filled from the FULL component's eviction (``cache/components.py``), so a
    batch looks at a handful of nodes instead of walking the host tier. Entries
    whose node was loaded back or deleted are dropped lazily.
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._nodes: weakref.WeakValueDictionary[int, TreeNode] = weakref.WeakValueDictionary()

    def add(self, node: TreeNode) -> None:
        if len(self._nodes) >= self.limit:
            self.prune()
            if len(self._nodes) >= self.limit:
                return
        self._nodes[node.id] = node

    def prune(self) -> None:
        for node_id, node in list(self._nodes.items()):
            if not _loadable(node):
                del self._nodes[node_id]

    def nodes(self) -> list[TreeNode]:
        self.prune()
        return list(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)


def plan(
    cache: TreeCache,
    strategy: Any,
    budget: int,
    waiting_queue: Iterable[Req],
) -> list[Candidate]:
    """Choose the load-backs to queue with this batch (no side effects).

    Args:
        cache: SGLang's ``UnifiedRadixCache``.
        strategy: its ``ImportanceStrategy`` (priorities, config, aggregator).
        budget: device tokens the loads may take (adder budget, per-batch cap).
        waiting_queue: the scheduler's waiting requests, head first.
    """
    tree_core = cache.tree_core
    state = strategy.state
    config = state.config
    chosen: list[Candidate] = []
    taken: set = set()
    # Nodes the chosen loads lock (paths and their ancestors): counted once, never victims.
    locked: set = set()
    # Leaves the chosen loads will evict: not counted twice.
    victims: set = set()
    available = cache.token_to_kv_pool_allocator.available_size()
    fresh = strategy.fresh_priority()
    sources = [
        ("waiting", waiting_candidates(tree_core, waiting_queue)),
        (
            "warm",
            warm_candidates(tree_core, state.warm, state.aggregator, config.prefetch_min_importance),
        ),
    ]
    for reason, nodes in sources:
        for node in nodes:
            path = evicted_path(node)
            if not path or any(n.id in taken for n in path):
                # Part of it is already planned: one load-back per path.
                continue
            tokens = sum(len(n.key) for n in path)
            cost = lock_cost(path, locked)
            if cost > budget:
                continue
            priority = strategy.get_priority(node)
            if reason == "warm" and not priority > fresh:
                # Below a fresh request's KV it would be the next victim: a wasted copy.
                continue
            ancestors = resident_ancestors(path)
            protected = {n.id for n in ancestors} | locked
            # Free pages first; the rest comes from leaves less important than node.
            if not victims_less_important(
                tree_core, strategy.get_priority, priority, tokens - available, protected, victims
            ):
                continue
            chosen.append(Candidate(node, reason, path, tokens, priority))
            taken.update(n.id for n in path)
            locked.update(n.id for n in path)
            locked.update(n.id for n in ancestors)
            budget -= cost
            available = max(0, available - tokens)
    return chosen


def _consensus(cache: TreeCache, chosen: list[Candidate]) -> bool:
    """Whether every tree rank planned the same loads (always, on one rank)."""
    if cache.tp_world_size <= 1:
        return True
    digest = 0
    for c in chosen:
        digest = (digest * 1_000_003 + int(c.node.id) + 1) % (1 << 61)
    sync = torch.tensor([len(chosen), digest, -digest], dtype=torch.int64)
    cache._all_reduce(sync, torch.distributed.ReduceOp.MIN)
    return int(sync[0]) == len(chosen) and int(sync[1]) == -int(sync[2]) == digest


def _eligible(cache: TreeCache) -> bool:
    # Plain full-attention trees only: SWA/Mamba components and buffer-mode or
    # external-linker host tiers load through paths this does not model.
    return (
        cache.cache_controller is not None
        and cache.buffer_pipeline is None
        and cache.linker is None
        and not cache.supports_swa()
        and not cache.supports_mamba()
    )


def prefetch_with_batch_load(original: Callable[[TreeCache], int], cache: TreeCache) -> int:
    """Around ``UnifiedRadixCache.ready_to_load_host_cache``: queue prefetches first."""
    state = state_of(cache)
    adder = None if state is None else state.take_adder()
    if adder is not None and _eligible(cache):
        try:
            issue(cache, cache.tree_core.eviction_strategy, adder)
        except Exception:  # a failed prefetch must never fail the batch
            logger.exception("importance prefetch failed; batch continues without it")
    return original(cache)


def issue(cache: TreeCache, strategy: Any, adder: PrefillAdder) -> list[Candidate]:
    """Plan and queue this batch's prefetches; returns the ones queued."""
    state = strategy.state
    cap = state.config.prefetch_max_tokens
    if cap <= 0:
        return []
    budget_obj = adder.memory_budget
    page = cache.page_size
    scheduler = state.scheduler
    waiting: Iterable[Req] = ()
    # None before the scheduler is built (and in unit tests): no waiting queue to scan.
    if scheduler is not None:
        # SGLang's DisaggregationMode, compared by value: importing the enum would pull
        # in its disaggregation package for one comparison.
        if scheduler.disaggregation_mode.value != "null":
            # Prefill/decode disaggregation builds batches from its own queues.
            return []
        waiting = scheduler.waiting_queue
    # The admitted requests' matched prefixes are unlocked until the batch allocates
    # (prepare_for_extend, right after this): locked here, a load can neither evict
    # them nor count them as room, so what it takes is room the batch never needed.
    locks = _lock_admitted_prefixes(cache, adder.can_run_list)
    try:
        budget = min(cap, _room(budget_obj) - page)
        chosen = plan(cache, strategy, budget, waiting) if budget > 0 else []
        if not _consensus(cache, chosen):
            logger.warning("importance prefetch: ranks planned different loads; skipping this batch")
            return []
        return _load(cache, state.metrics.importance(cache), chosen, budget_obj, page)
    finally:
        for node_id, params in locks:
            cache.dec_lock_ref(node_id, params)


def _room(budget_obj: PrefillBudget) -> int:
    # Free + evictable device tokens that admission left unpromised, now.
    return int(min(budget_obj.remaining_total, budget_obj.remaining_current))


def _lock_admitted_prefixes(cache: TreeCache, reqs: Iterable[Req]) -> list[tuple[NodeId, LockReceipt]]:
    locks = []
    for req in reqs:
        node_id = req.last_node
        if node_id is None or cache.is_root(node_id):
            continue
        locks.append((node_id, cache.inc_lock_ref(node_id).to_dec_params()))
    return locks


def _load(
    cache: TreeCache,
    metrics: Optional[ImportanceMetrics],
    chosen: list[Candidate],
    budget_obj: PrefillBudget,
    page: int,
) -> list[Candidate]:
    queued = []
    for c in chosen:
        # Re-checked live: an earlier load of this batch may have used the room.
        room = _room(budget_obj)
        if not all(n.evicted for n in c.path) or lock_cost(c.path) > room - page:
            continue
        if not cache.load_back(c.node.id):
            continue
        for n in c.path:
            node_state(n).prefetched = c.reason
        queued.append(c)
        logger.debug(
            "importance prefetch: %d tokens (%s, node %s); room %d -> %d",
            c.tokens,
            c.reason,
            c.node.id,
            room,
            _room(budget_obj),
        )
        if metrics is not None:
            metrics.prefetch(c.reason, "issued", c.tokens)
    return queued


def mark_used(metrics: Optional[ImportanceMetrics], nodes: Iterable[TreeNode]) -> None:
    """Prefetched nodes a running request attended: the prefetch paid off.

    ``metrics``: the cache's ``ImportanceMetrics``, or None when SGLang's are off."""
    for node in nodes:
        state = peek_state(node)
        if state is None:
            continue
        state.prefetch_wasted = False
        reason = state.prefetched
        if reason is None:
            continue
        state.prefetched = None
        if metrics is not None:
            metrics.prefetch(reason, "used", len(node.key))


def mark_evicted(metrics: Optional[ImportanceMetrics], node: TreeNode, tokens: int) -> None:
    """The device tier evicted ``node``: a pending prefetch of it was wasted."""
    state = peek_state(node)
    if state is None or state.prefetched is None:
        return
    reason, state.prefetched = state.prefetched, None
    state.prefetch_wasted = True
    if metrics is not None:
        metrics.prefetch(reason, "wasted", tokens)
