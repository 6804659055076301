"""A local Mooncake Store: ``mooncake_master`` and a segment holder as child processes.

What ``make store``, the end-to-end tests and the benchmark share. The master runs
its built-in HTTP metadata server; the holder (``mooncake_client``) mounts the
memory segment the pages live in, so servers started with
``MOONCAKE_GLOBAL_SEGMENT_SIZE=0`` contribute none and the KV outlives any one of
them. Every port is a free one picked at start. Both processes run in sessions
of their own, so :meth:`LocalStore.stop` reaches whatever they spawned.

    python -m sgl_importance.local_store            # prints the server env, runs until Ctrl-C

Nothing here imports SGLang or Mooncake's Python module; only the binaries the
``mooncake-transfer-engine-non-cuda`` wheel installs next to the interpreter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from sgl_importance.env import (
    MOONCAKE_HOSTNAME_ENV,
    MOONCAKE_MASTER_ENV,
    MOONCAKE_METADATA_SERVER_ENV,
    MOONCAKE_METRICS_PORT_ENV,
    MOONCAKE_PROTOCOL_ENV,
    MOONCAKE_SEGMENT_SIZE_ENV,
)
from sgl_importance.local_server import free_port

# The holder's segment: every page of every server sharing the store lives here.
DEFAULT_SEGMENT = "1GB"
READY_TIMEOUT_S = 60


def mooncake_binary(name: str) -> Optional[str]:
    """Path of a Mooncake executable (beside this interpreter first, then PATH)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def store_unavailable() -> Optional[str]:
    """Why a local store cannot run here (None when it can): the reason, in one line."""
    for name in ("mooncake_master", "mooncake_client"):
        if mooncake_binary(name) is None:
            return f"{name} not found: install mooncake-transfer-engine-non-cuda (make install)"
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        hint = " (Debian package libibverbs1)" if "ibverbs" in str(e) else ""
        return f"mooncake.store cannot be imported: {e}{hint}"
    return None


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalStore:
    """A master (RPC + HTTP metadata, 127.0.0.1) and one segment holder.

    Args:
        workdir: where the two logs go (a temporary directory by default).
        segment: the holder's segment size, in Mooncake's notation ("1GB").
    """

    def __init__(self, workdir: Optional[Path] = None, segment: str = DEFAULT_SEGMENT) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mooncake-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.segment = segment
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.holder_port = free_port()
        self.master: Optional[subprocess.Popen] = None
        self.holder: Optional[subprocess.Popen] = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def server_env(self, segment_bytes: int = 0) -> dict[str, str]:
        """The variables a ``launch_server --hicache-storage-backend mooncake`` needs.

        ``segment_bytes`` 0: the server holds no pages itself (the holder does).
        """
        return {
            MOONCAKE_MASTER_ENV: self.master_address,
            MOONCAKE_PROTOCOL_ENV: "tcp",
            MOONCAKE_METADATA_SERVER_ENV: self.metadata_server,
            MOONCAKE_SEGMENT_SIZE_ENV: str(segment_bytes),
            MOONCAKE_HOSTNAME_ENV: "127.0.0.1",
            MOONCAKE_METRICS_PORT_ENV: str(self.metrics_port),
        }

    def start(self) -> "LocalStore":
        """Start the master, then the holder; return once both are up.

        Raises:
            RuntimeError: Mooncake is not installed, or a process exited (with its log).
        """
        reason = store_unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        self.start_master()
        self.start_holder()
        return self

    def start_master(self) -> None:
        """(Re)start the master on the same ports (the holder reconnects by itself)."""
        cmd = [
            mooncake_binary("mooncake_master"),
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={self.metrics_port}",
        ]
        self.master = self._spawn(cmd, "master.log")
        self._wait_port(self.master, self.rpc_port, "master.log")
        self._wait_port(self.master, self.http_port, "master.log")

    def start_holder(self) -> None:
        cmd = [
            mooncake_binary("mooncake_client"),
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_server}",
            f"--global_segment_size={self.segment}",
            "--protocol=tcp",
            "--host=127.0.0.1",
            f"--port={self.holder_port}",
        ]
        self.holder = self._spawn(cmd, "holder.log")
        self._wait_port(self.holder, self.holder_port, "holder.log")

    def _spawn(self, cmd: list, log_name: str) -> subprocess.Popen:
        log = open(self.workdir / log_name, "a")
        try:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.workdir)
        finally:
            log.close()

    def _wait_port(self, proc: subprocess.Popen, port: int, log_name: str) -> None:
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            if proc.poll() is not None:
                tail = (self.workdir / log_name).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{log_name[:-4]} exited with {proc.returncode}:\n{tail}")
            if _port_open(port):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{log_name[:-4]} not listening on port {port} after {READY_TIMEOUT_S}s")

    @staticmethod
    def _kill(proc: Optional[subprocess.Popen]) -> None:
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def kill_master(self) -> None:
        """SIGKILL the master (its in-memory index of the pages goes with it)."""
        self._kill(self.master)
        self.master = None

    def stop(self) -> None:
        """Stop the holder and the master. Idempotent."""
        self._kill(self.holder)
        self.holder = None
        self.kill_master()


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--segment", default=DEFAULT_SEGMENT, help="segment the holder mounts (e.g. 1GB)")
    p.add_argument("--workdir", type=Path, default=None, help="logs (default: a temporary directory)")
    p.add_argument("--env-file", type=Path, default=None, help="also write the server env here")
    args = p.parse_args(argv)
    store = LocalStore(args.workdir, args.segment)
    try:
        store.start()
    except RuntimeError as e:
        print(f"local Mooncake store: {e}", file=sys.stderr)
        store.stop()
        return 1
    exports = "\n".join(f"export {k}={v}" for k, v in store.server_env().items())
    if args.env_file is not None:
        args.env_file.write_text(exports + "\n")
    print(f"Mooncake master {store.master_address}, holder segment {store.segment}; logs in {store.workdir}")
    print("Servers sharing this store need:\n" + exports, flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            if store.master.poll() is not None or store.holder.poll() is not None:
                print("local Mooncake store: a process exited; see the logs", file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
