"""A returning turn whose history is in the host pool: read from there, never loaded back whole.

HiCache loads a prefix matched in the host pool (a session's history the device evicted, or
one a storage prefetch brought in) back into device pages before the new turn's prefill
(``UnifiedRadixCache.init_load_back``), so the turn waits for device room for the whole
history, and then the hot set releases most of it again. With streamed prefill
(``streamed_prefill.py``: its extend reads released positions from the host pool) and the
prefix held on the host (``--hot-set-prefix host``), an eligible turn loads nothing back:

- **admission** (``FootprintAdder.add_one_req``, ``borrow``): the host part of its match
  becomes part of its prefix (``prefix_len``), SGLang's host hit is zeroed so no load-back is
  queued or charged, and the matched node is host-locked; refused, all of it is undone
  (``settle``);
- **its row** (``prefix_with_history``, around ``prefix_device_indices``): the device part's
  slots, then the released slot for every position of the host part;
- **its record** (``lend_history``, after ``ScheduleBatch.prepare_for_extend``, once the row
  exists): admitted to release with the whole matched prefix lent by the tree
  (``Residency.lend_prefix``), the host part released from the start. The extend reads those
  pages from the tree's host copies, the first decode step summarises and reads them there,
  and its plan promotes the hot set. From then on the prefix is held on the host as any
  matched prefix (``hot_set_release.py``).

A turn that finishes before its decode steps gave the tree its device prefix back (the first
two) goes into the tree host-only: its own full pages under the history's host node
(``hot_set_release._insert_on_host``, counted ``finished_on_host``), so the next turn matches
them too.

Eligible: a request past the threshold whose policy streams, a host hit and nothing else
loaded (no SWA, Mamba or linker state), a finished host copy of every node of its match, and
admitted by footprint (a turn the range pool refused would read its whole history from the host
every step). Otherwise HiCache loads the history back as usual.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sgl_importance.hot_set.pages.footprint import streams
from sgl_importance.hot_set.pages.prefix_hold import HistoryLoan
from sgl_importance.hot_set.pages.state import RELEASED_SLOT, LogicalPage
from sgl_importance.hot_set.residency import Residency
from sgl_importance.runtime import Runtime
from sgl_importance.sglang_types.scheduler import Req, ScheduleBatch
from sgl_importance.sglang_types.tree import TreeCache


def borrow(runtime: Runtime, req: Req, tree_cache: TreeCache, fits: Callable[[], bool]) -> Optional[HistoryLoan]:
    """Before SGLang's admission of ``req``: take its host hit as prefix (module docstring),
    or None where it is not eligible (SGLang loads it back). ``fits``: whether admission would
    charge it its footprint (its releases and key ranges fit), asked last."""
    from sgl_importance.scheduler.hot_set_release import path_host_slots

    residency, hot_set = runtime.residency, runtime.hot_set_attention
    if not (residency.enabled and residency.prefix_on_host and hot_set is not None and hot_set.stream_prefill):
        return None
    hit = req.host_hit_length
    others = (req.swa_host_hit_length, req.mamba_host_hit_length, req.auxiliary_swa_host_hit_length)
    if hit <= 0 or any(others) or req.kv.holds_kv or len(req.full_untruncated_fill_ids) <= residency.threshold:
        return None
    if tree_cache.linker is not None or tree_cache.buffer_pipeline is not None:
        return None
    if not streams(runtime.request_params.get(req.rid, runtime.hot_set_params)) or not fits():
        return None
    host = path_host_slots(tree_cache, req.best_match_node)
    if host is None or host.numel() != req.prefix_len + hit or (req.prefix_len + hit) % residency.pools.page_size:
        return None
    receipt = tree_cache.inc_host_lock_ref(req.best_match_node).to_dec_params()
    loan = HistoryLoan(req.best_match_node, receipt, host, req.prefix_len, hit)
    req.prefix_len += hit
    req.host_hit_length = 0
    return loan


def settle(runtime: Runtime, req: Req, tree_cache: TreeCache, loan: HistoryLoan, admitted: bool) -> None:
    """After SGLang's admission: an admitted turn's loan waits for its row; a refused one is undone."""
    if admitted:
        # As SGLang leaves a turn whose load-back it made: the prefix the tree's, the host
        # hit counted as loaded (the cached-token split by tier credits the host pool).
        req.kv.cache_protected_len = req.prefix_len
        req.host_hit_length = req.host_loaded_length = loan.host_hit
        runtime.residency.open(req.rid).loan = loan
        return
    req.prefix_len, req.host_hit_length = loan.device_len, loan.host_hit
    tree_cache.dec_host_lock_ref(loan.node, loan.host_receipt)


def prefix_with_history(
    residency: Residency, original: Callable[..., torch.Tensor], cache: TreeCache, req: Req
) -> torch.Tensor:
    """Around ``prefix_device_indices``: a borrowing turn's prefix row (module docstring)."""
    record = residency.record(req.rid)
    loan = None if record is None else record.loan
    if loan is None:
        return original(cache, req)
    prefix_len = req.prefix_len
    req.prefix_len = loan.device_len
    try:
        device = original(cache, req)
    finally:
        req.prefix_len = prefix_len
    host_part = torch.full((prefix_len - loan.device_len,), RELEASED_SLOT, dtype=device.dtype, device=device.device)
    return torch.cat((device, host_part))


def lend_history(runtime: Runtime, batch: ScheduleBatch) -> None:
    """After ``ScheduleBatch.prepare_for_extend``: a borrowing turn's record, its history lent."""
    from sgl_importance.hot_set.pages.prefix_hold import PrefixHold

    residency = runtime.residency
    for req in batch.reqs:
        record = residency.record(req.rid)
        if record is None or record.loan is None:
            continue
        loan, record.loan = record.loan, None
        ps = residency.pools.page_size
        row = batch.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        pages = residency.admit(req.rid, row, LogicalPage(loan.host_slots.numel() // ps), ps)
        residency.lend_prefix(pages, loan.host_slots, on_device=loan.device_len // ps)
        pages.hold = PrefixHold(loan.node, loan.host_receipt, history=True)
