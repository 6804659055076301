"""Where the kernel tests run the Triton kernels, and the warning every test module
that reads empty pages silences.

``TRITON_INTERPRET`` is set before this is imported (``test/kernels/conftest.py``):
under the interpreter the kernels run on CPU tensors; compiled, on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def launching_class() -> type:
    """The Triton class whose ``run(*args, grid, warmup, **kw)`` launches a kernel here: the
    interpreter's function under TRITON_INTERPRET, the JIT function compiled (on a GPU). The
    tests that count or record launches wrap its ``run``."""
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction


# Empty pages have log-sum-exp log2(0) = -inf by design; numpy warns about it.
EMPTY_PAGES_WARN = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
