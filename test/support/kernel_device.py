"""Where the kernel tests run the Triton kernels, and the warning every test module
that reads empty pages silences.

``TRITON_INTERPRET`` is set before this is imported (``test/kernels/conftest.py``):
under the interpreter the kernels run on CPU tensors; compiled, on the GPU.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


@contextmanager
def launches_wrapped(around: Callable[[Callable, Any, tuple, dict], Any]) -> Iterator[None]:
    """Each Triton launch (not a warm-up) made through ``around(run, kernel, args, kwargs)``,
    which calls ``run(kernel, *args, **kwargs)`` to launch it: the ``run`` of the class that
    launches here, the interpreter's function under TRITON_INTERPRET, the JIT function
    compiled (on a GPU). Without Triton nothing launches and nothing is wrapped."""
    try:
        if INTERPRET:
            from triton.runtime.interpreter import InterpretedFunction as launching
        else:
            from triton.runtime.jit import JITFunction as launching
    except ImportError:
        yield
        return
    run = launching.run

    def wrapped(kernel: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("warmup"):
            return run(kernel, *args, **kwargs)
        return around(run, kernel, args, kwargs)

    launching.run = wrapped
    try:
        yield
    finally:
        launching.run = run


# Empty pages have log-sum-exp log2(0) = -inf by design; numpy warns about it.
EMPTY_PAGES_WARN = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
