"""Out-of-tree SGLang platforms shipped with the plugin.

SGLang calls ``activate`` through the ``sglang.srt.platforms`` entry point. It
returns the platform's class path only when the user asked for it by name
(``SGLANG_PLATFORM=torch_cpu``), so installing the plugin never takes a GPU
machine away from SGLang's own CUDA platform.
"""

from __future__ import annotations

import os

from sgl_importance.env import PLATFORM_ENV

PLATFORM_NAME = "torch_cpu"


def activate() -> str | None:
    if os.environ.get(PLATFORM_ENV) != PLATFORM_NAME:
        return None
    return "sgl_importance.platform.torch_cpu.TorchCpuPlatform"
