"""One validation helper for every value the plugin accepts from outside.

Flags (``flags.py``), the eviction policy's ``--radix-eviction-policy-config``
(``importance/priority.py``), the storage grading's thresholds (``config.py``) and
request fields (``request_check/``) test values with these predicates and word
their refusals with :func:`invalid`, so "a bool is not an int" and "what is
allowed" are written once. Python's ``bool`` is an ``int``; as a count, a token id
or a fraction it is always a caller's mistake, so no predicate here accepts one.

A leaf: stdlib only.
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any


def is_int(value: Any) -> bool:
    """An integer (numpy's included), never a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float (numpy's included), never a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def int_in(value: Any, low: int, high: int) -> bool:
    """An integer in ``[low, high]``."""
    return is_int(value) and low <= value <= high


def number_in(value: Any, low: float, high: float) -> bool:
    """A number in ``[low, high]`` (NaN never is)."""
    return is_number(value) and low <= value <= high


def invalid(what: str, allowed: str) -> ValueError:
    """The refusal every setting uses: ``<what> is invalid; allowed: <allowed>``.

    Args:
        what: the setting and its value as the caller wrote them (``--flag 3``,
            ``--radix-eviction-policy-config decay=2``).
        allowed: what would have been accepted, in words.
    """
    return ValueError(f"{what} is invalid; allowed: {allowed}")
