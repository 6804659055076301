"""A CUDA graph's capture and replay, emulated on any machine, to prove a step can be captured.

A captured graph replays the kernels it recorded, on the tensors it recorded, with the
Python values it saw: no Python runs at replay. :class:`Recording` is a
``TorchDispatchMode`` that records every aten call of a region (the function, its
arguments with tensors by identity, its outputs). :meth:`Recording.replay` runs the
list again without the region's Python: a tensor made outside the region (a static
buffer, a pool, an input the caller rewrote in place) is read where it is, now; one
made inside is the replay's own result of the op that made it. So a region that reads
its plan from Python (a width, a branch, a list) replays the captured plan, and its
results part from an eager run's: what a real graph would do.

:func:`signature` is the region's op trace: names, shapes, strides, dtypes, scalar
arguments, and the storage of every tensor made outside the region (where it lives).
Two steps whose signatures are equal would replay one graph.

A Triton launch, interpreted (``TRITON_INTERPRET=1``) or compiled, is recorded as one call
(``record(..., triton=True)``: the kernel, its grid, its arguments, tensors by identity),
and the aten calls the interpreter makes inside it are not recorded (they are the
launch's own); at replay the kernel runs again on the replay's tensors, with the Python
values it was launched with. Not seen: a C kernel called by pointer, which would replay
as nothing (the regions tested here run torch and Triton only).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from support.kernel_device import launches_wrapped


class Recording(TorchDispatchMode):
    """Records the aten calls made while active (``with Recording() as rec: region()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self._in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._in_kernel:
            self.ops.append((func, args, kwargs, out))
        return out

    def launch(self, run: Callable, kernel: Any, args: tuple, kwargs: dict) -> Any:
        """One Triton launch, run now and recorded as one call."""
        self._in_kernel += 1
        try:
            out = run(kernel, *args, **kwargs)
        finally:
            self._in_kernel -= 1
        self.ops.append((_Launch(run, kernel), args, kwargs, None))
        return out

    def made_inside(self) -> set[int]:
        """Ids of the tensors the region's ops returned."""
        made = set()
        for _, _, _, out in self.ops:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    made.add(id(t))
        return made

    def replay(self) -> None:
        """Run the recorded calls again, the region's Python not at all (see the module docstring)."""
        env: dict[int, torch.Tensor] = {}

        def now(x: Any) -> Any:
            return env.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.ops:
            got = func(*tree_map(now, args), **tree_map(now, kwargs))
            for old, new in zip(tree_flatten(out)[0], tree_flatten(got)[0]):
                if isinstance(old, torch.Tensor):
                    env[id(old)] = new


def signature(rec: Recording) -> list[tuple]:
    """The region's op trace: what must not change between two steps one graph replays."""
    made: set[int] = set()
    trace = []

    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            where = "inside" if id(x) in made else ("outside", x.untyped_storage().data_ptr(), x.storage_offset())
            return ("tensor", tuple(x.shape), x.stride(), x.dtype, where)
        if isinstance(x, (list, tuple)):
            return tuple(describe(y) for y in x)
        return x

    for func, args, kwargs, out in rec.ops:
        trace.append((str(func), describe(args), tuple(sorted((k, describe(v)) for k, v in kwargs.items()))))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                made.add(id(t))
    return trace


def outside_tensors(rec: Recording) -> dict[tuple, tuple]:
    """Every tensor the region read or wrote that was made outside it, by storage:
    ``(data_ptr, offset) -> (shape, stride, dtype)`` (a graph holds these addresses)."""
    made: set[int] = set()
    seen = {}
    for _, args, kwargs, out in rec.ops:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and id(t) not in made:
                seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = (tuple(t.shape), t.stride(), t.dtype)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                made.add(id(t))
    return seen


def first_difference(a: list[tuple], b: list[tuple]) -> str:
    """Where two op traces part (for an assertion's message)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i}: {x} != {y}"
    return f"lengths {len(a)} != {len(b)}" if len(a) != len(b) else "equal"


class _Launch:
    """A recorded Triton launch: called with the arguments, named by its kernel."""

    def __init__(self, run: Callable, kernel: Any) -> None:
        self.run, self.kernel = run, kernel

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.run(self.kernel, *args, **kwargs)

    def __str__(self) -> str:
        return f"triton.{self.kernel.__name__}"


def record(region: Callable[[], Any], *, triton: bool = False) -> Recording:
    """Run ``region`` once, recorded (``triton``: its Triton launches too)."""
    rec = Recording()
    with rec, launches_wrapped(rec.launch) if triton else nullcontext():
        region()
    return rec
