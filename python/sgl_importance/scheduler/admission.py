"""Admission by footprint: a hot-set request is charged what it will keep on the device.

SGLang's ``PrefillAdder`` reserves, for each running request and each one it admits,
``min(max_new_tokens - generated, 4096) x new_token_ratio`` tokens of future growth (the
ratio is 1 under ``ignore_eos``), as if every generated token stayed on the device. A
request the hot set releases keeps its hot set, not its length: past ``--hot-set-threshold``
its pages outside the hot set leave for the host pool as they are generated. So a long
generation was admitted as if it kept all its KV (11 of 20 at equal memory,
``benchmark/long_context/RESULTS.md``).

``FootprintAdder`` (SGLang's adder class, through ``Scheduler.get_prefill_adder_class``)
charges such a request its growth up to its peak footprint instead
(``hot_set/footprint.footprint``: the prompt or the threshold held densely, then the hot set,
sinks, window, the page being filled, and the KV pages borrowed for its key ranges and codes:
``hot_set/pages/rows.py``), times SGLang's ratio, never more than SGLang's own charge. The prompt
(the extend) is charged as SGLang charges it, so a prefill never overruns, and only the future
growth is discounted; where long prompts stream (``--hot-set-prefill stream``:
``streamed_prefill.py``) a prompt never held whole is charged its peak instead, its last chunk
beside its sinks and window or its hot set, whichever is larger. A request is charged this way
only while the **host pool** can take every page it releases (``releases_refused`` would keep
them on the device): running hot-set requests' final releases and this round's, against the
pool's size (the tree's host copies are evicted for them: ``page_pools.HiCachePagePools.alloc_host``), and
while it holds its key ranges (one refused them keeps every page). Otherwise it is charged as
SGLang charges it (counted: ``footprint_refused``). A running
request whose hot set the guard grew (its selection wanted released pages:
``request_state.TrackedRequest.follow_flags``) is charged its grown share of its final
length, and a new one the running requests' mean grown share (``request_state.kept_share``).
What the discount can still get wrong (a hot set that grows after others were admitted)
meets the decode check: there grown hot sets go back to their budget first
(``decode_room.fits_after_releases``), and only then does SGLang retract the fewest-output
requests as it does for any request (a retracted one's pages wait for it in the tree, on
the host: ``hot_set_release.release_with_pages``).

The overridden methods are private to SGLang 0.5.23's ``PrefillAdder`` (plugin.py's table;
``test/unit/test_sglang_contract.py`` checks each).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable, Optional

from sgl_importance.hot_set.pages.footprint import Footprint, footprint
from sgl_importance.hot_set.params import HotSetParams
from sgl_importance.hot_set.plan.request_state import kept_share, ranges_refused
from sgl_importance.hot_set.residency import Residency
from sgl_importance.runtime import Runtime
from sgl_importance.sglang_types.scheduler import PrefillAdmission, Req, Scheduler


class FootprintBook:
    """One admission round's charges by footprint, and what they take of the host pool.

    Args:
        params_for: a request id -> its hot-set parameters (the server's unless it chose its own).
        kept_for: a request id -> the share of its pages its hot set holds where the guard
            grew it past the budget (None: the budget); for one not decoding yet, what the
            guard has grown the running ones to (``request_state.kept_share``).
        residency: the runtime's page records (release is off unless it is enabled).
        refused_for: a request id -> whether it was refused key ranges (it keeps every page).
        host_pages: host pages release copies may take (the pool less the admitted requests' own).
        clip: SGLang's cap on a request's estimated new tokens.
        chunk: the prefill chunk where long prompts are streamed (0: they are prefilled dense).
        rows_per_page: key ranges and key-code rows one borrowed KV page holds.
    """

    def __init__(
        self,
        params_for: Callable[[str], Optional[HotSetParams]],
        kept_for: Callable[[str], Optional[float]],
        residency: Residency,
        refused_for: Callable[[str], bool],
        host_pages: int,
        clip: int,
        chunk: int = 0,
        rows_per_page: tuple[int, int] = (0, 0),
    ) -> None:
        self.params_for, self.kept_for, self.residency, self.clip = params_for, kept_for, residency, clip
        self.refused_for = refused_for
        self.chunk, self.rows_per_page = chunk, rows_per_page
        self.host_left = host_pages

    def _footprint(self, rid: str, prompt: int, final: int) -> Optional[Footprint]:
        r = self.residency
        params = self.params_for(rid)
        if params is None or not r.enabled:
            return None
        ps, kept_share = r.pools.page_size, self.kept_for(rid)
        return footprint(
            prompt,
            final,
            params,
            threshold=r.threshold,
            page_size=ps,
            kept_share=kept_share,
            chunk=self.chunk,
            rows_per_page=self.rows_per_page,
            prefix_on_host=r.prefix_on_host,
        )

    def fits(self, f: Footprint, released_now: int = 0) -> bool:
        """Whether the host pool can take what ``f`` will still release."""
        return max(f.released - released_now, 0) <= self.host_left

    def take(self, f: Footprint, released_now: int = 0) -> None:
        """Book what ``f`` will still take of the host pool (after ``fits``)."""
        self.host_left -= max(f.released - released_now, 0)

    def max_new(self, req: Req) -> int:
        """New tokens SGLang charges ``req`` for: what it may still generate, capped."""
        return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), self.clip)

    def running(self, req: Req, dense_charge: float, ratio: float) -> float:
        """A running request's future growth, booked (SGLang's ``dense_charge`` unless it
        releases and its releases fit)."""
        prompt = len(req.origin_input_ids)
        now = prompt + len(req.output_ids)
        f = self._footprint(req.rid, prompt, now + self.max_new(req))
        if f is None or self.refused_for(req.rid):
            return dense_charge
        pages = self.residency.peek(req.rid)
        ps = self.residency.pools.page_size
        if pages is None:  # not released yet: dense up to here, its peak still ahead
            held, released_now, peak = now, 0, f.peak
        else:
            released_now = pages.released_pages().numel()
            held, peak = (pages.num_pages - released_now) * ps, f.kept
        if not self.fits(f, released_now):
            return dense_charge
        self.take(f, released_now)
        return min(dense_charge, max(peak - held, 0) * ratio)

    def new(self, req: Req) -> tuple[Optional[Footprint], Optional[int]]:
        """A request being admitted: ``(its footprint, the tokens it is charged instead of
        max_new)``; the growth is None when its releases do not fit, the footprint None when
        it never releases (either way it is charged as SGLang charges it)."""
        prompt = len(req.origin_input_ids) + len(req.output_ids)  # a retracted one's output too
        max_new = self.max_new(req)
        f = self._footprint(req.rid, prompt, prompt + max_new)
        if f is None or not self.fits(f):
            return f, None
        return f, min(max_new, max(f.peak - prompt, 0))

    def streams(self, rid: str) -> bool:
        """Whether request ``rid``'s prompt is being streamed (a continuing chunked prefill)."""
        return bool(self.chunk) and self.residency.enabled and self.residency.admitted(rid)

    def charge(self, f: Footprint, extend: int, growth: int) -> int:
        """What a request admitted by footprint is charged for its extend and its growth: both,
        or where its prompt streams (it never holds it whole), never more than its peak."""
        return min(extend + growth, f.peak) if self.chunk else extend + growth


def footprint_adder(runtime: Runtime, original: Callable[..., type], scheduler: Scheduler) -> type:
    """Around ``Scheduler.get_prefill_adder_class``: SGLang's adder class, charging hot-set
    requests their footprint (a subclass made once per base class)."""
    base = original(scheduler)
    config = runtime.config
    # Streamed prompts need the adder's continuing-chunk rule under either admission.
    off = runtime.hot_set_params is None or (
        config.hot_set_admission != "footprint" and config.hot_set_prefill != "stream"
    )
    return base if off else _adder_class(base)


def new_book() -> FootprintBook:
    """This process's book for one admission round (the runtime's pools and parameters)."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    from sgl_importance import runtime as runtime_module

    rt = runtime_module.current()
    r = rt.residency
    host_pages = 0
    if r.enabled:
        host_pages = r.pools.host_pool.size // r.pools.page_size - r.host_pages_held()
    hot_set = rt.hot_set_attention

    def params_for(rid: str) -> Optional[HotSetParams]:
        if rt.config.hot_set_admission != "footprint":
            return None  # admitted by length: charged as SGLang charges any request
        return rt.request_params.get(rid, rt.hot_set_params)

    tracked = r.tracked()
    kept_for, refused_for = functools.partial(kept_share, tracked), functools.partial(ranges_refused, tracked)
    chunk, per_page = 0, (0, 0)
    if hot_set is not None and rt.hot_set_decoder is not None:
        d = rt.hot_set_decoder
        per_page = (d.ranges.rows.rows_per_page, d.guard.rows.rows_per_page)
        if hot_set.stream_prefill and rt.scheduler is not None:
            chunk = max(rt.scheduler.chunked_prefill_size or 0, 0)
    return FootprintBook(params_for, kept_for, r, refused_for, host_pages, CLIP_MAX_NEW_TOKENS, chunk, per_page)


@functools.cache  # one subclass per SGLang class: a pure function of it
def _adder_class(base: type) -> type:
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sgl_importance import runtime as runtime_module
    from sgl_importance.scheduler import returning

    class FootprintAdder(base):
        """SGLang's ``PrefillAdder``, charging hot-set requests their footprint (module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # The base's __init__ charges the running requests: the book comes first.
            self.footprint_book = new_book()
            self._selected: dict[str, Optional[Footprint]] = {}  # rid -> its footprint if it fits
            self._continuing: Optional[Req] = None
            super().__init__(*args, **kwargs)

        def add_one_req(self, req: Req, *args: Any, **kwargs: Any) -> Any:
            # A returning turn whose history is in the host pool takes it as prefix, unloaded,
            # where it is admitted by footprint (scheduler/returning.py).
            rt = runtime_module.current()
            loan = returning.borrow(rt, req, self.tree_cache, lambda: self.footprint_book.new(req)[1] is not None)
            if loan is None:
                return super().add_one_req(req, *args, **kwargs)
            admitted = False
            try:
                result = super().add_one_req(req, *args, **kwargs)
                admitted = any(r is req for r in self.can_run_list)
                return result
            finally:
                returning.settle(rt, req, self.tree_cache, loan, admitted)

        def _get_running_request_total_token_offset(self, req: Req) -> int:
            dense = super()._get_running_request_total_token_offset(req)
            ratio = 1.0 if req.sampling_params.ignore_eos else self.new_token_ratio
            return self.footprint_book.running(req, dense, ratio)

        def _select_prefill_admission(self, req: Req, *, total_tokens: int, **kwargs: Any) -> Any:
            f, growth = self.footprint_book.new(req)
            self._selected.pop(req.rid, None)
            if f is not None:
                self._selected[req.rid] = f if growth is not None else None
            if growth is None:
                return super()._select_prefill_admission(req, total_tokens=total_tokens, **kwargs)
            extend = len(req.full_untruncated_fill_ids) - req.prefix_len
            # A host hit is loaded back whole before the prefill (HiCache), streamed or not.
            loaded = min(kwargs.get("host_hit_length") or 0, extend)
            book = self.footprint_book
            total_tokens += loaded + book.charge(f, extend - loaded, growth) - extend - book.max_new(req)
            admission = super()._select_prefill_admission(req, total_tokens=total_tokens, **kwargs)
            if isinstance(admission, AddReqResult) or admission.is_chunked:
                return admission
            return replace(admission, max_new_tokens=min(admission.max_new_tokens, growth))

        def _commit_prefill_admission(self, req: Req, admission: PrefillAdmission, *args: Any, **kwargs: Any) -> None:
            super()._commit_prefill_admission(req, admission, *args, **kwargs)
            if req.rid in self._selected:
                self._charged(self._selected.pop(req.rid), counted=not admission.is_chunked)

        def add_chunked_req(self, req: Req) -> Optional[Req]:
            self._continuing = req
            limit = lowered = self.rem_chunk_tokens
            try:
                if limit is not None and self.footprint_book.streams(req.rid):
                    # SGLang schedules a continuing chunk even where the pool is short (its earlier
                    # chunks are only freed when it ends); a streamed prompt's leave after each
                    # chunk, so it takes the room there is and waits for a page of it instead.
                    ps = self.page_size
                    room = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
                    fit = min(limit, room // ps * ps - ps)
                    if fit < ps:
                        return req
                    self.rem_chunk_tokens = lowered = fit
                return super().add_chunked_req(req)
            finally:
                if limit is not None and self.rem_chunk_tokens is not None:
                    self.rem_chunk_tokens += limit - lowered
                self._continuing = None

        def _update_prefill_budget(self, prefix_len: int, extend_input_len: int, max_new_tokens: int, *a, **kw):
            req = self._continuing
            if req is not None and max_new_tokens > 0:  # a chunked prompt's last chunk
                f, growth = self.footprint_book.new(req)
                if growth is not None:
                    max_new_tokens = min(max_new_tokens, growth)
                if f is not None:
                    self._charged(f if growth is not None else None, counted=True)
            return super()._update_prefill_budget(prefix_len, extend_input_len, max_new_tokens, *a, **kw)

        def _charged(self, f: Optional[Footprint], *, counted: bool) -> None:
            """A hot-set request admitted: booked when charged its footprint; counted."""
            counts = self.footprint_book.residency.counts
            if f is not None:
                self.footprint_book.take(f)
            if counted and f is not None:
                counts.admitted_by_footprint += 1
            elif counted:
                counts.footprint_refused += 1

    FootprintAdder.__qualname__ = FootprintAdder.__name__ = f"Footprint{base.__name__}"
    return FootprintAdder
