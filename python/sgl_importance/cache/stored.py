"""Importance of pages that left the tree but live on in the storage tier.

A node dropped from host memory is deleted from the radix tree; its KV stays in
the storage tier (``--hicache-storage-backend``) under its pages' chain hashes.
When a later request fetches those pages back, SGLang builds *new* nodes
(``UnifiedTreeCore.insert_host``), which would start at importance 0 — a shared
document that was the hottest node before a quiet spell would be the first to go
again. This module remembers each dropped page's importance under its hash (the
same key the storage tier uses) and hands it to the node rebuilt from that page.

The same memory ranks storage fetches: SGLang issues one storage prefetch per
request on arrival and, when the storage tier is rate-limited, re-issues the
deferred ones in waiting-queue order (``StoragePrefetchRetries.pop_ready``); under
``importance`` the requests whose next pages were the most important when dropped
are re-issued first (:func:`rank_storage_retries`).

With a shared storage tier (Mooncake Store) each dropped page's importance is
also published next to the page (``storage/shared_importance.py``), and what other
instances published counts here too: the larger of the two per page.

The same page hashes carry each page's storage *class* under
``--importance-storage-precision graded`` (``storage/precision.py``): when SGLang sends
a node to the storage tier (``write_backup_storage``, on the scheduler thread),
its pages are ranked by the importance they earned — each page's accumulated
attention mass from the page importance table while the node is on the device, else the
node's importance for all of them — and graded (``encoding.grade``); the storage
I/O thread reads the class by hash when it seals the page (``storage/wrapper.py``). A
node the tree never attended ranks by position (only sinks kept). With L3
admission (``storage_min_importance``) nodes reach the storage tier only once
attended, so their pages are graded by what decode read.

Bounded: the most recently dropped ``capacity`` pages are remembered (LRU), one
float per page hash; pages never attended are not stored. Duck-typed over
SGLang's nodes (``hash_value``: one hash per page, None until hashed); SGLang's
page-hash function is imported only to rank retries.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from sgl_importance.cache.device_pages import device_pages, device_value
from sgl_importance.cache.state_of import state_of, tree_state
from sgl_importance.node_state import has_importance, node_importance, node_state, peek_state

if TYPE_CHECKING:
    from sgl_importance.importance.page_importance import PageImportanceHolder, PageImportanceTable
    from sgl_importance.sglang_types.scheduler import Req, Scheduler
    from sgl_importance.sglang_types.tree import InsertResult, NodeId, TreeCache, TreeCore, TreeNode
    from sgl_importance.storage.precision import PageClasses
    from sgl_importance.storage.shared_importance import SharedImportance

# Pages of a request's storage span looked up to rank its retry.
RANK_PAGES = 4
# Page hashes remembered (≈100 bytes each): 64 Ki pages ≈ 6.5 MB, covering a 1 M
# token storage tier at page size 16.
DEFAULT_CAPACITY = 1 << 16


class StoredImportance:
    """Page hash → importance of the node the page belonged to when dropped."""

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, shared: Callable[[], Optional[SharedImportance]] = lambda: None
    ) -> None:
        self.capacity = capacity
        self._by_hash: "OrderedDict[str, float]" = OrderedDict()
        # The importance shared through a Mooncake store (``storage/shared``), read
        # when needed: the runtime starts it after the cache (and this) is built.
        self.shared = shared

    def remember(self, node: TreeNode) -> int:
        """Record ``node``'s importance under each of its page hashes; returns pages recorded."""
        value = node_importance(node)
        hashes = node.hash_value
        shared = self.shared()
        if shared is not None and hashes:
            # Leaving this instance: the store keeps what it learnt for the others.
            shared.publish(hashes, value, node.hit_count)
        if value <= 0.0 or not hashes:
            return 0
        for h in hashes:
            self._by_hash[h] = value
            self._by_hash.move_to_end(h)
        while len(self._by_hash) > self.capacity:
            self._by_hash.popitem(last=False)
        return len(hashes)

    def recall(self, node: TreeNode) -> Optional[float]:
        """Set a rebuilt node's importance from its pages (their mean, pages never
        remembered counting 0); returns it, or None when no page was remembered."""
        hashes = node.hash_value
        if not hashes or has_importance(node):
            return None
        values = [self._value(h) for h in hashes]
        known = [v for v in values if v is not None]
        if not known:
            return None
        shared = self.shared()
        if shared is not None:
            shared.count("restored", sum(1 for h in hashes if shared.record(h) is not None))
        value = sum(known) / len(values)
        node_state(node).importance = value
        return value

    def _value(self, page_hash: str) -> Optional[float]:
        # This process's memory and the shared store's record (when the storage tier
        # is shared): the larger, as the shared merge rule combines them.
        local = self._by_hash.get(page_hash)
        shared = self.shared()
        remote = shared.importance(page_hash) if shared is not None else None
        if remote is None:
            return local
        return remote if local is None else max(local, remote)

    def page_value(self, page_hash: str) -> float:
        """The remembered importance of one page (0.0 when unknown)."""
        value = self._value(page_hash)
        return 0.0 if value is None else value

    def __len__(self) -> int:
        return len(self._by_hash)


def node_page_scores(
    node: TreeNode, pages: int, page_size: int, table: Optional[PageImportanceTable] = None
) -> list[float]:
    """Importance of each of a node's first ``pages`` pages: their accumulated attention
    mass in ``table`` (the page importance table) while the node is on the device, else
    the node's importance."""
    value = device_value(node)
    if table is not None and value is not None and value.numel() >= pages * page_size:
        ids = device_pages(node, page_size)[:pages]
        return table.accumulated[ids.to(table.accumulated.device)].tolist()
    return [node_importance(node)] * pages


def _start_token(node: TreeNode) -> int:
    state = peek_state(node)
    if state is not None and state.start is not None:
        return state.start
    start = 0
    cur = node.parent
    while cur is not None and cur.parent is not None:
        start += len(cur.key)
        cur = cur.parent
    return start


def grade_before_storage_write(
    classes: Optional[PageClasses], page_importance: PageImportanceHolder, cache: TreeCache, node_id: NodeId
) -> int:
    """Before ``UnifiedRadixCache.write_backup_storage(node_id)``: grade the node's pages
    (under ``--importance-storage-precision graded``). Returns the pages graded.

    Args:
        classes: the process's grading (the runtime's), None when grading is off.
        page_importance: the process's ``PageImportanceHolder`` (the runtime's).
    """
    if classes is None:
        return 0
    try:
        node = cache.tree_core.node_by_id(node_id)
    except KeyError:
        return 0
    hashes = node.hash_value
    if not hashes:
        return 0
    page_size = int(cache.page_size)
    scores = node_page_scores(node, len(hashes), page_size, page_importance.current)
    classes.assign(list(hashes), scores, _start_token(node) // page_size)
    return len(hashes)


def restore_after_insert_host(tree_core: TreeCore, result: InsertResult) -> int:
    """After ``UnifiedTreeCore.insert_host``: give the nodes it built their importance.

    Walks from the inserted node toward the root over nodes never attended in
    this tree (a refilled node that kept its object keeps its own value).
    Returns the number of nodes restored.
    """
    state = tree_state(tree_core)
    node_id = result.inserted_host_node
    if state is None or node_id is None:
        return 0
    stored = state.stored
    restored = 0
    node = tree_core.node_by_id(node_id)
    while node is not None and node.parent is not None and not has_importance(node):
        if stored.recall(node) is not None:
            restored += 1
        node = node.parent
    return restored


def request_storage_importance(stored: StoredImportance, cache: TreeCache, req: Req) -> float:
    """Remembered importance of the first ``RANK_PAGES`` pages a request would fetch
    from storage: the pages after its device + host match, hashed as the storage
    tier keys them. 0.0 when none is known.

    The chain is hashed from the root over the request's own tokens, never from
    its ``last_host_node``: a deferred retry keeps the node id of its last match,
    and host eviction may have deleted that node since (SGLang re-matches the
    prefix before it re-issues; this ranking runs before that). Reading the tree
    here once took the scheduler down with a ``KeyError``.
    """
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    page = cache.page_size
    first = (req.prefix_len + req.host_hit_length) // page
    end = min(len(req.full_untruncated_fill_ids) // page, first + RANK_PAGES)
    if end <= first:
        return 0.0
    tokens = list(req.full_untruncated_fill_ids[: end * page])
    key = RadixKey(tokens, extra_key=req.extra_key, cache_salt=req.cache_salt)
    hashes = get_storage_hash_str(key, None, page_size=page)[first:end]
    values = [stored.page_value(h) for h in hashes]
    return sum(values) / len(values)


def rank_storage_retries(
    scheduler: Optional[Scheduler],
    original: Callable[..., list[tuple[Req, Optional[int]]]],
    retries: Any,
    waiting_queue: Sequence[Req],
    *args: Any,
    **kwargs: Any,
) -> list[tuple[Req, Optional[int]]]:
    """Around ``StoragePrefetchRetries.pop_ready``: the due retries, most important first.

    ``scheduler``: the process's scheduler (the retries know no cache), None before
    it is built.

    Only the order changes (which retries are due is SGLang's decision), and only
    under ``importance`` with something remembered; ties keep the queue order.
    """
    ready = original(retries, waiting_queue, *args, **kwargs)
    if len(ready) < 2:
        return ready
    state = None if scheduler is None else state_of(scheduler.tree_cache)
    if state is None or not (len(state.stored) or state.shared is not None):
        return ready
    cache, stored = scheduler.tree_cache, state.stored
    scores = [request_storage_importance(stored, cache, req) for req, _ in ready]
    order = sorted(range(len(ready)), key=lambda i: -scores[i])
    return [ready[i] for i in order]
