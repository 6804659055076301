"""sgl-importance's stand-in for ``sgl_kernel.quantization``: names only, each refuses to run."""

from .names import KERNELS
from .refuse import export

export(globals(), "sgl_kernel.quantization", KERNELS["sgl_kernel.quantization"])
