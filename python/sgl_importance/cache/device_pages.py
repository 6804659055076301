"""A radix node's device pages, worked out in one place.

A node's KV on the device is its FULL component's value: token slots in sequence
order, page-aligned, so every ``page_size``-th slot names one physical page
(``slot // page_size``, the page importance table's index). The ids are kept on the
node's ``NodeState.pages`` until SGLang replaces the value tensor (a split, a
load-back), so the fold after every batch does not recompute them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sgl_importance.node_state import node_state

if TYPE_CHECKING:
    from sgl_importance.sglang_types.tree import TreeNode

_FULL = int(ComponentType.FULL)


def device_value(node: TreeNode) -> Optional[torch.Tensor]:
    """The node's device token slots, None when it holds none (evicted, or the root)."""
    data = getattr(node, "component_data", None)
    if not data:
        return None
    entry = data[_FULL]  # a list indexed by component type
    value = None if entry is None else entry.value
    return None if value is None or value.numel() == 0 else value


def device_pages(node: TreeNode, page_size: int) -> Optional[torch.Tensor]:
    """The node's physical page ids (int64, in sequence order), None without device KV."""
    value = device_value(node)
    if value is None:
        return None
    state = node_state(node)
    cached = state.pages
    if cached is not None and cached[0] is value:
        return cached[1]
    pages = torch.div(value[::page_size], page_size, rounding_mode="floor").to(torch.int64)
    state.pages = (value, pages)
    return pages
