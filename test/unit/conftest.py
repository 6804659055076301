"""Fixtures for the unit tests (no server)."""

from __future__ import annotations

from typing import Iterator

import pytest

from support.hooked import Hooked


@pytest.fixture(scope="session")
def hooked() -> Iterator[Hooked]:
    """One interpreter with SGLang patched by the plugin's hooks (``support.hooked``)."""
    interpreter = Hooked()
    yield interpreter
    interpreter.close()
