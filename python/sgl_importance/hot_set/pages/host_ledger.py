"""Who holds each host slot: free, the radix tree, or a running hot-set request.

A check, on in the test suite (``SGL_IMPORTANCE_CHECKS=1``; off by default:
it costs a few array ops per host alloc and free). The host pool records every alloc and
free it serves (the tree's, HiCache's and the hot set's alike: they all reach the one
pool); the hot set records its own hand-overs. A slot has one owner at a time:

| move | from | to | recorded by |
|---|---|---|---|
| alloc | free | tree | the host pool (every caller) |
| take | tree | request | the hot set, right after its own alloc |
| give | request | tree | the hot set, a finished request's copies entering the tree |
| return | request | tree | the hot set, right before its own free |
| free | tree | free | the host pool (every caller) |
| clear | tree (all) | free | the host pool, on ``/flush_cache`` |

and a running request may *borrow* tree slots (a matched prefix held on the host): the
tree must not free a slot while any request borrows it. The first move that breaks this
raises ``HostSlotError`` naming the slots, who moved them and who holds them, so a bug is
caught where it happens rather than at the pool's later "double free".
Plain numpy; nothing here imports SGLang.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import numpy as np
import torch

from sgl_importance.env import CHECKS_ENV

_FREE, _TREE = 0, 1  # owner codes; a request's code is 2 and up


class HostSlotError(AssertionError):
    """A host slot moved by someone who does not hold it."""


def ledger_from_env(size: int) -> Optional["HostSlotLedger"]:
    """A ledger for a host pool of ``size`` slots when the check is on, else None."""
    return HostSlotLedger(size) if os.environ.get(CHECKS_ENV, "") not in ("", "0") else None


class HostSlotLedger:
    """Owner of every slot of one host pool, and the requests borrowing tree slots."""

    def __init__(self, size: int) -> None:
        self._owner = np.zeros(size, dtype=np.int64)
        self._borrows = np.zeros(size, dtype=np.int64)  # how many requests borrow the slot
        self._borrowed_by: dict[int, np.ndarray] = {}  # request code -> slots it borrows
        self._codes: dict[str, int] = {}
        self._names = {_FREE: "free", _TREE: "the tree"}
        # The host pool's alloc and free run on HiCache's threads too.
        self._lock = threading.Lock()

    def _code(self, owner: str) -> int:
        code = self._codes.get(owner)
        if code is None:
            code = self._codes[owner] = len(self._names)
            self._names[code] = f"request {owner}"
        return code

    def _move(self, slots: torch.Tensor, held_by: int, to: int, what: str, mover: str) -> None:
        idx = slots.detach().to("cpu", torch.int64).numpy().reshape(-1)
        with self._lock:
            wrong = idx[self._owner[idx] != held_by]
            if wrong.size:
                holders = sorted({self._names[int(c)] for c in self._owner[wrong]})
                raise HostSlotError(
                    f"host slot ledger: {mover} {what} {wrong.size} slots {wrong[:8].tolist()} "
                    f"held by {', '.join(holders)} (expected {self._names[held_by]})"
                )
            if to == _FREE:
                lent = idx[self._borrows[idx] > 0]
                if lent.size:
                    raise HostSlotError(
                        f"host slot ledger: {mover} {what} {lent.size} slots {lent[:8].tolist()} "
                        f"while {', '.join(self._borrowers(lent))} borrows them"
                    )
            self._owner[idx] = to

    def _borrowers(self, slots: np.ndarray) -> list[str]:
        return sorted(self._names[c] for c, held in self._borrowed_by.items() if np.isin(slots, held).any())

    # The host pool: every alloc and free, whoever calls.
    def allocated(self, slots: torch.Tensor) -> None:
        self._move(slots, _FREE, _TREE, "was handed", "the host pool's alloc")

    def freed(self, slots: torch.Tensor) -> None:
        self._move(slots, _TREE, _FREE, "freed", "a free of the tree's (or HiCache's)")

    def cleared(self) -> None:
        """The pool was emptied at once (``/flush_cache``): no request may hold a slot."""
        with self._lock:
            held = np.nonzero((self._owner >= 2) | (self._borrows > 0))[0]
            if held.size:
                owners = sorted({self._names[int(c)] for c in self._owner[held] if c >= 2} | set(self._borrowers(held)))
                raise HostSlotError(
                    f"host slot ledger: the pool was cleared while {', '.join(owners)} held {held.size} slots"
                )
            self._owner[:] = _FREE

    # The hot set's own moves.
    def take(self, slots: torch.Tensor, owner: str) -> None:
        """The slots a request just allocated are its own."""
        self._move(slots, _TREE, self._code(owner), "took", f"request {owner}")

    def give(self, slots: torch.Tensor, owner: str) -> None:
        """A request's slots become the tree's (they entered a tree node)."""
        self._move(slots, self._code(owner), _TREE, "gave the tree", f"request {owner}")

    def release(self, slots: torch.Tensor, owner: str) -> None:
        """A request frees its own slots (the pool's free follows)."""
        self._move(slots, self._code(owner), _TREE, "freed", f"request {owner}")

    def borrow(self, slots: torch.Tensor, owner: str) -> None:
        """A request reads tree slots (its matched prefix's host copies) until ``unborrow``."""
        idx = slots.detach().to("cpu", torch.int64).numpy().reshape(-1)
        with self._lock:
            wrong = idx[self._owner[idx] != _TREE]
            if wrong.size:
                holders = sorted({self._names[int(c)] for c in self._owner[wrong]})
                raise HostSlotError(
                    f"host slot ledger: request {owner} borrowed {wrong.size} slots {wrong[:8].tolist()} "
                    f"held by {', '.join(holders)}, not the tree"
                )
            code = self._code(owner)
            if code in self._borrowed_by:
                raise HostSlotError(f"host slot ledger: request {owner} borrowed a prefix twice")
            self._borrowed_by[code] = idx.copy()
            self._borrows[idx] += 1

    def unborrow(self, owner: str) -> None:
        """The request no longer reads the slots it borrowed (none: nothing)."""
        with self._lock:
            idx = self._borrowed_by.pop(self._code(owner), None)
            if idx is not None:
                self._borrows[idx] -= 1

    def held_by_requests(self) -> int:
        """Slots owned or borrowed by running requests (0 once every request has left)."""
        with self._lock:
            return int((self._owner >= 2).sum()) + int((self._borrows > 0).sum())
