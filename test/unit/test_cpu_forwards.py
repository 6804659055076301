"""torch_cpu's C forwards for SGLang's RMSNorm and rotary embedding give what SGLang's own
``forward_native`` gives, on SGLang's real op classes, and keep ``forward_native`` for what
the C ops do not read; plugin.py registers them for torch_cpu processes only."""

from __future__ import annotations

import pkgutil
from types import SimpleNamespace

import pytest
import torch

from sgl_importance import plugin
from sgl_importance.platform.cpu_forwards import rms_norm_forward, rotary_forward
from sgl_kernel_ext import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the forwards fall back")


@pytest.fixture
def rope(monkeypatch):
    # SGLang builds a rotary op against its platform; an out-of-tree one (torch_cpu) takes
    # the torch path and needs no compiled kernel.
    from sglang.srt.layers.rotary_embedding import base

    monkeypatch.setattr(base, "current_platform", SimpleNamespace(is_out_of_tree=lambda: True), raising=False)

    def make(cls=base.RotaryEmbedding, rotary_dim=64, neox=True, dtype=torch.float32):
        return cls(64, rotary_dim, 4096, 10000, neox, dtype)

    return make


@pytest.mark.parametrize("residual", [False, True])
def test_the_norm_forward_gives_what_sglangs_native_forward_gives(residual):
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=torch.Generator().manual_seed(1)))
    x, r = torch.randn(3, 96), torch.randn(3, 96)
    want = norm.forward_native(x.clone(), r.clone() if residual else None)
    got = rms_norm_forward(norm, x, r if residual else None)
    if residual:
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_norm_forward_keeps_sglangs_for_what_the_c_op_does_not_read():
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(32, eps=1e-5)
    x, r, extra = torch.randn(2, 32), torch.randn(2, 32), torch.randn(2, 32)
    want = norm.forward_native(x.clone(), r.clone(), extra)
    got = rms_norm_forward(norm, x, r, extra)  # post_residual_addition: the native path
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    bf16 = norm.to(torch.bfloat16)
    y = torch.randn(2, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm_forward(bf16, y), bf16.forward_native(y))


@pytest.mark.parametrize(("neox", "rotary_dim"), [(True, 64), (False, 64), (True, 32)])
def test_the_rotary_forward_gives_what_sglangs_native_forward_gives(rope, neox, rotary_dim):
    op = rope(rotary_dim=rotary_dim, neox=neox)
    qkv = torch.randn(5, 3 * 64 + 2 * 64)
    q, k, _ = qkv.split([3 * 64, 64, 64], dim=-1)
    positions = torch.tensor([0, 1, 2, 900, 4095])
    want_q, want_k = op.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rotary_forward(op, positions, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_the_rotary_forward_keeps_sglangs_with_offsets(rope):
    op = rope()
    q, k, positions, offsets = torch.randn(2, 128), torch.randn(2, 64), torch.tensor([3, 4]), torch.tensor([1, 1])
    want = op.forward_native(positions, q.clone(), k.clone(), offsets)
    got = rotary_forward(op, positions, q, k, offsets)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_the_forwards_are_registered_for_torch_cpu_only():
    rows = [h for h in plugin.HOOKS if h.kind == "forward"]
    assert {h.process for h in rows} == {"torch_cpu"}
    classes = {pkgutil.resolve_name(h.path).__name__ for h in rows}
    assert {"RMSNorm", "RotaryEmbedding", "Llama3RotaryEmbedding"} <= classes
