"""A local ``python -m sglang.launch_server`` as a child process, and /metrics reading.

What the end-to-end tests, ``scripts/collect_traces.py`` and the benchmarks share:
find the embedded model, start the server in its own session with its output in a
log file, wait until ``/health_generate`` answers (starting it again where the
start-up failed for a passing reason), stop it the way a process manager would
(SIGTERM to the launcher, which drains and stops its children; then SIGKILL to
whatever of its session is left), and sum one series out of a Prometheus scrape.
The requests sent to a running server are in ``sgl_importance.client``. SGLang runs
only as the subprocess; nothing here imports it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, TypeVar

import requests

from sgl_importance.env import PLATFORM_ENV

SERVED_NAME = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 300
# Start-up failures worth another start, by what the server's log says. A port clash:
# another process bound the port between free_port() and the server. Host memory:
# SGLang refuses a host tier while less than a fixed 10 GiB of RAM is available
# (pool_host/base.py), which on a machine shared with other servers passes.
PORT_CLASH = "address already in use"
HOST_MEMORY = "Not enough host memory"
# The source checkout's model script (this file is python/sgl_importance/local_server.py).
PREPARE_MODEL = Path(__file__).resolve().parents[2] / "scripts" / "prepare_model.py"


def model_path() -> str:
    """The embedded model's folder, converted on first use (``scripts/prepare_model.py
    --print-path``, run as a subprocess: checking the folder hashes every weight, which
    the caller has no use for in its own memory).

    Raises:
        FileNotFoundError: the package is not in a source checkout (pass a model path).
    """
    if not PREPARE_MODEL.is_file():
        raise FileNotFoundError(f"{PREPARE_MODEL} not found: pass the model folder explicitly")
    out = subprocess.run(
        [sys.executable, str(PREPARE_MODEL), "--print-path"], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


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
        python: the interpreter command (default: this one), e.g. ``[python, "-S"]``.
        inherit_env: start from this process's environment (the default); False: ``env`` alone.
        cwd: the server's working directory (default: this one).

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
        python: Sequence[str] = (),
        inherit_env: bool = True,
        cwd: Optional[Path] = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log)
        self.cmd = [
            *(python or [sys.executable]), "-m", "sglang.launch_server",
            "--model-path", model_path,
            "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            *(["--sleep-on-idle"] if sleep_on_idle else []),
            *args,
        ]  # fmt: skip
        full_env = dict(os.environ) if inherit_env else {}
        if platform is not None:
            full_env[PLATFORM_ENV] = platform
        full_env.update(env or {})
        # How many starts start_with_retry() needed for this one.
        self.start_attempts = 1
        self._log = open(self.log_path, "w")
        # A session of its own, so stop() can reach every process it spawned.
        self.proc = subprocess.Popen(
            self.cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
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
            if PORT_CLASH in self.log().lower():  # it will never listen (SGLang's warmup waits 120 s on it)
                raise RuntimeError(f"server could not bind its port ({PORT_CLASH}):\n{self.log()[-4000:]}")
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


Started = TypeVar("Started", bound=LocalServer)


def start_with_retry(
    make: Callable[[], Started],
    *,
    attempts: int = 3,
    retry_on: Sequence[str] = (PORT_CLASH,),
    pause_s: float = 0.0,
    timeout: float = STARTUP_TIMEOUT_S,
    label: Optional[str] = None,
) -> Started:
    """Start a server with ``make()`` and wait until it is ready; where it exited for
    one of the reasons in ``retry_on``, stop it and call ``make()`` again (a fresh
    port, a fresh log), up to ``attempts`` starts.

    Args:
        make: builds (and so starts) one server; it may wait for resources first.
        attempts: starts at the most.
        retry_on: texts of the failure (case ignored) that are worth another start.
        pause_s: seconds between a failed start and the next.
        timeout: seconds each start may take to become ready.
        label: where given, each retry prints a line ``[label] ...``.

    Returns:
        The ready server, its ``start_attempts`` set.

    Raises:
        RuntimeError: the server exited for another reason, or on the last start.
        TimeoutError: a start was not ready in ``timeout`` (never retried).
    """
    for attempt in range(1, attempts + 1):
        server = make()
        try:
            server.wait_ready(timeout)
        except RuntimeError as e:
            server.stop()
            # The whole log: the error holds only its tail, and a port clash is logged long
            # before SGLang's warmup gives up on the port it never bound (120 s of retries).
            said = f"{e}\n{server.log()}".lower()
            reason = next((r for r in retry_on if r.lower() in said), None)
            if reason is None or attempt == attempts:
                raise
            if label is not None:
                print(f"[{label}] start-up failed ({reason}); retrying in {pause_s:.0f}s", flush=True)
            time.sleep(pause_s)
            continue
        except BaseException:
            server.stop()  # Ctrl-C while it starts: leave no server behind
            raise
        server.start_attempts = attempt
        return server
    raise ValueError(f"attempts must be at least 1, got {attempts}")


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
