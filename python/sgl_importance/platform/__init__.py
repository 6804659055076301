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
