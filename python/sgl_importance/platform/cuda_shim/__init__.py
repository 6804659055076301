"""A stand-in ``sgl_kernel`` for the ``torch_cuda`` platform.

On a CUDA machine SGLang imports a few names from ``sgl_kernel`` (the
``sglang-kernel`` wheel, 373 MB of compiled kernels) at module load, even where
an out-of-tree platform then runs the torch-native form of every op. This
folder holds a package named ``sgl_kernel`` that provides exactly those names
(``sgl_kernel/names.py``); each raises a clear error if it is ever called.
Put the folder on ``PYTHONPATH`` (``python -m sgl_importance.platform.cuda_shim``
prints it; ``make serve PLATFORM=torch_cuda`` does it) only where the real
``sgl_kernel`` is not installed.
"""

from __future__ import annotations

from pathlib import Path


def shim_dir() -> Path:
    """The folder to put on ``PYTHONPATH`` so that ``import sgl_kernel`` finds the shim."""
    return Path(__file__).resolve().parent


def is_shim(module: object) -> bool:
    """Whether an imported ``sgl_kernel`` module is this shim rather than the real package."""
    return bool(getattr(module, "IS_SGL_IMPORTANCE_SHIM", False))
