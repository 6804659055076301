"""SGLang's Triton extend kernel over prefixes staged from the host pool gives what it gives
over the device-resident prefixes (``attention/released_prefix.py``).

A batch of three requests, one without a prefix, two with prefixes scattered over the pool;
some of their pages are "released": their values live only in a host tensor, their pool slots
are overwritten (reused by another request) and their positions show the released slot, as
``Residency`` leaves them. The staged buffers must hold the prefix the device held, and
``extend_attention_fwd`` over them (densely packed) must write what it writes over the pool.

Runs under TRITON_INTERPRET=1 on a CPU (conftest.py), small shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="SGLang's extend kernel is Triton")
extend_attention = pytest.importorskip("sglang.kernels.ops.attention.extend_attention")

from sgl_importance.attention.released_prefix import ReleasedPrefixes  # noqa: E402
from sgl_importance.hot_set.pages.state import RELEASED_SLOT, page_offsets  # noqa: E402
from support.kernel_device import DEVICE  # noqa: E402

PAGE = 8
KV_HEADS, Q_HEADS, DIM = 2, 4, 16
SLOTS = 512


def extend(q, k_new, v_new, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, max_new, **kw) -> torch.Tensor:
    o = torch.empty_like(q)
    extend_attention.extend_attention_fwd(
        q, k_new, v_new, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
        None, True, None, max_new, 1.0, 1.0, DIM**-0.5, **kw,
    )  # fmt: skip
    return o


@pytest.mark.parametrize("released_pages", [[], [0, 2, 3]])
def test_the_extend_over_staged_prefixes_writes_what_it_writes_over_the_device(released_pages):
    g = torch.Generator().manual_seed(3)
    prefix_lens, new_lens = [40, 0, 70], [16, 20, 9]
    k_buffer = torch.randn(SLOTS, KV_HEADS, DIM, generator=g).to(DEVICE)
    v_buffer = torch.randn(SLOTS, KV_HEADS, DIM, generator=g).to(DEVICE)
    # Each prefix in whole pages at scattered places of the pool (slot 0 left out: the released slot).
    pages = (torch.randperm(SLOTS // PAGE - 1, generator=g) + 1)[: sum(-(-n // PAGE) for n in prefix_lens)]
    rows, used = [], 0
    for n in prefix_lens:
        own = pages[used : used + -(-n // PAGE)]
        used += own.numel()
        rows.append(page_offsets(own, PAGE)[:n])
    kv_indices = torch.cat(rows).to(DEVICE)
    kv_indptr = torch.tensor([0, *torch.tensor(prefix_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    qo_indptr = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(new_lens), Q_HEADS, DIM, generator=g).to(DEVICE)
    k_new = torch.randn(sum(new_lens), KV_HEADS, DIM, generator=g).to(DEVICE)
    v_new = torch.randn(sum(new_lens), KV_HEADS, DIM, generator=g).to(DEVICE)
    args = (qo_indptr, kv_indptr)
    want = extend(q, k_new, v_new, k_buffer, v_buffer, *args, kv_indices, max(new_lens))

    # The host pool: the released pages' values at host slots of their own.
    host_k, host_v = torch.zeros(64, KV_HEADS, DIM), torch.zeros(64, KV_HEADS, DIM)
    released, next_host = [], 0
    for i, row in enumerate(rows):
        logical = torch.tensor([p for p in released_pages if (p + 1) * PAGE <= prefix_lens[i]], dtype=torch.int64)
        if logical.numel() == 0:
            released.append(None)
            continue
        positions = page_offsets(logical, PAGE)
        host_slots = torch.arange(next_host, next_host + positions.numel())
        next_host += positions.numel()
        slots = row[positions]
        host_k[host_slots], host_v[host_slots] = k_buffer[slots].cpu(), v_buffer[slots].cpu()
        k_buffer[slots], v_buffer[slots] = 99.0, -99.0  # the freed slots, written by another request
        kv_indices[int(kv_indptr[i]) + positions.to(DEVICE)] = RELEASED_SLOT
        released.append((positions, host_slots))

    layout = dict(kv_heads=KV_HEADS, head_dim=DIM, v_head_dim=DIM, dtype=k_buffer.dtype, device=DEVICE)
    staged = ReleasedPrefixes(released, prefix_lens, kv_indices, **layout)
    read = []
    stage_k, stage_v = staged.layer(k_buffer, v_buffer, lambda s: read.append(s.clone()) or (host_k[s], host_v[s]))
    assert stage_k.shape[0] == sum(prefix_lens) and staged.nbytes == 2 * sum(prefix_lens) * KV_HEADS * DIM * 4
    assert len(read) == (1 if released_pages else 0)
    got = extend(q, k_new, v_new, stage_k, stage_v, *args, kv_indices, max(new_lens), identity_kv_indices=True)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    if released_pages:
        # Read over the pool as it stands now, the released positions give another output.
        wrong = extend(q, k_new, v_new, k_buffer, v_buffer, *args, kv_indices, max(new_lens))
        assert not torch.allclose(wrong, want, atol=1e-3)
