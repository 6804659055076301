"""Invariants the test suite checks in every server it starts (``SGL_IMPORTANCE_CHECKS=1``).

Off by default: none of these hooks is registered then (``plugin.py``'s ``checks``
process rows), so a served request pays nothing for them.

- **No page moves inside a forward pass.** The hot set's residency owner moves pages
  between steps (``scheduler/hot_set_release.py``); nothing inside ``ModelRunner.forward``
  (the decoder, the attention backends) may allocate or free a device page or evict from
  the radix tree. SGLang's own forward does neither; the check fails the first call that
  does, naming it. Per thread: HiCache's own threads allocate host pages while a forward
  runs, and only the forward's thread is in it.

The host-slot ledger (``hot_set/pages/host_ledger.py``) is the other check the same switch turns on.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class PageMoveInForward(AssertionError):
    """The allocator or the radix tree was called from inside a model forward."""


class ForwardCheck:
    """Whether this thread is inside ``ModelRunner.forward``, and the check against it."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def in_forward(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def around_forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Around ``ModelRunner.forward``: the thread is inside a forward until it returns."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            self._local.depth -= 1

    def no_page_move(self, owner: Any, *args: Any, **kwargs: Any) -> None:
        """Before an allocator's ``alloc``/``free`` or the tree's ``evict``: fail inside a forward."""
        if self.in_forward:
            raise PageMoveInForward(
                f"{type(owner).__name__} called inside a model forward: pages move only between steps"
            )
