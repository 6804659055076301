"""Kernel tests run under Triton's interpreter unless told otherwise.

TRITON_INTERPRET is read when triton is imported, so it is set here, at conftest
import, before any test module imports triton. On a GPU machine run with
TRITON_INTERPRET=0 to compile the same tests for the device. ``sgl_kernel_ext`` is
imported as installed (``make install``); on a machine where nothing is installed
put the source tree on the path: ``PYTHONPATH=sgl-kernel-ext pytest test/kernels``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
