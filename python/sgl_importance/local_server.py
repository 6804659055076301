"""A local ``python -m sglang.launch_server`` as a child process, and /metrics reading.

What the end-to-end tests, ``scripts/collect_traces.py`` and the benchmarks share:
start the server in its own session with its output in a log file, wait until
``/health_generate`` answers, stop it the way a process manager would (SIGTERM to
the launcher, which drains and stops its children; then SIGKILL to whatever of its
session is left), and sum one series out of a Prometheus scrape. SGLang runs only
as the subprocess; nothing here imports it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import requests

from sgl_importance.env import PLATFORM_ENV

SERVED_NAME = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``python -m sglang.launch_server --model-path MODEL ... ARGS`` on 127.0.0.1.

    Args:
        model_path: the model folder (``scripts/prepare_model.py --print-path``).
        args: further launcher flags.
        log: file receiving the server's stdout and stderr.
        env: variables set on top of this process's environment.
        platform: ``SGLANG_PLATFORM`` for the server (None keeps the environment's).
        served_name: ``--served-model-name``.
        port: the port (default: a free one).
        sleep_on_idle: pass ``--sleep-on-idle`` (the default).

    The server gets ``--sleep-on-idle``: without it an idle SGLang scheduler polls
    its sockets in a busy loop, one core per server at 100 %, which on a 2-core
    machine halves the speed of whatever else runs (another server, the client).
    """

    def __init__(
        self,
        model_path: str,
        args: Sequence[str],
        log: Path,
        env: Optional[Mapping[str, str]] = None,
        *,
        platform: Optional[str] = "torch_cpu",
        served_name: str = SERVED_NAME,
        port: Optional[int] = None,
        sleep_on_idle: bool = True,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log)
        self.cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path,
            "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            *(["--sleep-on-idle"] if sleep_on_idle else []),
            *args,
        ]  # fmt: skip
        full_env = dict(os.environ)
        if platform is not None:
            full_env[PLATFORM_ENV] = platform
        full_env.update(env or {})
        self._log = open(self.log_path, "w")
        # A session of its own, so stop() can reach every process it spawned.
        self.proc = subprocess.Popen(
            self.cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Return once ``/health_generate`` answers 200.

        Raises:
            RuntimeError: the server exited (with the log's tail).
            TimeoutError: not ready in ``timeout`` seconds (the server is stopped).
        """
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

    def stop(self, timeout: float = 60) -> Optional[int]:
        """SIGTERM the launcher and wait; returns its exit code, or None if it had
        to be killed. Idempotent."""
        code: Optional[int] = self.proc.poll()
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
        if not self._log.closed:
            self._log.close()
        return code


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of series ``name`` whose labels include ``labels``, in a
    Prometheus text scrape (0.0 when there are none)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total
