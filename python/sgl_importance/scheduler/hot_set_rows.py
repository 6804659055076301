"""Scheduler hooks of the hot set's borrowed rows: pages lent before a batch, given back after.

A tracked request's key ranges and codes live in KV pages borrowed from SGLang's
allocator (``hot_set/pages/rows.py``). The decoder writes them at the end of the step that
filled a page, inside the forward, where nothing may allocate; so before each batch runs
(``Scheduler.run_batch``) the stock is filled with the pages that batch's requests may
need for rows they do not hold yet, and after it (and after a request leaves) what the
stock still holds goes back to the allocator. Between batches the allocator's free count
is exact: the stores hold only the pages of rows that running requests hold.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

import torch

from sgl_importance.runtime import Runtime
from sgl_importance.sglang_types.scheduler import Req, ScheduleBatch, Scheduler
from sgl_importance.sglang_types.tree import TreeCache

if TYPE_CHECKING:
    from sgl_importance.hot_set.decode import HotSetDecoder
    from sgl_importance.hot_set.pages.rows import BorrowedPages


def pages_for_batch(runtime: Runtime, batch: Optional[ScheduleBatch]) -> int:
    """Pages the stock needs before ``batch`` runs: rows its requests will write this step."""
    decoder = runtime.hot_set_decoder
    if decoder is None or batch is None or not batch.reqs:
        return 0
    lengths = batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else [r.seqlen for r in batch.reqs]
    # One token more than the forward's lengths: a step ended a step late, or a page that fills now.
    return pages_wanted(decoder, {req.rid: int(n) + 1 for req, n in zip(batch.reqs, lengths)})


def around_batch(
    runtime: Runtime,
    original: Callable[..., Any],
    scheduler: Scheduler,
    batch: ScheduleBatch,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Around ``Scheduler.run_batch``: before it, the stock filled with the pages this batch's
    rows may take; after it, what the batch did not take given back, then the decode step it
    ran ended (``HotSetAttention.end_batch``) and the page moves it returns for the next step
    made (``Residency.apply``: releases, then promotions), before anything allocates for that
    step. The only place a hot-set step ends and its pages move."""
    hot_set, moves = runtime.hot_set_attention, None
    try:
        with lent(runtime.row_pages, scheduler.tree_cache, lambda: pages_for_batch(runtime, batch)):
            try:
                return original(scheduler, batch, *args, **kwargs)
            finally:
                # Ended while the stock is lent: the end writes the key ranges and codes of the
                # pages the step filled into rows of borrowed pages.
                moves = hot_set.end_batch() if hot_set is not None else None
    finally:
        runtime.residency.apply(moves)


@contextmanager
def lent(rows: Optional[BorrowedPages], tree_cache: TreeCache, pages: Callable[[], int]) -> Iterator[None]:
    """The stock (``hot_set/rows.BorrowedPages``; None: no hot set) holds ``pages()`` pages
    while the block runs; what the block did not take goes back to the allocator after it."""
    if rows is None:
        yield
        return
    settle(rows, tree_cache, pages())
    try:
        yield
    finally:
        if rows.stock:
            settle(rows, tree_cache, 0)


def lent_for(
    rows: Optional[BorrowedPages], tree_cache: TreeCache, decoder: HotSetDecoder, lengths: Mapping[str, int]
) -> AbstractContextManager[None]:
    """``lent`` with the pages the rows of these requests (rid -> length) need, each known to be
    long already (a streamed prompt's first chunks are shorter than the threshold)."""
    return lent(rows, tree_cache, lambda: pages_wanted(decoder, lengths, long=True))


def release_rows(runtime: Runtime, original: Callable[..., Any], req: Req, tree_cache: TreeCache, **kwargs: Any) -> Any:
    """Around ``release_kv_cache``: a leaving request's rows go back with it (finished, aborted
    or retracted), their pages to the allocator, so an idle server holds none of them."""
    try:
        return original(req, tree_cache, **kwargs)
    finally:
        decoder, hot_set = runtime.hot_set_decoder, runtime.hot_set_attention
        with lent(runtime.row_pages, tree_cache, lambda: 0):
            record = None if decoder is None else decoder.residency.record(req.rid)
            if record is not None and record.tracked is not None:
                decoder.forget_request(req.rid)
                if hot_set is not None and hot_set.metrics is not None:
                    hot_set.after_step()


def pages_wanted(decoder: HotSetDecoder, lengths: Mapping[str, int], long: bool = False) -> int:
    """KV pages the row stores must be lent before a batch of these requests (request id ->
    its length when the step ends) writes the key ranges and codes of their full pages
    (``hot_set/coding.summarise_pages``, inside the forward, where nothing may allocate); ``long``:
    each is past the threshold whatever its length so far."""
    ranges = codes = 0
    selections = decoder.tracked  # built from the records once, not per request
    for rid, length in lengths.items():
        if length <= decoder.threshold and not long:
            continue
        tracked = selections.get(rid)
        params = decoder.request_params.get(rid, decoder.params) if tracked is None else tracked.state.params
        if tracked is not None and tracked.ranges_refused:
            params = tracked.refused_params or params  # rows to regain its own settings
        if params.policy == "dense":
            continue
        full = length // decoder.page_size
        held = 0 if tracked is None or tracked.ranges_refused else tracked.ranges.numel()
        ranges += max(0, full - held)
        if params.guard_threshold < 1.0 and not (tracked is not None and tracked.guard_refused):
            codes += max(0, full - (tracked.codes.numel() if tracked is not None else 0))
    return decoder.ranges.rows.pages_for(ranges) + decoder.guard.rows.pages_for(codes)


def settle(rows: BorrowedPages, tree_cache: TreeCache, want: int) -> int:
    """The stock (``hot_set/rows.BorrowedPages``) made ``want`` pages, between steps only;
    returns what it holds."""
    allocator = tree_cache.token_to_kv_pool_allocator
    free = lambda slots: allocator.free(slots.to(allocator.device))  # noqa: E731  (its free lists are on its device)
    return rows.settle(want, lambda tokens: alloc_evicting(tree_cache, tokens), free)


def alloc_evicting(tree_cache: TreeCache, tokens: int) -> Optional[torch.Tensor]:
    """``tokens`` slots (whole pages) from SGLang's allocator, evicting unlocked tree nodes
    if it is short (cached pages are worth less than pages a running request reads)."""
    allocator = tree_cache.token_to_kv_pool_allocator
    slots = allocator.alloc(tokens)
    if slots is None and tokens:
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        evict_from_tree_cache(tree_cache, tokens)
        slots = allocator.alloc(tokens)
    return slots
