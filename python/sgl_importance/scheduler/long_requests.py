"""Requests longer than the device pool: the limits a hot-set server states and holds.

SGLang derives the longest request it takes from the device KV pool
(``TpModelWorker.get_worker_info``: ``min(context - 1, pool - 1)``) and clips each request's
new tokens to what the pool could hold alone (``init_req_max_new_tokens``), so a prompt
longer than the pool is refused before streamed prefill or release could act. With the hot
set on and HiCache's host pool, a long request holds on the device only its hot set and the
rows of its pages, its whole KV in the host pool: the limit is the model's context, the host
pool and the longest request whose hot set and rows the device pool holds
(``longest_held``), not the device pool itself. So, after the scheduler is built:

- ``max_req_len`` / ``max_req_input_len`` (which the tokenizer manager also takes for its
  400) become the least of those where that is longer;
- prefill is chunked with chunks that fit beside the rest (a quarter of the device pool at
  most), so a long prompt streams (``streamed_prefill.py``);
- each request's new tokens are clipped to that limit instead of the device pool's, except
  for a request whose own hot-set settings keep every page (``dense``, ``quest``): that one
  still has to fit on the device, and is refused if it cannot.

One start-up line states the limits: the longest request and what bounds it, the device
pool's tokens and the host pool's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sgl_importance.hot_set.pages.footprint import footprint
from sgl_importance.runtime import Runtime
from sgl_importance.sglang_types.scheduler import Req, Scheduler

logger = logging.getLogger(__name__)

# A chunk may take at most this share of the device pool (the rest: hot sets, rows, decode).
CHUNK_SHARE = 4
# SGLang's own margin between the longest request and its longest prompt.
INPUT_MARGIN = 5


@dataclass(frozen=True)
class Limits:
    """What a hot-set server takes: ``longest`` tokens a request (prompt and output), bounded
    by ``bound`` ('the model's context', 'the host pool'); ``device_longest``: what a request
    keeping every page on the device may be (SGLang's own limit)."""

    longest: int
    bound: str
    device_longest: int
    device_tokens: int
    host_tokens: int


def set_limits(runtime: Runtime, scheduler: Scheduler) -> Optional[Limits]:
    """After ``Scheduler.__init__`` on a hot-set server whose pages may be released (a host
    pool): raise SGLang's request limits to what the host pool and the context allow, chunk
    prefill to fit, and say so in one line. Returns the limits (also on ``runtime.limits``)."""
    residency = runtime.residency
    if not residency.enabled:
        logger.info(
            "hot set: the longest request is %d tokens (the device pool: --enable-hierarchical-cache lets "
            "longer ones keep their KV in the host pool), the device pool holds %d tokens",
            scheduler.max_req_len,
            scheduler.max_total_num_tokens,
        )
        return None
    host = residency.pools.host_pool.size
    context = scheduler.model_config.context_len
    device = scheduler.max_total_num_tokens
    ps = residency.pools.page_size
    fit = max(ps, device // CHUNK_SHARE // ps * ps)
    if scheduler.chunked_prefill_size is None or scheduler.chunked_prefill_size > fit:
        scheduler.chunked_prefill_size = fit
    held = longest_held(runtime, device, context, scheduler.chunked_prefill_size)
    longest, bound = min(
        (context - 1, "the model's context"),
        (host - 1, "the host pool"),
        (held, "what the device pool holds of one request's hot set and rows"),
    )
    device_longest = scheduler.max_req_len
    if longest > scheduler.max_req_len:
        scheduler.max_req_len, scheduler.max_req_input_len = longest, longest - INPUT_MARGIN
    else:
        longest, bound = scheduler.max_req_len, "the device pool"
    runtime.limits = Limits(longest, bound, device_longest, scheduler.max_total_num_tokens, host)
    logger.info(
        "hot set: the longest request is %d tokens (%s), the device pool holds %d tokens, the host pool %d; "
        "prompts prefill in chunks of %d tokens",
        longest,
        bound,
        scheduler.max_total_num_tokens,
        host,
        scheduler.chunked_prefill_size,
    )
    return runtime.limits


def longest_held(runtime: Runtime, device: int, context: int, chunk: int) -> int:
    """The longest request whose peak footprint at the server's hot-set settings (its hot set,
    the KV pages borrowed for its rows, its prefill chunk: ``hot_set/footprint.footprint``)
    fits the device pool alone."""
    d, params = runtime.hot_set_decoder, runtime.hot_set_params
    if d is None or params is None:
        return context
    per_page = (d.ranges.rows.rows_per_page, d.guard.rows.rows_per_page)

    def fits(length: int) -> bool:
        f = footprint(
            length,
            length + 1,
            params,
            threshold=d.threshold,
            page_size=d.page_size,
            chunk=chunk,
            rows_per_page=per_page,
        )
        return f is None or f.peak + d.page_size <= device

    low, high = 1, context
    while low < high:  # the longest length that fits (footprints grow with the length)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def clip_new_tokens(runtime: Runtime, original: Callable[..., Any], scheduler: Scheduler, req: Req) -> Any:
    """Around ``Scheduler.init_req_max_new_tokens``: a request is clipped to the server's
    longest request, not to what the device pool alone holds; one whose own settings keep
    every page on the device still fits there or is refused."""
    sampling = req.sampling_params
    wanted, wanted_min = sampling.max_new_tokens, sampling.min_new_tokens
    result = original(scheduler, req)
    limits = runtime.limits
    if limits is None or req.finished():
        return result
    params = runtime.request_params.get(req.rid, runtime.hot_set_params)
    prompt = len(req.origin_input_ids)
    if params is not None and params.policy in ("dense", "quest"):
        if prompt >= limits.device_longest - INPUT_MARGIN:
            req.set_finish_with_abort(
                f"Input length ({prompt} tokens) needs the whole request on the device, whose pool holds "
                f"{limits.device_tokens} tokens: its hot-set policy {params.policy!r} keeps every page "
                "(a policy that releases pages, such as the server's, serves it from the host pool)"
            )
            sampling.max_new_tokens = 0
        else:  # what SGLang allowed, within the device pool's own limit
            sampling.max_new_tokens = max(0, min(sampling.max_new_tokens, limits.device_longest - prompt - 1))
    else:
        cap = (1 << 30) if wanted is None else wanted
        if (scheduler.max_new_tokens_limit or 0) > 0:  # SGLANG_MAX_NEW_TOKENS_LIMIT, as SGLang applies it
            cap = min(cap, scheduler.max_new_tokens_limit)
        sampling.max_new_tokens = max(0, min(cap, scheduler.max_req_len - prompt - 1))
    sampling.min_new_tokens = min(wanted_min, sampling.max_new_tokens)
    return result
