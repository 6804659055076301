"""Opt-in recording of per-step page importance, scheduler side (``--importance-trace-dir``).

Three pieces, held for the scheduler process by ``trace/tracing.py``'s ``Tracing``
(the runtime's), each reached from one hook in ``plugin.py`` (registered only when
the flag is on, so an unrecorded server runs none of this):

- :class:`StepCapture` watches the process's ``PageImportanceTable``: it keeps the
  decode step's per-request importance ``[bs, max_pages]`` reduced over layers the
  way the table reduces them (mean or max, same sample interval), with the step's
  ``kv_indptr`` / ``kv_indices``. Tensor ops only, nothing read back to the host.
- :class:`Recorder` runs around ``Scheduler.process_batch_result``: it pairs captured
  steps with the batch's requests (checked by each request's first KV slot, so a step
  is never filed under the wrong batch under overlap scheduling), and appends one
  fixed-size record per (step, request, page) to a preallocated numpy buffer. Full
  buffers, buffers at a request's end and buffers older than a second are pushed
  over a ZeroMQ PUSH socket (non-blocking) to
- the writer process (``trace/writer_process.py``), which writes the Parquet trace.

Recorded per row: step (global decode step of this scheduler), time_ns
(``time.perf_counter_ns`` when the step finished, SGLang's request clock),
request_id (SGLang's ``rid``), page (physical page id), node_id (the radix node
holding the page, from the request's path; -1 for tokens not inserted yet),
position (the page's index in the request's sequence), importance; layer and
kv_head are -1 (reduced); the writer fills turn from the rid (``trace.schema.parse_rid``).

Per finished request, one row of the ``requests`` table: its radix path after
SGLang inserted it (prompt and output), prompt length, the prefix SGLang matched
(``cached_tokens``), output length, first and last decode step, arrival
(``time_stats.scheduler_recv_time``) and finish time. Paths come from the tree
core's ``collect_path_info`` (one call per batch, both the Python and the Rust
core), so recording does not change which tree core SGLang picks. The cost is
only paid with the flag on: one path query per recorded decode batch, one per
batch that finishes requests.

Limits: records tensor-parallel rank 0's heads only, data-parallel rank 0 only,
and no CUDA-graph-replayed step (graph replay runs no Python hooks; serve with
``--disable-cuda-graph`` to record on a GPU).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from sgl_importance.env import TRACE_DIR_ENV
from sgl_importance.trace.writer_process import RECORD_DTYPE

if TYPE_CHECKING:
    import argparse

    import torch

    from sgl_importance.importance.page_importance import PageImportanceTable
    from sgl_importance.sglang_types.scheduler import Req, ScheduleBatch
    from sgl_importance.sglang_types.tree import TreeCore

logger = logging.getLogger(__name__)

BUFFER_ROWS = 65_536
PUSH_INTERVAL_NS = 1_000_000_000
# Captured steps waiting for their batch's result; more than this and the oldest go.
MAX_PENDING = 8
# Finished rids remembered so a request is filed once; a finished request is seen in
# at most one more batch, so a bound far above the running batch size is enough.
REPORTED_KEEP = 65_536


def export_trace_dir(args: argparse.Namespace) -> None:
    """Launcher side: validate the flag and hand it to the scheduler through the environment.

    Raises:
        ValueError: the directory already holds a trace (naming the flag and the path).
    """
    from sgl_importance.config import from_namespace

    config = from_namespace(args)
    if config.trace_dir is None:
        os.environ.pop(TRACE_DIR_ENV, None)
        return
    out = Path(config.trace_dir).expanduser().resolve()
    if any(out.glob("accesses-*.parquet")):
        raise ValueError(
            f"--importance-trace-dir {config.trace_dir!r} is invalid; it already holds a trace "
            "(allowed: an empty or new directory)"
        )
    os.environ[TRACE_DIR_ENV] = str(out)


def recording_requested() -> bool:
    return bool(os.environ.get(TRACE_DIR_ENV))


@dataclass
class CapturedStep:
    step: int
    time_ns: int
    importance: torch.Tensor  # [bs, max_pages] float32
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    page_size: int


class StepCapture:
    """The current decode step's per-request importance, reduced like the table's."""

    def __init__(self) -> None:
        self.steps = 0
        self.pending: deque[CapturedStep] = deque(maxlen=MAX_PENDING)
        self._sum: Optional[torch.Tensor] = None
        self._layers = 0
        self._indptr: Optional[torch.Tensor] = None
        self._indices: Optional[torch.Tensor] = None

    def add_layer(
        self, table: PageImportanceTable, importance: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
    ) -> None:
        if self._sum is None:
            self._sum = importance.detach().float().clone()
            # Cloned: a backend may refill its metadata buffers before the result is read.
            self._indptr = kv_indptr.detach().clone()
            self._indices = kv_indices.detach().clone()
        elif table.reduce == "max":
            self._sum = self._sum.maximum(importance.float())
        else:
            self._sum.add_(importance.float())
        self._layers += 1

    def finish_step(self, table: PageImportanceTable) -> None:
        step = self.steps
        self.steps += 1
        if self._sum is not None and step % table.sample_interval == 0:
            importance = self._sum
            if table.reduce == "mean" and self._layers > 1:
                importance = importance.mul_(1.0 / self._layers)
            self.pending.append(
                CapturedStep(step, time.perf_counter_ns(), importance, self._indptr, self._indices, table.page_size)
            )
        self._sum = self._indptr = self._indices = None
        self._layers = 0


class Recorder:
    """Scheduler side of a trace: fixed-size records into a buffer, buffers to the writer.

    Args:
        out: trace directory (the writer creates it).
        max_rows: rows sent at most; later rows are counted as dropped.
        meta: ``TraceMeta`` fields for the sidecar.
        buffer_rows: records per pushed buffer.
    """

    def __init__(self, out: str, *, max_rows: int, meta: dict[str, Any], buffer_rows: int = BUFFER_ROWS) -> None:
        import zmq

        self.out = out
        self.max_rows = max_rows
        self.sent_rows = 0
        self.dropped_rows = 0
        self.unmatched_steps = 0
        self._buf = np.empty(buffer_rows, RECORD_DTYPE)
        self._n = 0
        self._codes: dict[str, int] = {}
        self._new_labels: dict[int, str] = {}
        # Per live request: first recorded decode step; finished rids already reported
        # (under overlap scheduling a finished request is seen in one more batch).
        self._arrival: dict[str, int] = {}
        self._reported: dict[str, None] = {}  # insertion-ordered, bounded by REPORTED_KEEP
        self._request_rows: list[dict[str, Any]] = []
        self._last_push_ns = time.perf_counter_ns()
        self._closed = False
        self._ipc_dir = tempfile.mkdtemp(prefix="sgl-imp-trace-")
        endpoint = f"ipc://{self._ipc_dir}/writer-{uuid.uuid4().hex[:8]}"
        cmd = [
            sys.executable, "-m", "sgl_importance.trace.writer_process",
            "--endpoint", endpoint, "--out", out, "--max-rows", str(max_rows),
            "--meta", json.dumps(meta), "--watch-pid", str(os.getpid()), "--detach",
        ]  # fmt: skip
        # Returns once the detached writer has bound its socket and opened the trace.
        done = subprocess.run(cmd, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"--importance-trace-dir {out!r}: the trace writer did not start (see log)")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 64)
        self._sock.connect(endpoint)
        self._zmq_again = zmq.Again
        self._noblock = zmq.NOBLOCK
        atexit.register(self.close)

    # -- per batch --------------------------------------------------------------

    def push_if_due(self, batch: Optional[ScheduleBatch]) -> None:
        """Push when a request of ``batch`` finished or the buffer is a second old.

        A finished request's rows are with the writer at once, so they survive the
        launcher killing the scheduler.
        """
        if not (self._n or self._request_rows) or batch is None:
            return
        if any(r.finished() for r in batch.reqs) or time.perf_counter_ns() - self._last_push_ns >= PUSH_INTERVAL_NS:
            self.flush()

    def record_batch(
        self, capture: StepCapture, batch: Optional[ScheduleBatch], tree_core: Optional[TreeCore] = None
    ) -> int:
        """Append the captured step that belongs to ``batch``; call before its result is processed.

        Args:
            tree_core: the radix tree core, for node ids (None: node_id -1).

        Returns:
            Rows appended.
        """
        if batch is None or not capture.pending or not batch.forward_mode.is_decode():
            return 0
        reqs = list(batch.reqs)
        match = None
        for i, step in enumerate(capture.pending):
            if self._belongs(step, reqs, batch):
                match = i
                break
        if match is None:
            return 0
        for _ in range(match):
            capture.pending.popleft()
            self.unmatched_steps += 1
        return self._append_step(capture.pending.popleft(), reqs, tree_core)

    @staticmethod
    def _belongs(step: CapturedStep, reqs: list[Req], batch: ScheduleBatch) -> bool:
        bs = int(step.importance.shape[0])
        if bs != len(reqs) or bs == 0:
            return False
        indptr = step.kv_indptr[: bs + 1].cpu().numpy()
        if np.any(indptr[1:] <= indptr[:-1]):
            return False
        # Under overlap scheduling a request finished by the previous result is still
        # in this batch with its KV row released; only the others can be checked.
        live = [i for i, r in enumerate(reqs) if r.kv.req_pool_idx is not None]
        if not live:
            return False
        first = step.kv_indices[indptr[live]].cpu().numpy()
        pool = batch.req_to_token_pool.req_to_token
        expected = pool[[reqs[i].kv.req_pool_idx for i in live], 0].cpu().numpy()
        return bool(np.array_equal(first.astype(np.int64), expected.astype(np.int64)))

    def _append_step(self, step: CapturedStep, reqs: list[Req], tree_core: Optional[TreeCore] = None) -> int:
        importance = step.importance.cpu().numpy()
        indptr = step.kv_indptr[: len(reqs) + 1].cpu().numpy().astype(np.int64)
        indices = step.kv_indices.cpu().numpy().astype(np.int64)
        live = [i for i, req in enumerate(reqs) if req.kv.req_pool_idx is not None and not req.finished()]
        paths = request_paths(tree_core, [reqs[i] for i in live])
        appended = 0
        for i, path in zip(live, paths):
            # (finished before this step: SGLang discards the step's token, so no rows)
            req = reqs[i]
            rid = str(req.rid)
            self._arrival.setdefault(rid, step.step)
            slots = indices[indptr[i] : indptr[i + 1] : step.page_size]
            n = min(slots.shape[0], importance.shape[1])
            if n == 0:
                continue
            if self.sent_rows + self._n + n > self.max_rows:
                self.dropped_rows += n
                continue
            code = self._code(rid)
            nodes = _page_nodes(path, n, step.page_size)
            start = 0
            while start < n:
                if self._n == self._buf.shape[0]:
                    self.flush()
                take = min(n - start, self._buf.shape[0] - self._n)
                out = self._buf[self._n : self._n + take]
                out["step"] = step.step
                out["time_ns"] = step.time_ns
                out["request_id"] = code
                out["page"] = slots[start : start + take] // step.page_size
                out["node_id"] = nodes[start : start + take]
                out["position"] = np.arange(start, start + take, dtype=np.int32)
                out["importance"] = importance[i, start : start + take]
                self._n += take
                start += take
            appended += n
        return appended

    def finish_requests(self, batch: Optional[ScheduleBatch], step: int, tree_core: Optional[TreeCore] = None) -> int:
        """Queue a ``requests`` row for each request ``batch`` finished; call after its result.

        Args:
            step: the decode step counter now (finish step; arrival of a request
                that never reached a recorded decode step).
            tree_core: the radix tree core, for the path (None: empty path).

        Returns:
            Rows queued.
        """
        if batch is None:
            return 0
        done = [r for r in batch.reqs if r.finished() and str(r.rid) not in self._reported]
        if not done:
            return 0
        now = time.perf_counter_ns()
        for req, path in zip(done, request_paths(tree_core, done)):
            rid = str(req.rid)
            self._reported[rid] = None
            if len(self._reported) > REPORTED_KEEP:
                del self._reported[next(iter(self._reported))]
            ids, starts, ends = path if path is not None else ([], [], [])
            recv = float(req.time_stats.scheduler_recv_time or 0.0)
            self._request_rows.append(
                {
                    "request_id": rid,
                    "arrival_step": self._arrival.pop(rid, step),
                    "finish_step": step,
                    "node_ids": ids,
                    "node_tokens": [e - s for s, e in zip(starts, ends)],
                    "output_tokens": len(req.output_ids),
                    "prompt_tokens": len(req.origin_input_ids),
                    "cached_tokens": int(req.cached_tokens),
                    "arrival_ns": int(recv * 1e9),
                    "finish_ns": now,
                }
            )
        return len(done)

    def _code(self, rid: str) -> int:
        rid = str(rid)
        code = self._codes.get(rid)
        if code is None:
            code = self._codes[rid] = len(self._codes)
            self._new_labels[code] = rid
        return code

    # -- to the writer ------------------------------------------------------------

    def _send(self, parts: list[bytes]) -> bool:
        try:
            self._sock.send_multipart(parts, flags=self._noblock)
            return True
        except self._zmq_again:
            return False

    def flush(self) -> None:
        """Push the buffered records (and new request labels) to the writer."""
        self._last_push_ns = time.perf_counter_ns()
        labelled = not self._new_labels
        if not labelled and self._send([b"labels", json.dumps(self._new_labels).encode()]):
            self._new_labels, labelled = {}, True
        if self._n:
            # Rows go only after their labels; the labels are retried on the next push.
            if labelled and self._send([b"rows", self._buf[: self._n].tobytes()]):
                self.sent_rows += self._n
            else:
                self.dropped_rows += self._n
                logger.warning("trace writer is behind; dropped %d rows", self._n)
            self._n = 0
        if self._request_rows:
            # Kept for the next push if the writer is behind: a few hundred bytes each.
            if self._send([b"requests", json.dumps(self._request_rows).encode()]):
                self._request_rows = []

    def close(self) -> None:
        """Push what is buffered and tell the writer to close the trace."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self.dropped_rows:
            self._send([b"dropped", str(self.dropped_rows).encode()])
        self._send([b"close"])
        self._sock.close(linger=5000)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


# -- radix paths ---------------------------------------------------------------------

RadixPath = tuple[list[int], list[int], list[int]]  # node ids, start and end offsets (tokens)


def request_paths(tree_core: Optional[TreeCore], reqs: list[Req]) -> list[Optional[RadixPath]]:
    """Each request's root-to-``last_node`` radix path, or None where it has none.

    One ``collect_path_info`` call for the batch; if a handle is gone (KeyError),
    the requests are asked one by one so the others still get their paths.
    """
    out: list[Optional[RadixPath]] = [None] * len(reqs)
    if tree_core is None or not hasattr(tree_core, "collect_path_info"):
        return out
    want = [(i, r.last_node) for i, r in enumerate(reqs) if isinstance(r.last_node, int)]
    if not want:
        return out
    try:
        infos = list(tree_core.collect_path_info([h for _, h in want]))
    except KeyError:
        infos = []
        for _, h in want:
            try:
                infos.append(tree_core.collect_path_info([h])[0])
            except KeyError:
                infos.append(None)
    for (i, _), info in zip(want, infos):
        if info:
            out[i] = (
                [int(x.node_id) for x in info],
                [int(x.path_start) for x in info],
                [int(x.path_end) for x in info],
            )
    return out


def _page_nodes(path: Optional[RadixPath], n_pages: int, page_size: int) -> np.ndarray:
    """Node id of each of a request's first ``n_pages`` pages; -1 past the path's end."""
    nodes = np.full(n_pages, -1, np.int64)
    if path is None or not path[0]:
        return nodes
    ids, _, ends = path
    offsets = np.arange(n_pages, dtype=np.int64) * page_size
    which = np.searchsorted(np.asarray(ends, np.int64), offsets, side="right")
    inside = which < len(ids)
    nodes[inside] = np.asarray(ids, np.int64)[which[inside]]
    return nodes
