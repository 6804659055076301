"""The server the e2e tests start, and the calls most of them make on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import requests

from sgl_importance.local_server import LocalServer


class Server(LocalServer):
    """``python -m sglang.launch_server`` on torch_cpu (``sgl_importance.local_server``),
    plus greedy ``/generate`` calls."""

    def __init__(self, model_path: str, args: list[str], env: dict[str, str], log: Path):
        super().__init__(model_path, args, log, env)

    def generate(self, text: str, max_new_tokens: int = 8, **extra) -> dict:
        """Greedy /generate of ``text`` with logprobs and the cache report."""
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


def generate_ids(server: LocalServer, input_ids: list[int], max_new_tokens: int, timeout: float = 300) -> dict:
    """Greedy /generate of exact token ids, with the cache report."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "return_cached_tokens_details": True,
    }
    r = requests.post(server.url + "/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


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
