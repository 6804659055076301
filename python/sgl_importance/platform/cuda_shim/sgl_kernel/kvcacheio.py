"""sgl-importance's stand-in for ``sgl_kernel.kvcacheio``: names only, each refuses to run."""

from .names import KERNELS
from .refuse import export

export(globals(), "sgl_kernel.kvcacheio", KERNELS["sgl_kernel.kvcacheio"])
