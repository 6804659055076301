"""Where a hot-set step's page copies run: a side stream on CUDA, in line on the CPU.

The residency owner (``residency.py``) issues a step's releases (device → host) and
promotions (host → device) here, between steps. On CUDA they run on a side stream after
what the forward stream has queued so far (the pages' last writes); the forward stream
waits for them before it next reads (``fence``, at the top of every forward), and a device
page a release copied from goes back to the allocator only once that copy is done
(``defer_free``/``collect``), so no other writer (a prefill, HiCache's own load-back) lands
in it first. On the CPU a copy runs where it is issued and a free is immediate.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class PageCopies:
    """The side stream page copies run on (CUDA), and what waits for them.

    Releases (device → host) and promotions (host → device) of a step are issued here,
    after what the forward stream has queued so far (the pages' last writes). The forward
    stream waits for them before it next reads (``fence``); a device page a release copied
    from is freed only once that copy is done (``defer_free``/``collect``), so no other
    writer (a prefill, HiCache's own load-back) can land in it first. Elsewhere (the CPU)
    a copy runs where it is issued and frees are immediate.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        self.stream: Optional[Any] = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._event: Optional[Any] = None
        self._held: list[torch.Tensor] = []  # tensors a queued copy reads: alive until fenced
        self._frees: list[tuple[tuple[Any, ...], Callable[[], None]]] = []  # (what it waits for, free)
        # A step still running on another stream (``after``): copies and frees wait for it. The
        # last one only: steps end in order on their stream.
        self._step: Optional[Any] = None

    @property
    def pending(self) -> bool:
        """Whether copies were queued that no fence has waited for yet."""
        return self._event is not None

    @property
    def frees_waiting(self) -> bool:
        """Whether device pages wait for a copy out of them to finish before they are freed."""
        return bool(self._frees)

    def run(self, copy: Callable[[], None], *held: torch.Tensor) -> None:
        """Issue ``copy`` on the side stream (in line without one)."""
        if self.stream is None:
            copy()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        if self._step is not None:
            self.stream.wait_event(self._step)
        with torch.cuda.stream(self.stream):
            copy()
            self._event = self.stream.record_event()
        self._held.extend(held)

    def after(self, event: Optional[Any]) -> None:
        """The next copies also wait for ``event`` (a step still running on another stream that
        reads pages they may overwrite: ``--hot-set-plan-ahead``); None: nothing to wait for."""
        if event is not None and self.stream is not None:
            self._step = event

    def defer_free(self, free: Callable[[], None]) -> None:
        """Run ``free`` once every copy issued so far is done, and the step ``after`` named
        (at once without a stream)."""
        events = tuple(e for e in (self._event, self._step) if e is not None)
        if self.stream is None or not events:
            free()
            return
        self._frees.append((events, free))

    def collect(self, wait: bool = False) -> None:
        """Run the deferred frees whose copies are done (``wait``: all, waiting if need be)."""
        still = []
        for events, free in self._frees:
            if wait or all(e.query() for e in events):
                for e in events:
                    e.synchronize()
                free()
            else:
                still.append((events, free))
        self._frees = still

    def fence(self) -> None:
        """Make the current stream wait for every copy issued so far (before a forward reads)."""
        if self._event is None:
            return
        torch.cuda.current_stream(self.stream.device).wait_event(self._event)
        self._event = None
        self._held.clear()

    def host_ready(self) -> None:
        """Block the host until every copy issued so far is done (before it reads a host copy)."""
        if self._event is not None:
            self._event.synchronize()
