"""How a guarded layer reads the rest pages its selection chose (``guard.layer.guard_layer``'s reader).

The selection chooses pages by a mask over the step's fixed rest list
(``page_lists.GuardLists``), once a layer. How the chosen pages are read, and whether a
released one can be, depends on where the step runs:

- **the Triton backend** (``importance_triton``, a GPU's): the masked-pages kernel reads
  only the chosen pages of the list (``sgl_kernel_ext.masked_page_attention``), without
  the host looking at what was chosen;
- **the CPU backend** (``importance_torch``): its exact reader runs over the same fixed
  table with the unchosen pages' token counts set to 0, which its C kernel skips
  (``read_table``). A released page's entry names its page of the host pool, passed as
  the reader's staging pages without a copy (``host_pages``), so a released page is read
  in the same layer from its host copy: the layer reads what it would with every page on
  the device (the pool and the host copy hold the same values). Only where the host pool
  is SGLang's own (a CUDA platform's, without page views) is it a miss.

The masked-pages kernel reads no host copy: a released page it wants is a miss, promoted
for later steps. No path reads a device value back. ``sgl_kernel_ext.page_parts`` /
``merge_page_parts`` (every page's own part, merged per mask) remain the kernel's torch
reference. Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from sgl_importance.hot_set.plan.page_lists import ExactAttention, GuardLists
from sgl_kernel_ext import masked_page_attention, plan_from_table
from sgl_kernel_ext.masked_pages import HAS_TRITON

Reader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ReadHost = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (layer, host slots) -> K, V


class ExactReads(Protocol):
    """What the guard's reads use of a ``decode.HotSetDecoder`` (which imports this module):
    its exact reader."""

    exact: ExactAttention
    residency: HostPages


class HostPages(Protocol):
    """What the reads use of the residency owner (``residency.Residency``)."""

    def host_pages(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]: ...


def reads_with_kernel(decoder: ExactReads) -> bool:
    """Whether ``decoder`` reads the guard's rounds with the masked-pages kernel: where its
    exact reader is the Triton backend's (tests force it through this)."""
    if not HAS_TRITON:
        return False
    from sgl_kernel_ext import TritonPageListDecode  # exported only where Triton is

    return isinstance(decoder.exact, TritonPageListDecode)


def pages_of(read_host: ReadHost, layer_id: int, k_pages, v_pages, physical, host_index, host_slots):
    """K and V ``[n, C, page_size, Hkv, D]`` of a table of device pages ``physical``
    ``[n, C]``, with the host copies of ``host_index`` (into the flattened table; their
    slots ``host_slots``, read by ``read_host(layer_id, slots)``: ``Residency.read_host``) put in."""
    keys, values = k_pages[physical], v_pages[physical]
    if host_index.numel():
        host_k, host_v = read_host(layer_id, host_slots)
        flat_k, flat_v = keys.view(-1, *keys.shape[2:]), values.view(-1, *values.shape[2:])
        index = host_index.to(keys.device)
        flat_k[index] = host_k.to(keys.device, keys.dtype).view(-1, *keys.shape[2:])
        flat_v[index] = host_v.to(values.device, values.dtype).view(-1, *values.shape[2:])
    return keys, values


def host_pages(decoder: ExactReads, layer_id: int, k_pages: torch.Tensor):
    """The layer's host pool as pages where ``decoder``'s guard reads released pages from it
    (its exact reader, not the masked-pages kernel; a host pool with page views, on the
    KV pool's device and dtype), else None (they stay unread: misses)."""
    if reads_with_kernel(decoder):
        return None
    views = decoder.residency.host_pages(layer_id)
    if views is None or any(v.device != k_pages.device or v.dtype != k_pages.dtype for v in views):
        return None
    return views


def exact_reader(
    decoder: ExactReads, layer_id: int, q, k_pages, v_pages, lists: GuardLists, run: dict, host=None
) -> Reader:
    """The guard's reader for one layer of ``decoder`` (a ``HotSetDecoder``): bool
    ``[n, P]`` chosen rest pages -> their exact ``(lse, output)`` (lse -inf and output 0 for
    a row with none chosen); see the module docstring for which path runs where. ``host``:
    the layer's host pages (``host_pages``), where a chosen page may be a released one."""
    q_rows = q[lists.outside.rows]
    if reads_with_kernel(decoder):
        return lambda chosen: masked_page_attention(q_rows, k_pages, v_pages, lists.physical, chosen, **run)
    table = lists.physical if host is None else lists.host_table
    return lambda chosen: read_table(decoder, q_rows, k_pages, v_pages, table, chosen, run, host)


def read_table(decoder: ExactReads, q_rows, k_pages, v_pages, table, chosen, run: dict, host=None):
    """The ``chosen`` pages of the fixed rest ``table``, read by the decoder's exact reader
    over that table with the unchosen pages' token counts set to 0 (skipped); ids past the
    pool name pages of ``host`` (the layer's host K and V pages)."""
    page_size = k_pages.shape[1]
    plan = plan_from_table(table, torch.where(chosen, page_size, 0), page_size)
    extra = {} if host is None else {"extra_k_pages": host[0], "extra_v_pages": host[1]}
    res = decoder.exact(q_rows, k_pages, v_pages, plan, **run, **extra)
    lse = torch.where(plan.live[:, None], res.lse, float("-inf"))
    return lse, res.output.float()
