"""Read the page table a server dumps under SGL_IMPORTANCE_DUMP_DIR."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch


def read_dump(directory: Path, ready: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict:
    """The scheduler's latest dump once ``ready(state)`` holds.

    The scheduler writes after processing a batch, which may be just after the HTTP
    response went out, so this polls instead of reading once.
    """
    deadline = time.time() + timeout
    state: dict[str, Any] = {}
    while time.time() < deadline:
        files = sorted(directory.glob("page_table-*.pt"))
        if files:
            try:
                state = torch.load(files[-1])
            except (EOFError, RuntimeError):
                state = {}
            if state and ready(state):
                return state
        time.sleep(0.2)
    counters = {k: v for k, v in state.items() if not torch.is_tensor(v)}
    raise TimeoutError(f"no dump in {directory} satisfied the condition; last: {counters}")
