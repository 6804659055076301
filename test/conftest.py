"""Shared fixtures: the embedded model and a real SGLang server on torch_cpu."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def model_path() -> str:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_model.py"), "--print-path"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m sglang.launch_server` as a subprocess, logging to a file."""

    def __init__(self, model_path: str, args: list[str], env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path,
            "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            *args,
        ]  # fmt: skip
        full_env = {**os.environ, "SGLANG_PLATFORM": "torch_cpu", **env}
        self._log = open(log, "w")
        # A new session so shutdown can signal the whole process tree.
        self.proc = subprocess.Popen(
            cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM the launcher (it drains and stops its children, as under a
        process manager); return its exit code, or None if it had to be killed."""
        code: int | None = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
        # Leave no scheduler or detokenizer behind, whatever happened above.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        return code

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
