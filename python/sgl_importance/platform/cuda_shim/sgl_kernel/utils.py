"""sgl-importance's stand-in for ``sgl_kernel.utils``: the one query SGLang makes."""

from __future__ import annotations


def is_arch_support_pdl() -> bool:
    # Programmatic dependent launch is sgl_kernel's launcher feature; the shim has none.
    return False
