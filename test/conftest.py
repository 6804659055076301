"""Shared fixtures: the embedded model and a real SGLang server on torch_cpu."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import requests

from sgl_importance.local_server import SERVED_NAME, LocalServer, metric  # noqa: F401 (tests import metric from here)

REPO = Path(__file__).resolve().parents[1]


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


class Server(LocalServer):
    """The server on torch_cpu (``sgl_importance.local_server``), plus a greedy /generate."""

    def __init__(self, model_path: str, args: list[str], env: dict[str, str], log: Path):
        super().__init__(model_path, args, log, env)

    def generate(self, text: str, max_new_tokens: int = 8, **extra) -> dict:
        body = {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "return_logprob": True,
            "return_cached_tokens_details": True,
            **extra,
        }
        r = requests.post(self.url + "/generate", json=body, timeout=300)
        r.raise_for_status()
        return r.json()


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


def output_ids_and_logprobs(response: dict) -> tuple[list[int], list[float]]:
    meta = response["meta_info"]
    return response["output_ids"], [entry[0] for entry in meta["output_token_logprobs"]]


def launch_and_fail(model_path: str, *args: str) -> str:
    """Run the launcher with invalid flags; return its output (it must exit non-zero)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, *args],
        env={**os.environ, "SGLANG_PLATFORM": "torch_cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, "server started despite an invalid flag"
    return proc.stdout + proc.stderr
