"""The hot set's fixed device pools, and what the KV pool gives up for them.

The hot set keeps two pools by page id, allocated once at start-up and never grown: the
key ranges of every full page of a tracked request (``key_ranges.KeyRanges``; any policy
but ``dense``) and, with the guard on, those pages' key codes (``key_codes.GuardPool``);
and a page importance table per KV pool page (``importance/page_importance.py``). Their
bytes must come out of the memory SGLang would otherwise give the KV pool, or together
they would overrun what the KV pool alone was sized to fill. SGLang sizes its KV pool in
tokens (the profiled memory over its bytes per token, capped by ``--max-total-tokens``,
floored to whole pages); :func:`plan_guard` takes that count, ``kv_tokens_alone``, and
returns the pools' pages and the KV pool's smaller size, such that::

    kv_tokens * kv_bytes_per_token + reserved_bytes <= kv_tokens_alone * kv_bytes_per_token

Pages are the unit on both sides: the KV pool gives up whole pages (SGLang's allocator
hands out nothing smaller) and the pools hold whole pages, plus their padding page id 0.

How many tokens the pools cover (``--hot-set-guard-tokens``; 0 = auto): every full page
of each tracked request, wherever the page lives. Without a host pool nothing is
released, so tracked pages all sit in the KV pool: the pools need at most as many tokens
as the KV pool. With one, a released request keeps at least the ``--hot-set-budget``
fraction of its pages on the device, so a KV pool full of hot sets holds at most
``kv_tokens / fraction`` tokens of tracked context: the auto size covers that
(:func:`auto_coverage`).

Plain arithmetic over ``key_codes`` and ``config``; nothing here imports SGLang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from sgl_importance.config import ImportanceConfig
from sgl_importance.hot_set.key_codes import bytes_per_page
from sgl_importance.hot_set.key_ranges import range_bytes_per_page
from sgl_importance.importance.page_importance import TABLE_BYTES_PER_PAGE

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

    @property
    def range_bytes_per_page(self) -> int:
        """Key-range pool bytes of one page, all layers and KV heads."""
        return self.num_layers * self.num_kv_heads * range_bytes_per_page(self.head_dim, self.element_size)

    def range_bytes(self, pages: int) -> int:
        """Bytes of a key-range pool of ``pages`` pages (with its padding page)."""
        return (pages + 1) * self.range_bytes_per_page


@dataclass(frozen=True)
class GuardBudget:
    """The guard's pool and what the KV pool gave up for it.

    Attributes:
        guard_pages: pages the guard's pool holds (0: no guard).
        guard_bytes: the bytes taken out of the KV pool's memory for it (0 with no guard).
        kv_tokens_alone: tokens SGLang sized the KV pool to without the pools.
        kv_tokens: tokens the KV pool has beside them.
        shape: the KV pool's shape the arithmetic used.
        sized_by: what sized the KV pool alone, for the start-up line.
        range_pages: pages the key-range pool holds (0: none, a dense hot set).
        range_bytes: the bytes taken out for it.
        table_bytes: the bytes taken out for the page importance table.
    """

    guard_pages: int
    guard_bytes: int
    kv_tokens_alone: int
    kv_tokens: int
    shape: KVShape
    sized_by: str = "the profiled memory"
    range_pages: int = 0
    range_bytes: int = 0
    table_bytes: int = 0

    @property
    def reserved_bytes(self) -> int:
        """Everything the hot set took out of the KV pool's memory."""
        return self.guard_bytes + self.range_bytes + self.table_bytes

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
    ranges: bool = False,
    guard: bool = True,
) -> GuardBudget:
    """The pools' pages and the KV pool's tokens beside them.

    Args:
        kv_tokens_alone: the KV pool's tokens without the pools (a multiple of the page size).
        shape: the KV pool's shape.
        guard_tokens: tokens the pools cover (rounded up to whole pages); None: auto,
            ``coverage`` times the KV pool's own tokens (after it gave up the pools' share);
            0: none (no pool, nothing reserved).
        coverage: covered tokens per KV pool token, for the auto size.
        ranges: the key-range pool is wanted (a hot set that is not dense); with it, the
            page importance table is reserved too.
        guard: the guard's key-code pool is wanted.

    Raises:
        ValueError: naming ``--hot-set-guard-tokens`` when the pools leave the KV pool no page.
    """
    ps = shape.page_size
    pages_alone = kv_tokens_alone // ps
    if guard_tokens == 0 or not (ranges or guard):
        return GuardBudget(0, 0, kv_tokens_alone, kv_tokens_alone, shape)
    guard_page = shape.guard_bytes_per_page if guard else 0
    range_page = shape.range_bytes_per_page if ranges else 0
    table_page = TABLE_BYTES_PER_PAGE if ranges else 0
    # Each pool keeps a padding page; the table has one row per KV page and one more.
    fixed = guard_page + range_page + table_page
    kv_page, meta_page = shape.kv_bytes_per_page + table_page, guard_page + range_page
    budget = pages_alone * shape.kv_bytes_per_page

    def used(kv_pages: int, meta_pages: int) -> int:
        return kv_pages * kv_page + meta_pages * meta_page + fixed

    if guard_tokens is None:
        # n KV pages and floor(coverage * n) pool pages within budget.
        kv_pages = max(int((budget - fixed) / (kv_page + coverage * meta_page)), 0)
        while kv_pages > 0 and used(kv_pages, int(coverage * kv_pages)) > budget:
            kv_pages -= 1
        meta_pages = int(coverage * kv_pages)
    else:
        meta_pages = -(-guard_tokens // ps)
        kv_pages = (budget - meta_pages * meta_page - fixed) // kv_page
    if kv_pages <= 0:
        raise ValueError(
            f"{GUARD_TOKENS_FLAG} {guard_tokens if guard_tokens is not None else 0!r} is invalid; allowed: pools "
            f"that leave the KV pool a page: its {kv_tokens_alone} tokens ({budget} bytes) are all the pools'"
        )
    return GuardBudget(
        meta_pages if guard else 0,
        shape.guard_bytes(meta_pages) if guard else 0,
        kv_tokens_alone,
        kv_pages * ps,
        shape,
        range_pages=meta_pages if ranges else 0,
        range_bytes=shape.range_bytes(meta_pages) if ranges else 0,
        table_bytes=(kv_pages + 1) * table_page,
    )


def guard_budget(config: ImportanceConfig, shape: KVShape, kv_tokens_alone: int, *, hierarchical: bool) -> GuardBudget:
    """The server's pools from its flags (a dense hot set: none, nothing reserved).

    Args:
        config: the server's flags (``--hot-set-*``).
        shape: the KV pool's shape on this rank.
        kv_tokens_alone: the KV pool's tokens as SGLang sized it without the pools.
        hierarchical: whether a host pool takes released pages.
    """
    ranges = config.hot_set_policy not in ("off", "dense")
    tokens = config.hot_set_guard_tokens or None
    coverage = auto_coverage(config.hot_set_budget, hierarchical)
    return plan_guard(
        kv_tokens_alone, shape, guard_tokens=tokens, coverage=coverage, ranges=ranges, guard=guard_wanted(config)
    )


def describe(budget: GuardBudget) -> str:
    """The start-up line: the pools' pages and bytes, and what the KV pool gave up."""
    source = budget.sized_by
    if not budget.reserved_bytes:
        return (
            f"hot set: no key-range or guard pool (a dense hot set); the KV pool keeps its "
            f"{budget.kv_tokens} tokens ({source})"
        )
    s = budget.shape
    share = budget.reserved_bytes / budget.kv_bytes if budget.kv_bytes else math.inf
    pages = max(budget.range_pages, budget.guard_pages)
    parts = []
    if budget.range_pages:
        parts.append(f"key ranges {budget.range_bytes / 2**20:.2f} MiB")
    if budget.guard_pages:
        parts.append(f"guard codes {budget.guard_bytes / 2**20:.2f} MiB")
    else:
        parts.append("no guard pool (--hot-set-guard-threshold 1)")
    parts.append(f"page importance table {budget.table_bytes / 2**20:.2f} MiB")
    return (
        f"hot set: pools of {pages * s.page_size} tokens ({pages} pages over {s.num_layers} layers x "
        f"{s.num_kv_heads} KV heads): {', '.join(parts)}; {budget.reserved_bytes / 2**20:.2f} MiB in all, "
        f"{100 * share:.1f} % of the KV pool's {budget.kv_bytes / 2**20:.2f} MiB; "
        f"the KV pool gave up {budget.kv_tokens_given_up} tokens: {budget.kv_tokens_alone} -> {budget.kv_tokens} "
        f"({source})"
    )
