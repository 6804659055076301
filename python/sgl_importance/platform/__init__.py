"""Out-of-tree SGLang platforms shipped with the plugin.

SGLang calls ``activate`` through the ``sglang.srt.platforms`` entry points
(``torch_cpu`` and ``torch_cuda``). It returns a platform's class path only when
the user asked for it by name (``SGLANG_PLATFORM=torch_cpu``), so installing the
plugin never takes a GPU machine away from SGLang's own CUDA platform.
"""

from __future__ import annotations

import os

from sgl_importance.env import PLATFORM_ENV

PLATFORM_NAME = "torch_cpu"
CUDA_PLATFORM_NAME = "torch_cuda"
# Both run SGLang's torch-native ops with no compiled SGLang kernels.
NATIVE_PLATFORMS = (PLATFORM_NAME, CUDA_PLATFORM_NAME)
# Both platforms' key for SGLang's fused-op dispatch: forward_native, unless a forward is
# registered under it (torch_cpu's C RMSNorm and rotary, plugin.py).
DISPATCH_KEY = "native"
# torch_cpu's forwards for SGLang's fused ops (platform/cpu_forwards.py; plugin.py registers
# them): the op class under sglang.srt.layers, our function. The rotary variants listed share
# the base class's forward (test_sglang_contract checks each against SGLang).
ROTARY_CLASSES = ("base.RotaryEmbedding", "base.LinearScalingRotaryEmbedding", "rope_variant.Llama3RotaryEmbedding")
CPU_FORWARDS = (
    ("layernorm.RMSNorm", "rms_norm_forward"),
    *((f"rotary_embedding.{cls}", "rotary_forward") for cls in ROTARY_CLASSES),
)

# torch_cpu's around hooks on SGLang's matmuls (platform/cpu_forwards.py, plugin.py's kind
# ``inline``): a decode step's float32 rows in one C call, SGLang's code otherwise.
# Only inside a decode forward (``decode_forward``): an extend's few rows take the matmul a whole
# prompt's rows take, so a prefix read back from a tier answers as computed, to the last bit.
CPU_MATMULS = (
    ("layers.quantization.unquant.UnquantizedLinearMethod.apply", "linear_apply"),
    ("layers.logits_processor.LogitsProcessor._compute_lm_head", "lm_head_logits"),
    ("model_executor.runner.eager_runner.EagerRunner._execute_decode", "decode_forward"),
)
# Each op's target under sglang.srt, our function, its plugin.py kind.
CPU_OPS = (*((f"layers.{op}", fn, "forward") for op, fn in CPU_FORWARDS), *((t, fn, "inline") for t, fn in CPU_MATMULS))


def activate() -> str | None:
    name = os.environ.get(PLATFORM_ENV)
    if name == PLATFORM_NAME:
        return "sgl_importance.platform.torch_cpu.TorchCpuPlatform"
    if name == CUDA_PLATFORM_NAME:
        import torch

        if not torch.cuda.is_available():
            # SGLang turns None into "activate() returned None (hardware not available?)".
            return None
        return "sgl_importance.platform.torch_cuda.TorchCudaPlatform"
    return None
