"""Shared fixtures: the embedded model and a real SGLang server on torch_cpu."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from support.server import Server

REPO = Path(__file__).resolve().parents[1]

# Under `make test` (pytest-xdist) each worker gets its share of the cores for
# OpenMP, in its own torch and in every server and interpreter it starts: two
# servers with two spinning OpenMP threads each on two cores run slower together
# than one after the other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="session")
def model_path() -> str:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_model.py"), "--print-path"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="session")
def token_ids(model_path: str):
    """token_ids(text, n) -> exactly n of the model's token ids for text (repeated if short)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def ids(text: str, n: int) -> list[int]:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(tokens) < n:
            tokens = tokens + tokens
        return tokens[:n]

    return ids


@pytest.fixture(scope="module")
def launch(model_path: str, tmp_path_factory) -> Iterator:
    """Factory: launch(args, env) -> ready Server; all are stopped at module end."""
    servers: list[Server] = []

    def _launch(args: list[str] = (), env: dict[str, str] | None = None) -> Server:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = Server(model_path, list(args), env or {}, log)
        servers.append(server)
        server.wait_ready()
        return server

    yield _launch
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def mooncake_store(tmp_path_factory):
    """A local Mooncake Store (master + segment holder) on free ports, one per test module
    so no module sees another's pages; the module is skipped where Mooncake cannot run."""
    from sgl_importance.local_store import LocalStore, store_unavailable

    reason = store_unavailable()
    if reason is not None:
        pytest.skip(f"Mooncake Store cannot run here: {reason}")
    store = LocalStore(tmp_path_factory.mktemp("mooncake"), segment="512MB")
    try:
        store.start()
        yield store
    finally:
        store.stop()


def pytest_collection_modifyitems(items: list) -> None:
    """Slow modules first, then the other e2e modules, then unit and kernel tests.

    Under ``make test`` two workers take one module at a time in this order, so the
    longest modules start early and the many short ones even out the end.
    """
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, item.get_closest_marker("e2e") is None))
