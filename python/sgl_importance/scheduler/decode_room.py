"""Room for the next decode step, before SGLang retracts a request for want of it.

SGLang's ``ScheduleBatch.check_decode_mem`` asks whether the device can take the batch's
next tokens and, if not, retracts requests (their KV dropped, prefilled again later). A
hot-set server has two cheaper ways to make room first: the device pages of releases
whose copies to the host are still in flight (freed once each lands), and hot sets the
guard grew past their budget (``request_state.TrackedRequest.follow_flags``), which go
back to it for good (``HotSetDecoder.shrink``), the residency owner releasing what that
leaves out. The capacity study's H3 ("shrink before retract").
"""

from __future__ import annotations

from typing import Any, Callable

from sgl_importance.runtime import Runtime
from sgl_importance.sglang_types.scheduler import ScheduleBatch


def fits_after_releases(
    runtime: Runtime, original: Callable[..., bool], batch: ScheduleBatch, *args: Any, **kwargs: Any
) -> bool:
    """Around ``ScheduleBatch.check_decode_mem``: before SGLang retracts requests for want
    of room, the device pages of this step's releases whose copies to the host are still
    in flight (freed once each lands, ``reopen_admission``) are waited for and freed, and
    the check is made again (counted: ``release_waits``); if still short, every hot set the
    guard grew past its budget goes back to it, releasing what that leaves out, and the
    check is made once more (``hot_sets_shrunk``). Only then may SGLang retract."""
    residency = runtime.residency
    if original(batch, *args, **kwargs):
        return True
    if residency.copies.frees_waiting:
        residency.copies.collect(wait=True)
        residency.counts.release_waits += 1
        if original(batch, *args, **kwargs):
            return True
    decoder = runtime.hot_set_decoder
    if decoder is None or not residency.enabled:
        return False
    shrunk = decoder.shrink()
    if not shrunk.requests:
        return False
    residency.apply(shrunk)
    residency.copies.collect(wait=True)
    return original(batch, *args, **kwargs)
