"""What the hot set takes out of the KV pool at start-up (the page importance table only), and
the KV arithmetic of its borrowed rows.

The hot set keeps no pool of its own: a tracked request's key ranges and codes live in KV
pages borrowed from SGLang's allocator as its pages fill (``rows.py``), so they are paid
from the KV budget on demand. What is allocated once, beside the pool, is the page
importance table (``importance/page_importance.py``, a few bytes per KV page); its bytes
come out of the memory SGLang would otherwise give the KV pool. SGLang sizes its pool in
tokens (the profiled memory over its bytes per token, capped by ``--max-total-tokens``,
floored to whole pages); :func:`plan_table` takes that count, ``kv_tokens_alone``, and
returns the pool's size beside the table, such that::

    kv_tokens * kv_bytes_per_token + table_bytes <= kv_tokens_alone * kv_bytes_per_token

Plain arithmetic; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_importance.hot_set.guard.key_codes import code_rows_per_page
from sgl_importance.hot_set.guard.key_ranges import range_bytes_per_page
from sgl_importance.importance.page_importance import TABLE_BYTES_PER_PAGE


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
    def ranges_per_page(self) -> int:
        """Key ranges one borrowed page holds: a range is a token slot's K and V."""
        return self.page_size

    @property
    def codes_per_page(self) -> int:
        """Key-code rows one borrowed page holds (``key_codes.RowLayout``)."""
        return code_rows_per_page(self.element_size, fused=self.head_dim == self.v_head_dim)

    @property
    def range_bytes_per_page(self) -> int:
        """Device bytes of one page's key range, all layers and KV heads."""
        return self.num_layers * self.num_kv_heads * range_bytes_per_page(self.head_dim, self.element_size)

    def row_pages(self, full_pages: int, guarded: bool) -> int:
        """KV pages borrowed for the rows of ``full_pages`` summarised pages (at most: a
        request's rows share pages with others' rows)."""
        ranges = -(-full_pages // self.ranges_per_page)
        return ranges + (-(-full_pages // self.codes_per_page) if guarded else 0)


@dataclass(frozen=True)
class TableBudget:
    """The page importance table and what the KV pool gave up for it.

    Attributes:
        kv_tokens_alone: tokens SGLang sized the KV pool to without the table.
        kv_tokens: tokens the KV pool has beside it.
        table_bytes: the bytes taken out for it.
        shape: the KV pool's shape the arithmetic used.
        sized_by: what sized the KV pool alone, for the start-up line.
    """

    kv_tokens_alone: int
    kv_tokens: int
    table_bytes: int
    shape: KVShape
    sized_by: str = "the profiled memory"

    @property
    def kv_tokens_given_up(self) -> int:
        return self.kv_tokens_alone - self.kv_tokens


def plan_table(kv_tokens_alone: int, shape: KVShape) -> TableBudget:
    """The KV pool's tokens beside the page importance table (a row per KV page and one more).

    Raises:
        ValueError: when the table would leave the KV pool no page.
    """
    ps = shape.page_size
    budget = kv_tokens_alone // ps * shape.kv_bytes_per_page
    kv_pages = (budget - TABLE_BYTES_PER_PAGE) // (shape.kv_bytes_per_page + TABLE_BYTES_PER_PAGE)
    if kv_pages <= 0:
        raise ValueError(f"a KV pool of {kv_tokens_alone} tokens has no page left beside the page importance table")
    return TableBudget(kv_tokens_alone, kv_pages * ps, (kv_pages + 1) * TABLE_BYTES_PER_PAGE, shape)


def describe(budget: TableBudget) -> str:
    """The start-up line: what the hot set set aside (the table only) and how its rows are paid."""
    s = budget.shape
    return (
        f"hot set: nothing set aside for its rows: each tracked request's key ranges (1 KV page per "
        f"{s.ranges_per_page} of its pages) and, guarded, key codes (1 per {s.codes_per_page}) are borrowed "
        f"from the KV pool as its pages fill and given back when it leaves; the page importance table takes "
        f"{budget.table_bytes / 2**20:.2f} MiB, the KV pool {budget.kv_tokens_alone} -> {budget.kv_tokens} "
        f"tokens ({budget.sized_by})"
    )
