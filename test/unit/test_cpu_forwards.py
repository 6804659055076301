"""torch_cpu's C forwards for SGLang's RMSNorm and rotary embedding give what SGLang's own
``forward_native`` gives, on SGLang's real op classes, and keep ``forward_native`` for what
the C ops do not read; its C linear and LM head give what SGLang's own ``apply`` and
``_compute_lm_head`` give and hand SGLang what they do not take; plugin.py registers them
for torch_cpu processes only."""

from __future__ import annotations

import pkgutil
from types import SimpleNamespace

import pytest
import torch

from sgl_importance import plugin, runtime
from sgl_importance.platform.cpu_forwards import (
    decode_forward,
    linear_apply,
    lm_head_logits,
    rms_norm_forward,
    rotary_forward,
)
from sgl_kernel_ext import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the forwards fall back")


@pytest.fixture(autouse=True)
def in_a_decode_forward():
    """The matmuls take the C kernel inside a decode forward only (``decode_forward``): the
    tests below run as inside one, but the test of the flag itself."""
    runtime.reset()
    runtime.current().decode_forward = True
    yield
    runtime.reset()


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
    inline = [h for h in plugin.HOOKS if h.kind == "inline"]
    assert {h.process for h in inline} == {"torch_cpu"}
    assert {".".join(h.path.split(".")[-2:]) for h in inline} == {
        "UnquantizedLinearMethod.apply",
        "LogitsProcessor._compute_lm_head",
        "EagerRunner._execute_decode",
    }


def test_outside_a_decode_forward_the_matmuls_are_sglangs_and_the_flag_never_outlives_one():
    # An extend's few rows (a prefix read back from a tier leaves its last page to compute)
    # take SGLang's matmul, as those rows did in the whole prompt's prefill.
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    method, layer = UnquantizedLinearMethod(), weighted(8, 16)
    original = Calls(UnquantizedLinearMethod.apply)
    runtime.current().decode_forward = False
    linear_apply(original, method, layer, torch.randn(2, 16))
    assert original.count == 1
    seen = []

    def execute(runner, batch, *, fail=False):
        seen.append(runtime.current().decode_forward)
        linear_apply(original, method, layer, torch.randn(2, 16))
        if fail:
            raise RuntimeError("the forward failed")
        return batch

    assert decode_forward(execute, object(), "batch") == "batch"
    with pytest.raises(RuntimeError):
        decode_forward(execute, object(), "batch", fail=True)
    assert seen == [True, True] and original.count == 1  # inside: the C kernel's
    assert runtime.current().decode_forward is False


class Calls:
    """SGLang's own function, counting the calls that reach it."""

    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.fn(*args, **kwargs)


def weighted(out_features, in_features, dtype=torch.float32, seed=0):
    layer = torch.nn.Module()
    g = torch.Generator().manual_seed(seed)
    layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=g).to(dtype), False)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_the_linear_gives_what_sglangs_unquantized_apply_gives(bias):
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    method, layer = UnquantizedLinearMethod(), weighted(48, 64)
    b = torch.randn(48) if bias else None
    original = Calls(UnquantizedLinearMethod.apply)
    x = torch.randn(3, 64)
    got = linear_apply(original, method, layer, x, b)
    torch.testing.assert_close(got, UnquantizedLinearMethod.apply(method, layer, x, b), rtol=1e-5, atol=1e-5)
    assert original.count == 0  # the C kernel's


def test_the_linear_hands_sglang_a_prefill_another_dtype_and_a_packed_weight():
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from sgl_kernel_ext.linear import ROWS_MAX

    method, layer = UnquantizedLinearMethod(), weighted(8, 16)
    original = Calls(UnquantizedLinearMethod.apply)
    for x in (torch.randn(ROWS_MAX + 1, 16), torch.randn(2, 3, 16)):
        want = UnquantizedLinearMethod.apply(method, layer, x)
        torch.testing.assert_close(linear_apply(original, method, layer, x), want)
    bf16 = weighted(8, 16, torch.bfloat16)
    linear_apply(original, method, bf16, torch.randn(2, 16, dtype=torch.bfloat16))
    layer.use_intel_amx_backend = True  # SGLang packed the weight for its AMX kernel: never read as rows
    with pytest.raises(Exception):  # noqa: B017 (no sgl_kernel here: SGLang's own path is what ran)
        linear_apply(original, method, layer, torch.randn(2, 16))
    assert original.count == 4


def head_processor(**options):
    # What _compute_lm_head reads of its LogitsProcessor (SGLang's defaults), as attributes.
    base = {"use_fp32_lm_head": False, "use_fp32_lm_head_output": False, "rl_on_policy_target": None}
    return SimpleNamespace(**{**base, **options})


@pytest.mark.parametrize("into_out", [False, True])
def test_the_lm_head_gives_what_sglangs_compute_lm_head_gives(into_out):
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    head = weighted(300, 32, seed=2)
    head.quant_method = UnquantizedEmbeddingMethod()
    hidden, processor = torch.randn(4, 32), head_processor()
    original = Calls(LogitsProcessor._compute_lm_head)
    out = torch.empty(4, 300) if into_out else None
    got = lm_head_logits(original, processor, hidden, head, out=out)
    want = LogitsProcessor._compute_lm_head(processor, hidden, head)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert original.count == 0 and (got is out) == into_out


def test_the_lm_head_leaves_sglang_its_options_a_bias_and_lora():
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    head = weighted(50, 16, seed=3)
    head.quant_method = UnquantizedEmbeddingMethod()
    hidden = torch.randn(2, 16)
    original = Calls(LogitsProcessor._compute_lm_head)
    for processor, bias in (
        (head_processor(use_fp32_lm_head=True), None),
        (head_processor(rl_on_policy_target="fsdp"), None),
        (head_processor(), torch.randn(50)),
    ):
        got = lm_head_logits(original, processor, hidden, head, bias)
        torch.testing.assert_close(got, LogitsProcessor._compute_lm_head(processor, hidden, head, bias))
    lora = weighted(50, 16, seed=3)
    lora.quant_method, lora.set_lora = head.quant_method, None
    lm_head_logits(original, head_processor(), hidden, lora)
    assert original.count == 4
