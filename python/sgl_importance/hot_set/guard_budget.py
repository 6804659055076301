"""The guard's share of device memory: how many pages its pool holds, and what the KV pool gives up.

The guard's pool (``key_codes.GuardPool``) is allocated once at start-up and never
grows, so its bytes must come out of the memory SGLang would otherwise give the KV
pool, or the two together would overrun what the KV pool alone was sized to fill.
SGLang sizes its KV pool in tokens (the profiled memory over its bytes per token,
capped by ``--max-total-tokens``, floored to whole pages); :func:`plan_guard` takes
that count, ``kv_tokens_alone``, and returns the guard's pages and the KV pool's
smaller size, such that::

    kv_tokens * kv_bytes_per_token + guard_bytes <= kv_tokens_alone * kv_bytes_per_token

Pages are the unit on both sides: the KV pool gives up whole pages (SGLang's
allocator hands out nothing smaller) and the guard's pool holds whole pages, plus
its padding page id 0.

How many tokens the guard covers (``--hot-set-guard-tokens``; 0 = auto): the guard
codes every full page of each guarded request, wherever the page lives. Without a
host pool nothing is released, so guarded pages all sit in the KV pool: the guard
needs at most as many tokens as the KV pool. With one, a released request keeps at
least the ``--hot-set-budget`` fraction of its pages on the device, so a KV pool full
of hot sets holds at most ``kv_tokens / fraction`` tokens of guarded context: the auto
guard covers that (:func:`auto_coverage`).

Plain arithmetic over ``key_codes`` and ``config``; nothing here imports SGLang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from sgl_importance.config import ImportanceConfig
from sgl_importance.hot_set.key_codes import bytes_per_page

# Auto coverage for a budget given in pages (no fraction to divide by): as the
# default --hot-set-budget 0.2 covers.
PAGE_BUDGET_COVERAGE = 5.0
# Past this many times the KV pool's tokens the auto guard would take most of the
# memory (10 x 12.5 % at a Llama-8B shape); smaller fractions state their tokens.
MAX_AUTO_COVERAGE = 10.0
GUARD_TOKENS_FLAG = "--hot-set-guard-tokens"


@dataclass(frozen=True)
class KVShape:
    """What one rank's KV pool stores per token: ``num_layers`` x ``num_kv_heads``
    keys of ``head_dim`` and values of ``v_head_dim`` elements of ``element_size``
    bytes, in pages of ``page_size`` tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    element_size: int
    page_size: int

    @property
    def kv_bytes_per_page(self) -> int:
        """KV pool bytes of one page, all layers and KV heads (SGLang's cell size x page)."""
        return (
            self.page_size * self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * self.element_size
        )

    @property
    def guard_bytes_per_page(self) -> int:
        """Guard pool bytes of one page, all layers and KV heads."""
        return self.num_layers * self.num_kv_heads * bytes_per_page(self.head_dim, self.page_size)

    def guard_bytes(self, pages: int) -> int:
        """Bytes of a guard pool of ``pages`` pages (with its padding page)."""
        return (pages + 1) * self.guard_bytes_per_page


@dataclass(frozen=True)
class GuardBudget:
    """The guard's pool and what the KV pool gave up for it.

    Attributes:
        guard_pages: pages the guard's pool holds (0: no guard, nothing reserved).
        guard_bytes: the bytes taken out of the KV pool's memory for it (0 with no guard).
        kv_tokens_alone: tokens SGLang sized the KV pool to without a guard.
        kv_tokens: tokens the KV pool has beside the guard.
        shape: the KV pool's shape the arithmetic used.
        sized_by: what sized the KV pool alone, for the start-up line.
    """

    guard_pages: int
    guard_bytes: int
    kv_tokens_alone: int
    kv_tokens: int
    shape: KVShape
    sized_by: str = "the profiled memory"

    @property
    def guard_tokens(self) -> int:
        return self.guard_pages * self.shape.page_size

    @property
    def guard_bytes_per_token(self) -> float:
        """Guard bytes per covered token, all layers and KV heads (the padding page aside)."""
        return self.shape.guard_bytes_per_page / self.shape.page_size

    @property
    def kv_tokens_given_up(self) -> int:
        return self.kv_tokens_alone - self.kv_tokens

    @property
    def kv_bytes(self) -> int:
        """The KV pool's bytes beside the guard."""
        return self.kv_tokens // self.shape.page_size * self.shape.kv_bytes_per_page


def guard_wanted(config: ImportanceConfig) -> bool:
    """Whether the server's settings use the guard: a hot set that is not dense, with a
    guard threshold below 1. (A request that asks for a guard on a server without one
    finds an empty pool: it decodes unguarded, counted.)"""
    return config.hot_set_policy not in ("off", "dense") and config.hot_set_guard_threshold < 1.0


def auto_coverage(budget: Union[int, float], hierarchical: bool) -> float:
    """Guard tokens per KV pool token under ``--hot-set-guard-tokens 0``.

    Args:
        budget: ``--hot-set-budget`` (a fraction, or pages when an int).
        hierarchical: whether a host pool takes released pages (``--enable-hierarchical-cache``).
    """
    if not hierarchical:
        return 1.0  # nothing is released: every guarded page is in the KV pool
    if isinstance(budget, float):
        return min(1.0 / budget, MAX_AUTO_COVERAGE)
    return PAGE_BUDGET_COVERAGE


def plan_guard(
    kv_tokens_alone: int,
    shape: KVShape,
    *,
    guard_tokens: Optional[int],
    coverage: float = 1.0,
) -> GuardBudget:
    """The guard's pages and the KV pool's tokens beside it.

    Args:
        kv_tokens_alone: the KV pool's tokens without a guard (a multiple of the page size).
        shape: the KV pool's shape.
        guard_tokens: tokens the guard covers (rounded up to whole pages); None: auto,
            ``coverage`` times the KV pool's own tokens (after it gave up the guard's share);
            0: no guard.
        coverage: guard tokens per KV pool token, for the auto size.

    Raises:
        ValueError: naming ``--hot-set-guard-tokens`` when the guard leaves the KV pool no page.
    """
    ps = shape.page_size
    pages_alone = kv_tokens_alone // ps
    if guard_tokens == 0:
        return GuardBudget(0, 0, kv_tokens_alone, kv_tokens_alone, shape)
    kv_page, guard_page = shape.kv_bytes_per_page, shape.guard_bytes_per_page
    budget = pages_alone * kv_page
    if guard_tokens is None:
        # n KV pages and floor(coverage * n) guard pages (and the padding one) within budget.
        kv_pages = max(int((budget - guard_page) / (kv_page + coverage * guard_page)), 0)
        while kv_pages > 0 and kv_pages * kv_page + shape.guard_bytes(int(coverage * kv_pages)) > budget:
            kv_pages -= 1
        guard_pages = int(coverage * kv_pages)
    else:
        guard_pages = -(-guard_tokens // ps)
        kv_pages = pages_alone - -(-shape.guard_bytes(guard_pages) // kv_page)
    if kv_pages <= 0:
        raise ValueError(
            f"{GUARD_TOKENS_FLAG} {guard_tokens if guard_tokens is not None else 0!r} is invalid; allowed: a guard "
            f"that leaves the KV pool a page: its {kv_tokens_alone} tokens ({budget} bytes) are all the guard's"
        )
    return GuardBudget(guard_pages, shape.guard_bytes(guard_pages), kv_tokens_alone, kv_pages * ps, shape)


def guard_budget(config: ImportanceConfig, shape: KVShape, kv_tokens_alone: int, *, hierarchical: bool) -> GuardBudget:
    """The server's guard budget from its flags (no guard: nothing reserved).

    Args:
        config: the server's flags (``--hot-set-*``).
        shape: the KV pool's shape on this rank.
        kv_tokens_alone: the KV pool's tokens as SGLang sized it without a guard.
        hierarchical: whether a host pool takes released pages.
    """
    if not guard_wanted(config):
        return plan_guard(kv_tokens_alone, shape, guard_tokens=0)
    tokens = config.hot_set_guard_tokens or None
    coverage = auto_coverage(config.hot_set_budget, hierarchical)
    return plan_guard(kv_tokens_alone, shape, guard_tokens=tokens, coverage=coverage)


def describe(budget: GuardBudget) -> str:
    """The start-up line: the guard's tokens and bytes, and what the KV pool gave up."""
    source = budget.sized_by
    if not budget.guard_pages:
        return (
            f"hot set: no guard pool (guard off: --hot-set-guard-threshold 1 or policy dense); the KV pool "
            f"keeps its {budget.kv_tokens} tokens ({source})"
        )
    s = budget.shape
    share = budget.guard_bytes / budget.kv_bytes if budget.kv_bytes else math.inf
    per_token = (
        f"{budget.guard_bytes_per_token:.2f} bytes per token over {s.num_layers} layers x {s.num_kv_heads} KV heads"
    )
    return (
        f"hot set: guard pool of {budget.guard_tokens} tokens ({budget.guard_pages} pages), "
        f"{budget.guard_bytes / 2**20:.2f} MiB ({per_token}), "
        f"{100 * share:.1f} % of the KV pool's {budget.kv_bytes / 2**20:.2f} MiB; "
        f"the KV pool gave up {budget.kv_tokens_given_up} tokens: {budget.kv_tokens_alone} -> {budget.kv_tokens} "
        f"({source})"
    )
