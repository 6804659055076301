"""The captured step's page tally (``sgl_kernel_ext.page_tally``): the Triton kernel against the
torch path, and the torch path against the quantities it stands for (the eager step's masses and
``key_ranges.key_bound``). Small shapes under TRITON_INTERPRET=1 on a CPU (conftest.py), compiled
on a GPU (the Triton case's tensors on ``DEVICE``, read back to compare)."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_importance.hot_set.guard.key_ranges import key_bound
from sgl_kernel_ext.page_tally import BOUND, MAX, SUM, tally_pages
from support.kernel_device import DEVICE

pytest.importorskip("triton", reason="triton is not installed")

PAGE, KV, GROUP, DIM = 4, 2, 3, 16


def case(seed: int, bs=3, pages=10, ids_max=12, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    per_kv = torch.rand(bs, pages, KV, generator=g)
    q = (torch.randn(bs, KV * GROUP, DIM, generator=g) * 2).to(dtype)
    lse = torch.randn(bs, KV * GROUP, generator=g) + 3
    low = torch.randn(ids_max + 1, KV, DIM, generator=g)
    key_min, key_max = (low - 0.5).to(dtype), (low + torch.rand(ids_max + 1, KV, DIM, generator=g)).to(dtype)
    key_min[0], key_max[0] = float("inf"), float("-inf")  # the padding range: bounds nothing
    ids = torch.randint(0, ids_max + 1, (bs, pages), generator=g)
    ids[:, -2:] = 0
    return per_kv, q, lse, key_min, key_max, ids


def on(tensors, device):
    return [None if t is None else t.to(device) for t in tensors]


def fresh(bs, pages, device="cpu"):
    tally = torch.zeros(3, bs + 1, pages, device=device)
    tally[BOUND].fill_(float("-inf"))
    return tally


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pages", [10, 300], ids=["one-block", "three-blocks"])
def test_the_triton_tally_equals_the_torch_path_over_several_layers(seed, logit_cap, dtype, pages):
    bs = 3
    tallies = [fresh(bs, pages), fresh(bs, pages, DEVICE)]
    for layer in range(3):
        args = case(seed * 10 + layer, bs, pages, dtype=dtype)
        for tally, triton in zip(tallies, (False, True)):
            run = dict(sm_scale=DIM**-0.5, logit_cap=logit_cap, page_size=PAGE, use_triton=triton)
            tally_pages(*on(args, tally.device), tally, **run)
    torch_tally, triton_tally = tallies[0], tallies[1].cpu()
    assert torch.allclose(triton_tally[:2], torch_tally[:2], atol=1e-6)
    finite = torch.isfinite(torch_tally[BOUND])
    assert torch.equal(finite, torch.isfinite(triton_tally[BOUND]))
    assert torch.allclose(triton_tally[BOUND][finite], torch_tally[BOUND][finite], atol=1e-4)
    assert not finite[:, -2:].any() and finite[:bs, :-2].any()  # no range, no bound
    assert (triton_tally[:, bs] == fresh(bs, pages)[:, bs]).all()  # a row past the batch is untouched


def test_the_tally_is_the_eager_steps_masses_and_the_key_bound():
    per_kv, q, lse, key_min, key_max, ids = case(7)
    tally = fresh(3, 10)
    tally_pages(per_kv, q, lse, key_min, key_max, ids, tally, sm_scale=0.25, page_size=PAGE)
    assert torch.allclose(tally[SUM, :3], per_kv.mean(-1)) and torch.allclose(tally[MAX, :3], per_kv.amax(-1))
    b, p = 1, 0
    if ids[b, p] == 0:
        ids[b, p] = 3
        tally = fresh(3, 10)
        tally_pages(per_kv, q, lse, key_min, key_max, ids, tally, sm_scale=0.25, page_size=PAGE)
    i = ids[b, p]
    bound = key_bound(q[b], key_min[i][None], key_max[i][None], sm_scale=0.25)[0]  # [Hq]
    assert math.isclose(float(tally[BOUND, b, p]), float((bound + math.log(PAGE) - lse[b]).max()), rel_tol=1e-5)


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_without_range_ids_the_masses_are_tallied_and_no_page_is_bounded(triton):
    # A step whose rows rank nothing by key bounds passes no ids: its bound row stays as it was.
    per_kv, q, lse, key_min, key_max, ids = case(3)
    device = DEVICE if triton else "cpu"
    tally = fresh(3, 10, device)
    args = on((per_kv, q, lse, key_min, key_max, None), device)
    tally_pages(*args, tally, sm_scale=0.25, page_size=PAGE, use_triton=triton)
    tally = tally.cpu()
    assert torch.allclose(tally[SUM, :3], per_kv.mean(-1)) and torch.allclose(tally[MAX, :3], per_kv.amax(-1))
    assert torch.equal(tally[BOUND], fresh(3, 10)[BOUND])


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_a_page_with_range_id_0_is_bounded_by_nothing_whatever_row_0_holds(triton):
    # Over a pool's K and V (the eager step's ranges), row 0 is SGLang's padding slot, finite.
    per_kv, q, lse, key_min, key_max, ids = case(4)
    key_min[0], key_max[0] = -1.0, 1.0
    device = DEVICE if triton else "cpu"
    tally = fresh(3, 10, device)
    args = on((per_kv, q, lse, key_min, key_max, ids), device)
    tally_pages(*args, tally, sm_scale=0.25, page_size=PAGE, use_triton=triton)
    tally = tally.cpu()
    assert torch.isneginf(tally[BOUND, :3][ids == 0]).all() and torch.isfinite(tally[BOUND, :3][ids > 0]).all()
