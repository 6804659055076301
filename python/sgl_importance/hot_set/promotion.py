"""Where promotions' host → device copies run: a side stream on CUDA, in line elsewhere.

The decoder plans step N + 1 at the end of step N and promotes that plan's released
pages then, one step ahead (``decode.py``). On a CUDA device those copies go on a side
stream, so they overlap with what the forward stream still has to do (the rest of step
N, sampling, the next step's start) instead of queueing in front of it; an event
recorded after them is waited on by the forward stream before a layer reads a page
(``fence``). Elsewhere (the CPU) a copy runs where it is issued, and ``fence`` has
nothing to wait for.

The side stream first waits for what the forward stream has queued so far: a
promotion writes into device pages the allocator just handed out, which a release of
the same step may have freed while a layer of that step still reads them.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from sgl_importance.hot_set.residency import PagePools


class PromotionStream:
    """The side stream promotions run on, and the event that fences them.

    Args:
        device: the device pool's device; a side stream only where it is CUDA.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        self.stream: Optional[Any] = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
        self._event: Optional[Any] = None
        # Index tensors a queued copy reads: held until the forward stream has waited
        # for it, so the caching allocator cannot hand their memory out under it.
        self._held: list[Any] = []

    @property
    def pending(self) -> bool:
        """Whether copies were queued that no fence has waited for yet."""
        return self._event is not None

    def run(self, copy: Callable[[], None], *held: Any) -> None:
        """Issue ``copy`` on the side stream (in line without one).

        Args:
            copy: enqueues the copies (its kernels go to the current stream).
            held: tensors the copy reads, kept alive until the next ``fence``.
        """
        if self.stream is None:
            copy()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            copy()
            self._event = self.stream.record_event()
        self._held.extend(held)

    def fence(self) -> None:
        """Make the current stream wait for every copy issued so far (before a layer reads)."""
        if self._event is None:
            return
        torch.cuda.current_stream(self.stream.device).wait_event(self._event)
        self._event = None
        self._held.clear()


class StreamedPagePools:
    """``residency.PagePools`` whose promotions (``to_device``) run on a ``PromotionStream``.

    Everything else is the wrapped pools' own: releases (``to_host``) stay on the
    forward stream, which orders them after the step that last wrote the pages.
    """

    def __init__(self, pools: PagePools, promotions: PromotionStream) -> None:
        self.pools = pools
        self.promotions = promotions

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pools, name)

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.promotions.run(lambda: self.pools.to_device(host_slots, device_slots), host_slots, device_slots)
