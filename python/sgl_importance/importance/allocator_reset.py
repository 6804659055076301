"""Zero a page's importance when SGLang's KV allocator frees it.

A freed page is handed to another request next, and importance earned by the old
tokens must not follow the page to new ones. ``plugin.py`` hooks the three places
where SGLang's dense allocators give pages back:

- ``PagedTokenToKVPoolAllocator._release_page_ids`` (page size > 1): every path
  that returns pages (``free``, ``free_page_ids``, the end of a free group) ends
  there, with page ids;
- ``TokenToKVPoolAllocator.free`` (page size 1, where a slot is a page): called
  again by ``free_group_end`` with the group's slots, so a call made while a group
  is open is skipped here and counted when the group closes;
- ``clear()`` of both (``/flush_cache``, start-up): every page at once.

Each takes the process's ``PageImportanceHolder`` (the runtime's) first. Duck-typed over the
allocator; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_importance.importance.page_importance import PageImportanceHolder

if TYPE_CHECKING:
    from sgl_importance.sglang_types.tree import KVAllocator


def pages_released(page_importance: PageImportanceHolder, allocator: KVAllocator, *page_ids: torch.Tensor) -> None:
    """After ``PagedTokenToKVPoolAllocator._release_page_ids(*page_ids)``."""
    table = page_importance.current
    if table is None:
        return
    for ids in page_ids:
        table.reset_pages(ids)


def slots_freed(page_importance: PageImportanceHolder, allocator: KVAllocator, free_index: torch.Tensor) -> None:
    """After ``TokenToKVPoolAllocator.free(free_index)`` (page size 1)."""
    table = page_importance.current
    if table is None or allocator.free_group is not None:
        return
    table.reset_pages(free_index)


def allocator_cleared(page_importance: PageImportanceHolder, allocator: KVAllocator) -> None:
    """After an allocator's ``clear()``."""
    table = page_importance.current
    if table is not None:
        table.reset_all()
