"""start_with_retry: what the tests, benchmarks and scripts start servers with."""

from __future__ import annotations

import subprocess

import pytest

from sgl_importance.local_server import HOST_MEMORY, PORT_CLASH, LocalServer, start_with_retry


class FakeServer:
    """Fails its wait with the next scripted error (None: ready)."""

    def __init__(self, error, log=""):
        self.error = error
        self.stopped = False
        self._log = log

    def log(self):
        return self._log

    def wait_ready(self, timeout):
        if self.error is not None:
            raise self.error

    def stop(self):
        self.stopped = True


def starts(*errors):
    built = []

    def make():
        built.append(FakeServer(errors[len(built)]))
        return built[-1]

    return built, make


def test_a_port_clash_is_retried_on_a_fresh_server_and_the_first_is_stopped():
    built, make = starts(RuntimeError("server exited: [Errno 98] Address already in use"), None)
    server = start_with_retry(make, attempts=3)
    assert server is built[1] and server.start_attempts == 2
    assert built[0].stopped and not built[1].stopped


def test_another_failure_is_raised_at_once():
    built, make = starts(RuntimeError("server exited: CUDA error"), None)
    with pytest.raises(RuntimeError, match="CUDA error"):
        start_with_retry(make, attempts=3)
    assert len(built) == 1 and built[0].stopped


def test_the_last_start_raises_even_for_a_reason_worth_retrying():
    built, make = starts(*[RuntimeError(HOST_MEMORY)] * 2)
    with pytest.raises(RuntimeError, match=HOST_MEMORY):
        start_with_retry(make, attempts=2, retry_on=(PORT_CLASH, HOST_MEMORY))
    assert len(built) == 2 and all(s.stopped for s in built)


def test_an_interrupted_start_leaves_no_server_behind():
    built, make = starts(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        start_with_retry(make)
    assert built[0].stopped


def test_a_port_clash_is_retried_when_only_the_whole_log_says_so():
    # SGLang logs the failed bind, then its warmup retries the port for 120 s: the
    # error's tail holds only the warmup's traceback.
    tail = RuntimeError("server exited with -9: ... Connection refused")
    servers = iter([FakeServer(tail, log=f"... [Errno 98] {PORT_CLASH} ..."), FakeServer(None)])
    built = []

    def make():
        built.append(next(servers))
        return built[-1]

    server = start_with_retry(make, attempts=3)
    assert server is built[1] and server.start_attempts == 2 and built[0].stopped


def test_a_server_that_could_not_bind_its_port_fails_its_wait_at_once(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(f"ERROR:    [Errno 98] error while attempting to bind on address: {PORT_CLASH}\n")
    server = LocalServer.__new__(LocalServer)  # alive, never listening: as SGLang is then
    server.proc, server.log_path, server.url = subprocess.Popen(["sleep", "60"]), log, "http://127.0.0.1:9"
    try:
        with pytest.raises(RuntimeError, match=PORT_CLASH):
            server.wait_ready(timeout=60)
    finally:
        server.proc.kill()
