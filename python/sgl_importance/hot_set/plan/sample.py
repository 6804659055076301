"""The uniform page sample the guard estimates a request's unread pages from.

Each full page of a guarded request draws ``u ~ U(0, 1)`` once, from a generator
seeded by the request (``request_seed``: a hash of its rid, so a request decodes the
same alone or in a batch, and again under the same rid; different requests draw
different samples, so "wrong with probability at most delta" is over requests, not one
draw per code version; the draw is independent of every query, which is all the
estimate needs), and is in the sample while ``u < inclusion(pages)``: a
Bernoulli sample with inclusion probability ``pi`` that does not depend on the query,
on importance or on which pages the hot set chose, so over the pages a step leaves
unread (which the plan picks without looking at ``u``) the sampled ones are a uniform
sample of them (vAttention, Desai et al. 2025, samples tokens the same way).
``pi`` shrinks as a request grows, so membership only ever leaves a page: the sample
stays nested and resident (sampled pages are planned, so never released).

``pi = max(FRACTION, MIN_PAGES / pages)``: at least ``MIN_PAGES`` pages, so short
requests get a usable estimate, and ``FRACTION`` of a long one (256 pages at 128K
tokens, page 16), but at most ``ROOM_SHARE`` of the hot set's room past its sinks and
window. The hot set's budget counts the expected sample (``reserve``), so the device
holds what the budget says.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

import hashlib
import math

import torch

FRACTION = 1 / 32
MIN_PAGES = 16
ROOM_SHARE = 0.5


def request_seed(rid: str) -> int:
    """The page sample's seed of the request ``rid``: 63 bits of its BLAKE2b hash."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") >> 1


def inclusion(num_full: int, room: int) -> float:
    """The inclusion probability of each full page of a request of ``num_full`` full
    pages whose hot set has ``room`` pages past its sinks and window: ``FRACTION`` of a
    long request, at least ``MIN_PAGES`` pages, and never more than ``ROOM_SHARE`` of
    the room (the rest of it holds the pages the policy keeps)."""
    if num_full <= 0:
        return 1.0
    wanted = max(FRACTION, MIN_PAGES / num_full)
    return max(0.0, min(1.0, wanted, ROOM_SHARE * room / num_full))


def reserve(pi: float, num_pages: int, budget: int) -> int:
    """Budget pages to keep for the sample of a request of ``num_pages`` pages whose hot
    set holds ``budget``: ``r`` with ``r = pi * (num_pages - budget + r)``, the sampled
    pages expected among those the rest of the budget leaves unread (rounded up)."""
    unread = max(0, num_pages - budget)
    if unread == 0 or pi <= 0.0:
        return 0
    if pi >= 1.0:
        return budget
    return min(budget, math.ceil(pi * unread / (1.0 - pi)))


class PageDraw:
    """One request's draws, one per logical page, made as pages appear."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self.u = torch.zeros(0, dtype=torch.float64)

    def members(self, num_full: int, pi: float) -> torch.Tensor:
        """bool ``[num_full]``: the full pages in the sample of inclusion probability ``pi``."""
        if self.u.numel() < num_full:
            fresh = torch.rand(num_full - self.u.numel(), generator=self._generator, dtype=torch.float64)
            self.u = torch.cat((self.u, fresh))
        return self.u[:num_full] < pi
