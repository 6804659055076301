"""Kernel tests run under Triton's interpreter unless told otherwise.

TRITON_INTERPRET is read when triton is imported, so it is set here, at conftest
import, before any test module imports triton. On a GPU machine run with
TRITON_INTERPRET=0 to compile the same tests for the device.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

# Let the tests import the package from the source tree without an install.
_SRC = Path(__file__).resolve().parents[2] / "sgl-kernel-ext"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))
