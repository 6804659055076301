"""The decode-write summary kernel (``sgl_kernel_ext.page_summaries``) against the torch path.

``PageSummaries.update`` (torch scatter-reduces) is the reference: after the same decode
write, the kernel's key min/max must be equal element for element. Runs under
TRITON_INTERPRET=1 on a CPU (conftest.py) in small shapes; compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from sgl_importance.hot_set import PageSummaries
from sgl_kernel_ext.page_summaries import HAS_TRITON, summarise_decode_keys
from support.kernel_device import DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")

LAYERS, PAGES, KV, D, PS = 2, 12, 2, 24, 4  # D not a power of two: the kernel masks its tail


def written_summaries(g: torch.Generator, key_dtype: torch.dtype) -> tuple[PageSummaries, PageSummaries, torch.Tensor]:
    """Two equal summaries over a pool whose pages 1.. hold keys, and the pool."""
    pool = (torch.randn(PAGES * PS, KV, D, generator=g) * 3).to(key_dtype).to(DEVICE)
    pair = [PageSummaries(LAYERS, PAGES, KV, D, page_size=PS, device=DEVICE) for _ in range(2)]
    for s in pair:
        for layer in range(LAYERS):
            slots = torch.arange(PS, (PAGES - 2) * PS, device=DEVICE)  # the last two pages left empty
            s.update(layer, slots, pool[slots])
    return pair[0], pair[1], pool


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_a_decode_write_summarised_in_one_launch_equals_the_torch_path(key_dtype, slot_dtype):
    g = torch.Generator().manual_seed(7)
    want, got, pool = written_summaries(g, key_dtype)
    # One token per request, each in its own page: mid-page (merges), a page's first slot
    # (starts afresh), and a page never written (its +inf/-inf initial summary).
    slots = torch.tensor([2 * PS + 1, 5 * PS, 7 * PS + 3, (PAGES - 1) * PS + 2, 3 * PS + 2], dtype=slot_dtype)
    slots = slots.to(DEVICE)
    pool[slots.long()] = (torch.randn(slots.numel(), KV, D, generator=g) * 5).to(key_dtype).to(DEVICE)
    layer = 1
    want.update(layer, slots, pool[slots.long()])
    summarise_decode_keys(pool, slots, got.key_min[layer], got.key_max[layer], PS)
    assert torch.equal(got.key_min, want.key_min)
    assert torch.equal(got.key_max, want.key_max)
    # The written pages changed (the test is not vacuous): a first slot resets its page.
    page = 5
    assert torch.equal(got.key_min[layer, page], pool[5 * PS].float())


def test_page_summaries_send_decode_writes_through_the_kernel_when_told():
    g = torch.Generator().manual_seed(3)
    want, got, pool = written_summaries(g, torch.float32)
    got.decode_kernel = True
    slots = torch.tensor([4 * PS + 2, 9 * PS], device=DEVICE)
    pool[slots] = torch.randn(2, KV, D, generator=g).to(DEVICE)
    want.update(0, slots, pool[slots])
    got.update_decode(0, slots, pool)
    assert torch.equal(got.key_min, want.key_min) and torch.equal(got.key_max, want.key_max)


def test_the_kernel_refuses_a_pool_of_another_shape():
    s = PageSummaries(1, PAGES, KV, D, page_size=PS, device=DEVICE)
    pool = torch.zeros(PAGES * PS, KV + 1, D, device=DEVICE)
    with pytest.raises(ValueError, match="shapes disagree"):
        summarise_decode_keys(pool, torch.tensor([5], device=DEVICE), s.key_min[0], s.key_max[0], PS)
