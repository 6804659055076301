"""Scheduler hooks of hot-set page release: who may release, and leaving cleanly.

The registry these hooks act on (the runtime's ``ReleaseRegistry``, passed in as ``releases``;
``RequestPages``) and the page moves are
``hot_set/residency.py``; here are the hooks plugin.py calls and ``HiCachePagePools``,
the adapter of ``residency.PagePools`` over SGLang's allocator and host pool.

With ``--hot-set-policy`` on and HiCache's host pool present (``--enable-hierarchical-cache``),
a request longer than ``--hot-set-threshold`` tokens is *admitted* to release: the
decoder may give back its pages past the ones the radix tree holds for it
(``hot_set/residency.py``). It is admitted at whichever comes first:

- prefill, when the tokens it prefills (the prompt; after a retraction, the prompt
  and what it had generated) are past the threshold. It is kept out of the tree
  while it runs (the checkpoints SGLang makes after each prefill chunk are skipped
  for it, the path SGLang takes for requests barred from the tree), so its pages
  past the matched prefix are its own;
- decode, on the step that takes it past the threshold (a short prompt generating a
  long answer): SGLang checkpointed its prompt into the tree at prefill and inserts
  nothing more until it finishes, so the pages past ``cache_protected_len`` (the
  partial last page of the prompt, then what it generates) are its own; the
  prompt's tree pages stay on the device.

An admitted request is never checkpointed into the tree while it runs. When it leaves:

- finished (``release_kv_cache`` with ``checkpoint``): its released pages are
  copied back into free device pages (evicting unlocked tree nodes if needed) and
  the whole sequence is inserted into the tree as usual, so prefix reuse holds.
  When the device cannot take them back, the request is not inserted (its KV is
  freed; its matched prefix stays in the tree) and ``finished_uncached`` counts it.
- aborted or retracted: nothing is inserted; the positions it released are left
  out of what SGLang frees (they are not its pages any more). A retracted request
  is prefilled again later and admitted again (by its new length).

Either way its host copies are freed. Without the host pool the hot set stays
logical: every page stays on the device (logged once at start-up).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from sgl_importance.config import ImportanceConfig
from sgl_importance.hot_set.request_params import RequestParams
from sgl_importance.hot_set.residency import ReleaseRegistry, RequestPages, subtract_pages
from sgl_importance.hot_set.selection import HotSetParams
from sgl_importance.scheduler.hot_set_requests import forget_request

logger = logging.getLogger(__name__)


class HiCachePagePools:
    """``residency.PagePools`` over SGLang's allocator and HiCache's host pool."""

    def __init__(self, tree_cache: Any) -> None:
        self.tree_cache = tree_cache
        self.allocator = tree_cache.token_to_kv_pool_allocator
        self.page_size = self.allocator.page_size
        self.device_pool = self.allocator.get_kvcache()
        self.host_group = tree_cache.host_pool_group
        self.host_pool = self.host_group.anchor_entry.host_pool
        self.io_backend = tree_cache.cache_controller.io_backend

    def alloc_device(self, num_pages: int) -> Optional[torch.Tensor]:
        return self.allocator.alloc(num_pages * self.page_size)

    def free_device(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def alloc_host(self, num_pages: int) -> Optional[torch.Tensor]:
        # Host nodes of the tree make room if the pool is full (they are copies).
        return self.host_group.alloc(num_pages * self.page_size, reclaim=self.tree_cache.evict_host)

    def free_host(self, slots: torch.Tensor) -> None:
        self.host_group.free(slots)

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        self.host_pool.backup_from_device_all_layer(self.device_pool, host_slots, device_slots, self.io_backend)

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        for layer in range(self.host_pool.layer_num):
            self.host_pool.load_to_device_per_layer(self.device_pool, host_slots, device_slots, layer, self.io_backend)

    def host_layer(self, layer_id: int, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.host_pool.gather_layer(layer_id, host_slots)


def enable(
    releases: ReleaseRegistry, hot_set_params: Optional[HotSetParams], config: ImportanceConfig, scheduler: Any
) -> None:
    """After ``Scheduler.__init__``: turn release on where the hot set and a host pool are.

    Args:
        releases, hot_set_params, config: the runtime's registry, the server's hot-set
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
    releases.enable(HiCachePagePools(tree_cache), config.hot_set_threshold)
    logger.info("hot set releases device pages of requests longer than %d tokens", releases.threshold)


def reopen_admission(releases: ReleaseRegistry, scheduler: Any) -> None:
    """After a batch: if the hot set gave device pages back, let the scheduler admit again.

    SGLang stops trying to prefill waiting requests once an attempt found no room
    (``batch_is_full``) and tries again only when a request leaves; pages released
    mid-request would otherwise sit free until then.
    """
    if releases.reopen:
        releases.reopen = False
        scheduler.running_batch.batch_is_full = False


def checkpoint_unless_released(
    releases: ReleaseRegistry, original: Callable[..., Any], req: Any, tree_cache: Any
) -> Any:
    """Around ``checkpoint_kv_cache``: keep a long prefill's pages out of the tree."""
    if not releases.enabled or req.skip_radix_cache_insert:
        return original(req, tree_cache)
    # The whole prefill, every chunk alike: the prompt, and after a retraction what
    # the request had generated too (SGLang does not grow this array mid-prefill).
    if not releases.admitted(req.rid) and len(req.full_untruncated_fill_ids) <= releases.threshold:
        return original(req, tree_cache)
    page_size = tree_cache.token_to_kv_pool_allocator.page_size
    releases.admit(req.rid, _first_own_page(req, page_size))
    # What SGLang does for a request barred from the tree: resume after this extend.
    req.prefix_len = req.extend_end
    return None


def admit_grown(releases: ReleaseRegistry, batch: Any) -> None:
    """After ``ScheduleBatch.prepare_for_decode``: admit the requests this step takes
    past the threshold (a short prompt generating a long answer).

    The step's KV length (``kv_committed_len``, this step's token included) is what the
    decoder tracks a request by, so the decoder finds it admitted on the step it starts
    planning it. The tree holds ``[0, cache_protected_len)`` of it (the prompt, page
    aligned; SGLang inserts no decode tokens before the request finishes): the pages
    from there on are its own.
    """
    if not releases.enabled:
        return
    threshold = releases.threshold
    for req in batch.reqs:
        if req.kv.kv_committed_len <= threshold or releases.admitted(req.rid):
            continue
        # Barred from the tree (beam rows share pages), or leaving: as for long prompts.
        if req.skip_radix_cache_insert or req.finished():
            continue
        releases.admit(req.rid, _first_own_page(req, releases.pools.page_size))


def _first_own_page(req: Any, page_size: int) -> int:
    """The request's first page past what it shares with the tree (its matched prefix)."""
    return -(-req.kv.cache_protected_len // page_size)


def release_with_pages(
    releases: ReleaseRegistry,
    request_params: RequestParams,
    original: Callable[..., Any],
    req: Any,
    tree_cache: Any,
    *,
    checkpoint: bool,
) -> Any:
    """Around ``release_kv_cache``: bring released pages back or keep them out of the free."""
    forget_request(request_params, req)
    if not releases.admitted(req.rid):
        return original(req, tree_cache, checkpoint=checkpoint)
    pages = releases.peek(req.rid)
    try:
        if pages is not None and bool(pages.released.any()):
            inserting = checkpoint and not req.skip_radix_cache_insert
            if inserting:
                _restore_all(releases, pages, tree_cache)
            if bool(pages.released.any()):
                if inserting:
                    releases.counts.finished_uncached += 1
                    logger.info(
                        "hot set: request %s leaves %d pages on the host; it is not inserted into the tree",
                        req.rid,
                        int(pages.released.sum()),
                    )
                    # Set only to stop this insert: a retracted request keeps its flag
                    # for the prefill that resumes it (tree insert or admission again).
                    req.skip_radix_cache_insert = True
                releases.leaving[req.kv.req_pool_idx] = pages
            elif inserting:
                releases.counts.finished_reinserted += 1
        return original(req, tree_cache, checkpoint=checkpoint)
    finally:
        releases.leaving.clear()
        releases.forget(req.rid)


def _restore_all(releases: ReleaseRegistry, pages: RequestPages, tree_cache: Any) -> None:
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    held = pages.released_pages()
    need = held.numel() * pages.page_size
    if tree_cache.token_to_kv_pool_allocator.available_size() < need:
        evict_from_tree_cache(tree_cache, need)
    pages.restore(held, releases.pools, releases.counts)


def free_row_around_released(
    releases: ReleaseRegistry, original: Callable[..., Any], cache: Any, kv: Any, ranges: Any
) -> Any:
    """Around ``free_kv_row``: a leaving request frees only positions it still holds."""
    pages = releases.leaving.get(kv.req_pool_idx)
    if pages is not None:
        ranges = subtract_pages(list(ranges), pages.released_pages().tolist(), pages.page_size)
    return original(cache, kv, ranges)
