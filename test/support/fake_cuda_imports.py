"""Run in a fresh interpreter: import SGLang's serving modules as a CUDA machine would, on the shim.

``python fake_cuda_imports.py`` prints one JSON object: the platform SGLang resolved, the
serving modules that failed to import, the shim names bound in SGLang's modules, and how
each fused op SGLang's Llama uses dispatched. torch is told a CUDA device is there
(``is_available``, an sm_90 capability); nothing runs on it: the fused ops are called on
CPU tensors, and a shim kernel raises if called.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
import types

# The serving path: HTTP server, tokenizer/detokenizer, scheduler, model runner, the Llama
# model and its layers, attention backends, KV and HiCache pools, graph runner, sampler.
SERVING_MODULES = (
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.activation",
    "sglang.srt.layers.rotary_embedding",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.layers.sampler",
    "sglang.srt.layers.dual_gemm",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.distributed.parallel_state",
)


def pretend_cuda() -> None:
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3 (pretended)"
    if torch.version.cuda is None:
        torch.version.cuda = "13.0"


def fused_op_dispatch() -> dict[str, str]:
    """Build and call the fused ops a Llama layer uses; the name of the forward each took."""
    import torch
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope

    torch.manual_seed(0)
    out: dict[str, str] = {}
    norm = RMSNorm(64)
    x = torch.randn(3, 64)
    y = norm(x)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    assert torch.allclose(y, ref, atol=1e-5), "RMSNorm's output differs from the formula"
    residual = torch.randn(3, 64)
    norm(x, residual)
    out["RMSNorm"] = norm._forward_method.__name__
    act = SiluAndMul()
    g = torch.randn(3, 128)
    assert torch.allclose(act(g), torch.nn.functional.silu(g[:, :64]) * g[:, 64:], atol=1e-6)
    out["SiluAndMul"] = act._forward_method.__name__
    rope = get_rope(64, rotary_dim=64, max_position=128, base=10000, is_neox_style=True)
    q, k = torch.randn(3, 2 * 64), torch.randn(3, 64)
    rope(torch.arange(3), q, k)
    out["RotaryEmbedding"] = rope._forward_method.__name__
    return out


def main() -> None:
    os.environ["SGLANG_PLATFORM"] = "torch_cuda"
    pretend_cuda()
    report: dict[str, object] = {"failed": {}}
    import sgl_kernel

    report["sgl_kernel_file"] = sgl_kernel.__file__
    report["is_shim"] = bool(getattr(sgl_kernel, "IS_SGL_IMPORTANCE_SHIM", False))
    for name in SERVING_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # reported, and the test names the module
            report["failed"][name] = "".join(traceback.format_exception(e)[-3:])
    from sglang.srt.platforms import current_platform

    report["platform"] = type(current_platform).__name__
    report["out_of_tree"] = current_platform.is_out_of_tree()
    bound: dict[str, list[str]] = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("sglang.") or module is None:
            continue
        for value in list(vars(module).values()):
            # Plain functions only: getattr on SGLang's LazyImport objects would import them.
            if not isinstance(value, types.FunctionType):
                continue
            if getattr(value, "is_shim_kernel", False) or value.__module__ == "sgl_kernel.utils":
                bound.setdefault(value.__module__, [])
                if value.__name__ not in bound[value.__module__]:
                    bound[value.__module__].append(value.__name__)
    report["bound"] = {k: sorted(v) for k, v in bound.items()}
    try:
        report["dispatch"] = fused_op_dispatch()
    except Exception as e:
        report["dispatch_error"] = "".join(traceback.format_exception(e)[-4:])
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
