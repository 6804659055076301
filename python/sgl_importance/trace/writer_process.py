"""The trace writer process: receives record batches over ZeroMQ and writes Parquet.

The scheduler's recorder (``trace/recorder.py``) starts it once with
``python -m sgl_importance.trace.writer_process`` and pushes multipart messages to its PULL
socket:

- ``[b"labels", json {code: request id}]`` before the first rows of new requests;
- ``[b"rows", bytes of RECORD_DTYPE records]``;
- ``[b"requests", json list of finished-request rows]`` (the ``requests`` table's
  column names: ``request_id``,
  steps, timestamps, token counts, radix path; conversation and turn are parsed
  here from the id, off the scheduler);
- ``[b"dropped", decimal count]``: rows the recorder did not send (row bound reached);
- ``[b"close"]``: flush, close the trace, exit.

The process detaches from the scheduler (double start: the launched process forks
and exits), because SGLang's launcher stops its process tree with SIGKILL on SIGTERM:
a writer inside that tree would die with a half-written Parquet footer. Detached, it
notices that the scheduler is gone, drains what is queued and closes the trace, so
``meta.json`` ends with ``extra.complete = true`` and every file is readable.

Imports only numpy at module level, so the scheduler can read ``RECORD_DTYPE``
without pulling in pyarrow.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from sgl_importance.trace.tables import Requests

# One row per (decode step, request, page): fixed size, so the scheduler fills a
# preallocated array and the writer reads it back with np.frombuffer.
RECORD_DTYPE = np.dtype(
    [
        ("step", "<i8"),
        ("time_ns", "<i8"),
        ("request_id", "<i8"),  # code; the request id string comes in a "labels" message
        ("page", "<i8"),  # physical KV page (slot // page_size)
        ("node_id", "<i8"),  # radix node holding the page at this step, -1 none yet
        ("position", "<i4"),  # index of the page within the request's sequence
        ("importance", "<f4"),  # the page's mass at this step, reduced over layers
    ]
)

POLL_MS = 200


def records_to_columns(records: np.ndarray, labels: dict[int, str]) -> dict[str, np.ndarray]:
    """``accesses`` columns (``trace.schema``) for a batch of records."""
    from sgl_importance.trace.schema import parse_rid

    codes, inverse = np.unique(records["request_id"], return_inverse=True)
    names = np.array([labels.get(int(c), str(int(c))) for c in codes], dtype=object)
    turns = np.array([parse_rid(n)[1] for n in names], np.int32)
    return {
        "step": records["step"],
        "time_ns": records["time_ns"],
        "request_id": names[inverse],
        "turn": turns[inverse],
        "page": records["page"],
        "node_id": records["node_id"],
        "position": records["position"],
        "importance": records["importance"],
    }


def request_rows_to_table(rows: list[dict[str, Any]]) -> "Requests":
    """``Requests`` for a batch of the recorder's finished-request rows."""
    from sgl_importance.trace.schema import parse_rid
    from sgl_importance.trace.tables import Requests

    conv_turn = [parse_rid(r["request_id"]) for r in rows]
    return Requests.from_lists(
        [str(r["request_id"]) for r in rows],
        [r["arrival_step"] for r in rows],
        [r["node_ids"] for r in rows],
        [r["node_tokens"] for r in rows],
        [r["output_tokens"] for r in rows],
        conversation=[c for c, _ in conv_turn],
        turn=[t for _, t in conv_turn],
        prompt_tokens=[r["prompt_tokens"] for r in rows],
        cached_tokens=[r["cached_tokens"] for r in rows],
        finish_step=[r["finish_step"] for r in rows],
        arrival_ns=[r["arrival_ns"] for r in rows],
        finish_ns=[r["finish_ns"] for r in rows],
    )


def _alive(pid: Optional[int]) -> bool:
    if pid is None:
        return True
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def serve(
    endpoint: str,
    out: str,
    meta: dict[str, Any],
    max_rows: int,
    watch_pid: Optional[int],
    ready_fd: Optional[int] = None,
) -> int:
    """Receive until ``close``, until ``watch_pid`` is gone, or until SIGTERM; then close the trace.

    Returns:
        Access rows written.
    """
    import zmq

    from sgl_importance.trace.schema import TraceMeta
    from sgl_importance.trace.streaming import TraceWriter

    stop = False

    def _on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_term)
    # The launcher's Ctrl-C reaches the whole session; the writer drains instead of dying.
    signal.signal(signal.SIGINT, _on_term)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        sock.bind(endpoint)
        writer = TraceWriter(out, TraceMeta(**meta), max_rows=max_rows)
    except Exception as e:  # reported to the recorder, which fails start-up with it
        if ready_fd is not None:
            os.write(ready_fd, f"error: {e}".encode())
            os.close(ready_fd)
        raise
    if ready_fd is not None:
        os.write(ready_fd, b"ok")
        os.close(ready_fd)
    labels: dict[int, str] = {}

    def handle(parts: list[bytes]) -> bool:
        kind = parts[0]
        if kind == b"rows":
            records = np.frombuffer(parts[1], dtype=RECORD_DTYPE)
            if records.size:
                writer.append(records_to_columns(records, labels))
        elif kind == b"requests":
            rows = json.loads(parts[1])
            if rows:
                writer.append_requests(request_rows_to_table(rows))
        elif kind == b"labels":
            labels.update({int(k): v for k, v in json.loads(parts[1]).items()})
        elif kind == b"dropped":
            writer.meta.dropped_rows += int(parts[1])
        elif kind == b"close":
            return False
        return True

    reason = "close"
    while True:
        if stop:
            reason = "SIGTERM"
            break
        if sock.poll(POLL_MS):
            if not handle(sock.recv_multipart()):
                break
        elif not _alive(watch_pid):
            reason = "scheduler exited"
            break
    # Whatever the scheduler pushed before it stopped is still queued: keep it.
    while reason != "close" and sock.poll(0):
        if not handle(sock.recv_multipart()):
            break
    writer.meta.extra["complete"] = True
    writer.meta.extra["closed_by"] = reason
    writer.close()
    sock.close(linger=0)
    ctx.term()
    return writer.meta.access_rows


def _detach() -> Optional[int]:
    """Fork; the parent waits for the child's readiness and exits. Returns the pipe's write end."""
    r, w = os.pipe()
    if os.fork() > 0:
        os.close(w)
        message = b""
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            message += chunk
        os.close(r)
        if message != b"ok":
            print(
                f"[sgl-importance] trace writer failed: {message.decode(errors='replace') or 'no answer'}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        os._exit(0)
    os.close(r)
    os.setsid()
    return w


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sgl_importance.trace.writer_process", description=__doc__.splitlines()[0]
    )
    p.add_argument("--endpoint", required=True, help="ZeroMQ endpoint to bind (ipc://...)")
    p.add_argument("--out", required=True, help="trace directory")
    p.add_argument("--meta", default="{}", help="TraceMeta fields as JSON")
    p.add_argument("--max-rows", type=int, default=5_000_000)
    p.add_argument("--watch-pid", type=int, default=None, help="close the trace once this process is gone")
    p.add_argument("--detach", action="store_true", help="fork away from the caller's process tree")
    a = p.parse_args(argv)
    ready_fd = _detach() if a.detach else None
    started = time.monotonic()
    rows = serve(a.endpoint, a.out, json.loads(a.meta), a.max_rows, a.watch_pid, ready_fd)
    print(
        f"[sgl-importance] trace {a.out}: {rows} rows in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
