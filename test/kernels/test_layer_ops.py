"""The C layer ops (sgl_kernel_ext.layer_ops) against torch written out here: RMSNorm with
and without the residual add, rotary embedding in both pairings and a partial rotary
dimension, the KV write; each on rows that are views of a wider tensor (a fused QKV
output), and each refusing what it does not read without writing anything."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_ext import native
from sgl_kernel_ext.layer_ops import rms_norm, rotary, store_kv

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the ops return None")


def norm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight, x


def rotary_reference(positions, x, cos_sin, head_size, rotary_dim, neox):
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    x = x.view(x.shape[0], -1, head_size).clone()
    rot = x[..., :rotary_dim]
    cos, sin = cos[:, None], sin[:, None]
    if neox:
        a, b = rot.chunk(2, dim=-1)
        x[..., :rotary_dim] = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        x[..., :rotary_dim] = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return x.flatten(1)


@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_without_a_residual_returns_a_fresh_output(rows):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 100, generator=g)
    x = wide[:, 10:74]  # rows 100 floats apart
    weight = torch.randn(64, generator=g)
    before = x.clone()
    out, residual = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, norm_reference(before, weight, 1e-5)[0], rtol=1e-5, atol=1e-6)
    assert residual is None and torch.equal(x, before)


@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_with_a_residual_adds_first_and_writes_both_in_place(rows):
    g = torch.Generator().manual_seed(10 + rows)
    x, residual, weight = torch.randn(rows, 48, generator=g), torch.randn(rows, 48, generator=g), torch.randn(48)
    want, want_sum = norm_reference(x, weight, 1e-6, residual)
    out, summed = rms_norm(x, weight, 1e-6, residual)
    assert out is x and summed is residual
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)


def test_rms_norm_leaves_what_it_does_not_read_to_torch():
    x = torch.randn(2, 16)
    assert rms_norm(x.bfloat16(), torch.ones(16, dtype=torch.bfloat16), 1e-6) is None
    assert rms_norm(x, torch.ones(8), 1e-6) is None  # weight of another width
    assert rms_norm(x.t(), torch.ones(2), 1e-6) is None  # columns, not rows
    assert rms_norm(x, torch.ones(16), 1e-6, torch.randn(3, 16)) is None


@pytest.mark.parametrize(("neox", "rotary_dim"), [(True, 32), (False, 32), (True, 16), (False, 8)])
def test_rotary_rotates_views_of_a_fused_qkv_in_place(neox, rotary_dim):
    g = torch.Generator().manual_seed(rotary_dim + neox)
    tokens, head, q_heads, k_heads = 4, 32, 3, 1
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head, generator=g)
    q, k, v = qkv.split([q_heads * head, k_heads * head, k_heads * head], dim=-1)
    cos_sin = torch.randn(50, rotary_dim, generator=g)
    positions = torch.tensor([0, 7, 49, 7])
    want_q, want_k = (rotary_reference(positions, t, cos_sin, head, rotary_dim, neox) for t in (q, k))
    v_before = v.clone()
    assert rotary(positions, q, k, cos_sin, head, rotary_dim, neox)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(v, v_before)


def test_rotary_refuses_a_position_past_the_cache_and_writes_nothing():
    q, k = torch.randn(2, 64), torch.randn(2, 64)
    before = q.clone(), k.clone()
    with pytest.raises(IndexError, match="outside the cache"):
        rotary(torch.tensor([1, 10]), q, k, torch.randn(10, 64), 64, 64, True)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    assert not rotary(torch.tensor([1, 2], dtype=torch.int32), q, k, torch.randn(10, 64), 64, 64, True)
    assert not rotary(torch.tensor([1, 2]), q, k, torch.randn(10, 63), 64, 63, True)  # odd rotary width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_each_row_to_its_slot_as_indexing_does(dtype):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, 5 * 2 * 8, generator=g).to(dtype)
    _, k, v = qkv.split([3 * 2 * 8, 2 * 8, 2 * 8], dim=-1)
    k, v = k.view(3, 2, 8), v.view(3, 2, 8)
    k_pool, v_pool = torch.zeros(20, 2, 8, dtype=dtype), torch.zeros(20, 2, 8, dtype=dtype)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    loc = torch.tensor([19, 0, 4])
    want_k[loc], want_v[loc] = k, v
    assert store_kv(k, v, k_pool, v_pool, loc)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


def test_store_kv_refuses_a_slot_past_the_pool_and_other_layouts():
    k = v = torch.randn(2, 2, 8)
    k_pool, v_pool = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    with pytest.raises(IndexError, match="outside the pool"):
        store_kv(k, v, k_pool, v_pool, torch.tensor([1, 4]))
    assert not k_pool.any() and not v_pool.any()
    assert not store_kv(k.bfloat16(), v, k_pool, v_pool, torch.tensor([1, 2]))  # dtypes differ
    assert not store_kv(k, v, k_pool, v_pool, torch.tensor([1, 2], dtype=torch.int32))
    assert not store_kv(k.transpose(1, 2), v, k_pool, v_pool, torch.tensor([1, 2]))
