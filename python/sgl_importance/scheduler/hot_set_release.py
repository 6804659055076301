"""Scheduler hooks of hot-set page release: who may release, the step's moves, leaving cleanly.

The records these hooks act on (the runtime's ``Residency``, passed in as ``residency``;
each request's ``LongRequest``, its ``RequestPages``) and the page moves are
``hot_set/residency.py``; here are the hooks plugin.py calls (the adapter of ``residency.PagePools`` over SGLang's
allocator and host pool is ``page_pools.HiCachePagePools``). These
hooks, all between forwards, are the only callers of the moves: the decoder asks for its
next step's releases and promotions as data, and ``hot_set_rows.around_batch`` (after
``Scheduler.run_batch``) makes them before the next step's allocation.

With ``--hot-set-policy`` on and HiCache's host pool present (``--enable-hierarchical-cache``),
a request longer than ``--hot-set-threshold`` tokens is *admitted* to release: its pages
past the ones the radix tree holds for it may leave the device (its page record is made
then). It is admitted at whichever comes first:

- prefill, when the tokens it prefills (the prompt; after a retraction, the prompt
  and what it had generated) are past the threshold. It is kept out of the tree
  while it runs (the checkpoints SGLang makes after each prefill chunk are skipped
  for it, the path SGLang takes for requests barred from the tree), so its pages
  past the matched prefix are its own;
- decode, on the step that takes it past the threshold (a short prompt generating a
  long answer): SGLang checkpointed its prompt into the tree at prefill and inserts
  nothing more until it finishes, so the pages past ``cache_protected_len`` (the
  partial last page of the prompt, then what it generates) are its own; the
  prompt's tree pages are the tree's (held on the host like a matched prefix, below).

An admitted request is never checkpointed into the tree while it runs. When it leaves:

- finished (``release_kv_cache`` with ``checkpoint``): its released pages are
  copied back into free device pages (evicting unlocked tree nodes if needed) and
  the whole sequence is inserted into the tree as usual, so prefix reuse holds.
  When the device cannot take them back, its full pages past what the tree holds go
  into the tree host-only (``finished_on_host``: the host copies of the released ones
  become the tree's, the resident ones are copied out), so the next turn of a session
  matches them on the host; where that cannot be done either (the host pool full,
  SGLang's Rust tree core) the request is not inserted (its KV is freed; its matched
  prefix stays in the tree) and ``finished_uncached`` counts it.
- aborted: nothing is inserted; retracted: its full pages enter the tree host-only
  (``retracted_to_host``) for its prefill again to match, and it is admitted again by its
  new length. The positions it released are left out of what SGLang frees.

Either way its host copies are freed. Without the host pool the hot set stays
logical: every page stays on the device (logged once at start-up).

**A matched prefix held on the host** (``--hot-set-prefix host``, the default): an
admitted request whose tree pages (its matched prefix; for a grown request, its prompt)
all have a host copy (HiCache's write-through, the copy landed) borrows those copies
(``RequestPages.lend_prefix``; the tree node it matched is host-locked so they stay). On
the step after, the prefix pages its plan left out are no longer read from the device; the
ones it plans are copied into device pages of its own, and its device lock on the prefix
goes: the tree's device pages of the prefix become evictable like any unlocked node's
(evicted under pressure, matched by other requests while they last, loaded back from the
host by a request that matches them after). Two running requests sharing a prefix each
read their own copies; the tree's device pages stay while any request not holding the
prefix on the host locks them. When it leaves: a finishing request whose prefix node is
still on the device locks it again and points its row back at it (nothing copied);
otherwise its released prefix pages come back with its own and the insert puts them into
the evicted nodes. An abort or a retraction frees only its own copies. Needs the Python
tree core (``--radix-eviction-policy importance``, or
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``); with the Rust core the prefix stays on
the device (logged once)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from sgl_importance.config import ImportanceConfig
from sgl_importance.hot_set.pages.copies import PageCopies
from sgl_importance.hot_set.pages.prefix_hold import PrefixHold
from sgl_importance.hot_set.pages.rows import BorrowedPages
from sgl_importance.hot_set.pages.state import LogicalPage, MoveReason, PageMoves, RequestMoves, RequestPages
from sgl_importance.hot_set.params import HotSetParams
from sgl_importance.hot_set.request_params import RequestParams
from sgl_importance.hot_set.residency import Residency, subtract_pages
from sgl_importance.runtime import BackendHotSet
from sgl_importance.scheduler.hot_set_requests import forget_request
from sgl_importance.scheduler.hot_set_rows import lent_for
from sgl_importance.scheduler.page_pools import HiCachePagePools
from sgl_importance.scheduler.streamed_prefill import release_chunk
from sgl_importance.sglang_types.scheduler import Req, ReqKvInfo, ScheduleBatch, Scheduler
from sgl_importance.sglang_types.tree import NodeId, TreeCache

if TYPE_CHECKING:
    from sgl_importance.hot_set.decode import HotSetDecoder

logger = logging.getLogger(__name__)


def enable(
    residency: Residency, hot_set_params: Optional[HotSetParams], config: ImportanceConfig, scheduler: Scheduler
) -> None:
    """After ``Scheduler.__init__``: turn release on where the hot set and a host pool are.

    Args:
        residency, hot_set_params, config: the runtime's page records, the server's hot-set
            parameters (None: the hot set is off) and its flags.
    """
    if hot_set_params is None:
        return
    tree_cache = scheduler.tree_cache
    if tree_cache.cache_controller is None:
        logger.warning(
            "hot set without --enable-hierarchical-cache: pages outside a request's hot set "
            "are not attended but stay on the device (no host pool to release them to)"
        )
        return
    pools = HiCachePagePools(tree_cache)
    residency.enable(pools, config.hot_set_threshold, PageCopies(pools.device_pool.device))
    logger.info("hot set releases device pages of requests longer than %d tokens", residency.threshold)
    residency.host_insert = _python_tree_core(tree_cache)
    if config.hot_set_prefix == "host":
        if residency.host_insert:
            residency.prefix_on_host = True
            logger.info("hot set: a running request's matched prefix is held on the host (--hot-set-prefix host)")
        else:
            logger.warning(
                "hot set: --hot-set-prefix host needs SGLang's Python radix-tree core (on with "
                "--radix-eviction-policy importance or SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python); "
                "matched prefixes stay on the device, and a finished request the device cannot "
                "take back is left out of the tree"
            )


def _python_tree_core(tree_cache: TreeCache) -> bool:
    core = tree_cache.tree_core
    try:
        core.node_by_id(tree_cache.root_node_handle())
    except NotImplementedError:
        return False
    return True


def reopen_admission(residency: Residency, scheduler: Scheduler) -> None:
    """After a batch: if the hot set gave device pages back, let the scheduler admit again.

    SGLang stops trying to prefill waiting requests once an attempt found no room
    (``batch_is_full``) and tries again only when a request leaves; pages released
    mid-request would otherwise sit free until then.
    """
    # Device pages a release copied from, once the copy is done (all of them when idle).
    residency.copies.collect(wait=not scheduler.running_batch.reqs)
    if residency.reopen:
        residency.reopen = False
        scheduler.running_batch.batch_is_full = False


def checkpoint_unless_released(
    residency: Residency,
    hot_set: Optional[BackendHotSet],
    decoder: Optional[HotSetDecoder],
    row_pages: Optional[BorrowedPages],
    original: Callable[..., Any],
    req: Req,
    tree_cache: TreeCache,
) -> Any:
    """Around ``checkpoint_kv_cache``: keep a long prefill's pages out of the tree; streamed
    (``hot_set.stream_prefill``), release the chunk's full pages, their rows lent for the
    summary first (``row_pages``, the runtime's ``hot_set/rows.BorrowedPages``)."""
    if not residency.enabled or req.skip_radix_cache_insert:
        return original(req, tree_cache)
    # The whole prefill, every chunk alike: the prompt, and after a retraction what
    # the request had generated too (SGLang does not grow this array mid-prefill).
    if not residency.admitted(req.rid) and len(req.full_untruncated_fill_ids) <= residency.threshold:
        return original(req, tree_cache)
    page_size = tree_cache.token_to_kv_pool_allocator.page_size
    row = tree_cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    pages = residency.admit(req.rid, row, _first_own_page(req, page_size), page_size)
    # What SGLang does for a request barred from the tree: resume after this extend.
    req.prefix_len = req.extend_end
    # A middle chunk (SGLang stashes it before the next is scheduled); after the last, the
    # first decode step's plan decides (it may already have run, under the overlap scheduler).
    middle = req.extend_end < len(req.full_untruncated_fill_ids)
    if hot_set is not None and decoder is not None and hot_set.stream_prefill and middle and not req.finished():
        with lent_for(row_pages, tree_cache, decoder, {req.rid: req.extend_end}):
            release_chunk(residency, decoder, hot_set.forward_stream, pages, req.rid, req.extend_end)
    return None


def admit_grown(residency: Residency, batch: ScheduleBatch) -> None:
    """After ``ScheduleBatch.prepare_for_decode``: admit the requests this step takes
    past the threshold (a short prompt generating a long answer).

    The step's KV length (``kv_committed_len``, this step's token included) is what the
    decoder tracks a request by, so the decoder finds it admitted on the step it starts
    planning it. The tree holds ``[0, cache_protected_len)`` of it (the prompt, page
    aligned; SGLang inserts no decode tokens before the request finishes): the pages
    from there on are its own.
    """
    if not residency.enabled:
        return
    threshold = residency.threshold
    for req in batch.reqs:
        if req.kv.kv_committed_len <= threshold or residency.admitted(req.rid):
            continue
        # Barred from the tree (beam rows share pages), or leaving: as for long prompts.
        if req.skip_radix_cache_insert or req.finished():
            continue
        ps, row = residency.pools.page_size, batch.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        residency.admit(req.rid, row, _first_own_page(req, ps), ps)
    hold_prefixes(residency, batch)


def hold_prefixes(residency: Residency, batch: ScheduleBatch) -> None:
    """Each decode step, from ``admit_grown``: move the matched prefixes of admitted
    requests onto the host (the module's docstring)."""
    if not residency.enabled or not residency.prefix_on_host:
        return
    tree_cache = batch.tree_cache
    for req in batch.reqs:
        pages = residency.peek(req.rid)  # made when it was admitted
        if pages is None or req.finished():
            continue
        hold = pages.hold
        if hold is None:
            if pages.first_owned_page > 0:  # a lent record owns from page 0
                _lend(residency, pages, req, tree_cache)
        elif not hold.unlocked:
            if hold.fresh:
                hold.fresh = False
            else:
                _drop_device_lock(residency, pages, hold, req, tree_cache)


def _lend(residency: Residency, pages: RequestPages, req: Req, tree_cache: TreeCache) -> None:
    lock = req.lock
    prefix = pages.first_owned_page * pages.page_size
    if lock is None or req.kv.cache_protected_len != prefix:
        return
    host = path_host_slots(tree_cache, lock.node)
    if host is None or host.numel() != prefix:
        return  # a node without a host copy yet (its write-through still running): next step
    receipt = tree_cache.inc_host_lock_ref(lock.node).to_dec_params()
    residency.lend_prefix(pages, host)
    pages.hold = PrefixHold(lock.node, receipt)


def path_host_slots(tree_cache: TreeCache, node_id: NodeId) -> Optional[torch.Tensor]:
    """The host slots of the path root → ``node_id``, or None where a node of it has no
    finished host copy."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    core = tree_cache.tree_core
    pending = set()
    for entry in tree_cache.ongoing_write_through.values():
        pending.add(entry.node_id)
        pending.update(entry.publish_node_ids)
    node, parts = core.node_by_id(node_id), []
    while node.parent is not None:
        host = node.component_data[ComponentType.FULL].host_value
        if host is None or node.id in pending:
            return None
        parts.append(host)
        node = node.parent
    if not parts:
        return None
    return torch.cat(parts[::-1]).to(torch.int64)


def _drop_device_lock(
    residency: Residency, pages: RequestPages, hold: PrefixHold, req: Req, tree_cache: TreeCache
) -> None:
    """Copy the planned lent pages into the request's own device pages, then give the
    tree its prefix back: unlocked, its device pages are the tree's to evict."""
    if not residency.own_tree_pages(pages):
        return  # no device room for the copies yet: the prefix stays locked, try next step
    tree_cache.unlock(req.lock)
    req.lock = None
    # The request's own KV is now all of it: SGLang frees [0, ...) of it when it leaves,
    # and the insert of a finished request frees what duplicates the tree's.
    req.kv.cache_protected_len = 0
    hold.unlocked = True
    residency.counts.prefix_holds += 1


def _return_prefix(
    residency: Residency, pages: RequestPages, req: Req, tree_cache: TreeCache, *, inserting: bool
) -> None:
    """Before a lent request leaves: where it still locks the prefix (or, finishing, can
    lock it again while the tree's pages are on the device) point its row back at the
    tree's pages. The host lock stays until the request's record is gone
    (``release_with_pages``): its borrowed host copies are read until then."""
    hold, prefix_len = pages.hold, pages.lent_pages * pages.page_size
    if not hold.unlocked:  # a returning turn's: the device part of its match only
        node = req.lock.node if hold.history else hold.node
        residency.return_prefix(pages, tree_cache.path_device_indices(node)[:prefix_len])
    elif inserting and not tree_cache.tree_core.is_full_device_evicted(hold.node):
        device = tree_cache.path_device_indices(hold.node)
        if device.numel() == prefix_len:
            req.lock = tree_cache.lock(hold.node)
            residency.return_prefix(pages, device)
            req.kv.cache_protected_len = prefix_len
            residency.counts.prefix_relocked += 1


def _first_own_page(req: Req, page_size: int) -> LogicalPage:
    """The request's first page past what it shares with the tree (its matched prefix)."""
    return LogicalPage(-(-req.kv.cache_protected_len // page_size))


def release_with_pages(
    residency: Residency,
    request_params: RequestParams,
    original: Callable[..., Any],
    req: Req,
    tree_cache: TreeCache,
    *,
    checkpoint: bool,
) -> Any:
    """Around ``release_kv_cache``: bring released pages back or keep them out of the free."""
    forget_request(request_params, req)
    if not residency.admitted(req.rid):
        return original(req, tree_cache, checkpoint=checkpoint)
    pages = residency.peek(req.rid)
    hold = pages.hold if pages is not None else None
    try:
        # A returning turn whose row shows no device page of its history (returning.py): its own
        # pages can only go in host-only, under the history's node.
        history = checkpoint and hold is not None and hold.history_unheld and not req.skip_radix_cache_insert
        if history:
            req.skip_radix_cache_insert = True
        inserting = checkpoint and not req.skip_radix_cache_insert
        if pages is not None and pages.hold is not None:
            _return_prefix(residency, pages, req, tree_cache, inserting=inserting)
        if pages is not None and (pages.released_pages().numel() or history):
            if inserting:
                # Promotions evict unlocked tree nodes for room (``HiCachePagePools``); the
                # insert's write-through reads the pages, so it waits for the copies.
                residency.apply(PageMoves([RequestMoves(req.rid, promote=pages.released_pages())], MoveReason.FINISH))
                residency.copies.fence()
            if not pages.released_pages().numel() and not history:
                if inserting:
                    residency.counts.finished_reinserted += 1
            else:
                if not checkpoint and not req.finished() and not req.skip_radix_cache_insert:
                    # Retracted (SGLang re-prefills it later): its full pages enter the tree
                    # host-only, so its prefill again matches them and loads them back.
                    if _insert_on_host(residency, pages, req, tree_cache):
                        residency.counts.retracted_to_host += 1
                if inserting or history:
                    if _insert_on_host(residency, pages, req, tree_cache):
                        residency.counts.finished_on_host += 1
                    else:
                        residency.counts.finished_uncached += 1
                        logger.info(
                            "hot set: request %s leaves %d pages on the host; it is not inserted into the tree",
                            req.rid,
                            pages.released_pages().numel(),
                        )
                    # Set only to stop this insert: a retracted request keeps its flag
                    # for the prefill that resumes it (tree insert or admission again).
                    req.skip_radix_cache_insert = True
                residency.record(req.rid).leaving_row = req.kv.req_pool_idx
        return original(req, tree_cache, checkpoint=checkpoint)
    finally:
        record = residency.record(req.rid)
        if record is not None:
            record.leaving_row = None
        # The borrowed prefix copies are read until here (a restore's copies, a host insert's
        # walk): the host lock goes with the record, or the tree could evict them first and
        # free slots the insert then hands back to it (issue 44's double free).
        if hold is not None:
            tree_cache.dec_host_lock_ref(hold.node, hold.host_receipt)
            pages.hold = None
        residency.forget(req.rid)


def _insert_on_host(residency: Residency, pages: RequestPages, req: Req, tree_cache: TreeCache) -> bool:
    """A finished request whose released pages the device cannot take back: put its full
    pages past what the tree holds for it into the tree host-only (HiCache's host nodes,
    as a storage prefetch does), so the next turn of its session matches them (and loads
    them back) instead of prefilling them again. The host copies of released pages are
    the tree's from then on; resident pages are copied out first. Returns False where
    nothing was inserted (the host pool full, the Rust tree core, no host copy above)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    if not residency.host_insert:
        return False  # the Python tree core's walk
    ps = pages.page_size
    req.refresh_fill_ids()
    start = req.kv.cache_protected_len
    end = req.owned_kv_len() // ps * ps
    if start % ps or end <= start:
        return False
    node_id = req.lock.node if req.lock is not None else tree_cache.root_node_handle(req.extra_key)
    if pages.hold is not None and pages.hold.history_unheld:
        node_id = pages.hold.node  # a returning turn's own pages, after its history's host node
    wanted = torch.arange(start // ps, end // ps)
    host = residency.host_page_slots(pages, wanted)
    if host is None:
        return False
    if not bool(residency.pools.host_allocated(host.flatten()).all()):
        # A host copy the request reads was freed under it: handing it to the tree would
        # free it twice later. Leave the request out of the tree (its KV is recomputed).
        logger.error("hot set: request %s's host copies were freed while it held them; not cached", req.rid)
        return False
    core = tree_cache.tree_core
    key = RadixKey(
        req.full_untruncated_fill_ids[start:end], req.extra_key, is_bigram=core.is_eagle, cache_salt=req.cache_salt
    )
    parent = core.node_by_id(node_id)
    prior = parent.hash_value[-1] if parent.hash_value else None
    hashes = get_storage_hash_str(key, prior, page_size=ps)
    result = core.insert_host(node_id, key, host.flatten(), hashes)
    tree_cache._apply_cache_actions(result.cache_actions)
    if result.host_insert_dropped:
        return False
    # The walk keeps the host copies of nodes that had one ([0, prefix_len) of the key);
    # the rest are the tree's now.
    residency.give_host_copies(pages, wanted[result.prefix_len // ps :])
    if result.inserted_host_node is not None:
        tree_cache.write_backup_storage(result.inserted_host_node)
    return True


def free_row_around_released(
    residency: Residency, original: Callable[..., Any], cache: TreeCache, kv: ReqKvInfo, ranges: list[tuple[int, int]]
) -> Any:
    """Around ``free_kv_row``: a leaving request frees only positions it still holds."""
    pages = residency.leaving(kv.req_pool_idx)
    if pages is not None:
        ranges = subtract_pages(list(ranges), pages.released_pages().tolist(), pages.page_size)
    return original(cache, kv, ranges)
