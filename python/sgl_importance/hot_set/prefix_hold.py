"""A running request's hold on its matched prefix's host copies (``--hot-set-prefix host``).

The scheduler makes one when the tree lends a request its matched prefix
(``scheduler/hot_set_release.py``) or a returning turn takes its history from the host pool
(``scheduler/returning.py``); it lives on the request's ``RequestPages.hold`` until the
request leaves. Plain data; nothing here imports SGLang (the node and receipt are SGLang's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PrefixHold:
    """What the tree lent a request, and the locks it holds for it."""

    node: Any  # the tree node the request matched (its prefix's last)
    host_receipt: Any  # the host lock on it, to give back
    fresh: bool = True  # lent this step: the step's moves release the unplanned pages first
    unlocked: bool = False  # the request's device lock on the prefix has gone
    history: bool = False  # a returning turn's: its match's host part never loaded back (returning.py)

    @property
    def history_unheld(self) -> bool:
        """A returning turn's history still matched from the host: its row holds no page of it."""
        return self.history and not self.unlocked
