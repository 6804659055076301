"""Functions that stand where a compiled kernel would and refuse to run."""

from __future__ import annotations

from typing import Any, Callable


class ShimKernelCalled(RuntimeError):
    """A compiled ``sgl_kernel`` op was called on the torch_cuda platform."""


def missing(module: str, name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ShimKernelCalled(
            f"{module}.{name} was called, but this is sgl-importance's stand-in for "
            "sgl_kernel (the torch_cuda platform runs SGLang's torch-native ops and "
            "has no compiled SGLang kernels). A code path outside the native ones "
            "was taken: please report it, with the server flags used."
        )

    refuse.__name__ = name
    refuse.__qualname__ = name
    refuse.__module__ = module
    refuse.is_shim_kernel = True  # type: ignore[attr-defined]
    return refuse


def export(namespace: dict[str, Any], module: str, names: tuple[str, ...]) -> None:
    """Bind each name in ``names`` to a refusing function in a module's namespace."""
    for name in names:
        namespace[name] = missing(module, name)
