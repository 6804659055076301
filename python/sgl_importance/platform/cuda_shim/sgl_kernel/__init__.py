"""sgl-importance's stand-in for ``sgl_kernel`` (see ``sgl_importance/platform/cuda_shim``)."""

from .names import KERNELS
from .refuse import export

IS_SGL_IMPORTANCE_SHIM = True
__version__ = "0.0.0+sgl-importance-shim"

export(globals(), "sgl_kernel", KERNELS["sgl_kernel"])
