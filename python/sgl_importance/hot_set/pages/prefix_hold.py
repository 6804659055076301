"""What the tree lends a running request of its host copies (``--hot-set-prefix host``).

``HistoryLoan``: a returning turn's history taken from the host pool at admission
(``scheduler/returning.py``), on the request's record until its row exists. ``PrefixHold``:
the scheduler makes one when the tree lends a request its matched prefix
(``scheduler/hot_set_release.py``) or that loan becomes the request's; it lives on the
request's ``RequestPages.hold`` until the request leaves. Plain data; nothing here imports
SGLang (the node and receipt are SGLang's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sgl_importance.sglang_types.tree import LockReceipt, NodeId


@dataclass
class PrefixHold:
    """What the tree lent a request, and the locks it holds for it."""

    node: NodeId  # the tree node the request matched (its prefix's last)
    host_receipt: LockReceipt  # the host lock on it, to give back
    fresh: bool = True  # lent this step: the step's moves release the unplanned pages first
    unlocked: bool = False  # the request's device lock on the prefix has gone
    history: bool = False  # a returning turn's: its match's host part never loaded back (returning.py)

    @property
    def history_unheld(self) -> bool:
        """A returning turn's history still matched from the host: its row holds no page of it."""
        return self.history and not self.unlocked


@dataclass
class HistoryLoan:
    """A returning turn's history taken from the tree's host copies, until its record holds it."""

    node: NodeId  # the tree node its match ended on (host part's last)
    host_receipt: LockReceipt  # the host lock on it
    host_slots: torch.Tensor  # host slots of its whole match, root first
    device_len: int  # tokens of the match on the device (SGLang's prefix before the host hit)
    host_hit: int  # SGLang's host hit, given back if it is not admitted
