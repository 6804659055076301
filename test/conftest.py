"""Shared fixtures: the embedded model and a real SGLang server on torch_cpu."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from sgl_importance import local_server
from sgl_importance.env import CHECKS_ENV
from support.server import Server

# Under `make test` (pytest-xdist) each worker gets its share of the cores for
# OpenMP, in its own torch and in every server and interpreter it starts: two
# servers with two spinning OpenMP threads each on two cores run slower together
# than one after the other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# The suite's invariant checks (docs/testing.md), on in this process and every process and
# server it starts.
os.environ.setdefault(CHECKS_ENV, "1")
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="session")
def model_path() -> str:
    return local_server.model_path()


@pytest.fixture(scope="session")
def tiny_model(model_path, tmp_path_factory) -> str:
    """The two-layer random Llama for servers whose Triton kernels run under the interpreter."""
    from support.tiny_llama import save_tiny_llama

    return save_tiny_llama(model_path, tmp_path_factory.mktemp("tiny-llama"))


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


# A neighbour worker's server can hold the memory SGLang wants free (10 GiB beyond the host
# pool) for a minute: a start refused for host memory waits and tries again.
_RETRY_ON = (local_server.PORT_CLASH, local_server.HOST_MEMORY)


def _launcher(model_path: str, tmp_path_factory) -> Iterator:
    """launch(args, env) -> ready Server; every server it started stops when it is closed."""
    servers: list[Server] = []

    def _launch(args: list[str] = (), env: dict[str, str] | None = None) -> Server:
        def start() -> Server:  # each start its own log, so a failed one stays readable
            log = tmp_path_factory.mktemp("server") / "server.log"
            servers.append(Server(model_path, list(args), env or {}, log))
            return servers[-1]

        return local_server.start_with_retry(start, attempts=4, retry_on=_RETRY_ON, pause_s=20, label="launch")

    try:
        yield _launch
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def launch(model_path: str, tmp_path_factory) -> Iterator:
    """Factory: launch(args, env) -> ready Server; all are stopped at module end."""
    yield from _launcher(model_path, tmp_path_factory)


@pytest.fixture
def launch_here(model_path: str, tmp_path_factory) -> Iterator:
    """As ``launch``, for a server one test uses: stopped when that test ends, so an idle
    server with a host pool does not sit through the module's next test."""
    yield from _launcher(model_path, tmp_path_factory)


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
