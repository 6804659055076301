"""Small hand-made traces for the simulator tests."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pytest

from sgl_importance.trace.tables import Accesses


def trace_from_steps(
    steps: Sequence[Mapping[int, float]], request_id: int = 0, layer: int = -1, kv_head: int = -1, step0: int = 0
) -> dict[str, np.ndarray]:
    """Columns for one request: ``steps[t]`` maps page -> mass at step ``step0 + t``."""
    cols: dict[str, list] = {k: [] for k in ("step", "request_id", "layer", "kv_head", "page", "importance")}
    for t, row in enumerate(steps):
        for page, mass in row.items():
            cols["step"].append(step0 + t)
            cols["request_id"].append(request_id)
            cols["layer"].append(layer)
            cols["kv_head"].append(kv_head)
            cols["page"].append(page)
            cols["importance"].append(mass)
    return {k: np.asarray(v) for k, v in cols.items()}


def merge_columns(*parts: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def sequence_trace(pages: Sequence[int]) -> Accesses:
    """One page per step, mass 1: the textbook page-reference string."""
    return Accesses.from_columns(trace_from_steps([{p: 1.0} for p in pages]))


@pytest.fixture
def rng() -> np.random.Generator:
    """Seeded generator; imported by the test modules that use it."""
    return np.random.default_rng(1234)
