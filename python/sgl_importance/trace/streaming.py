"""Streaming trace writer: access rows appended in batches, under a row-count bound.

:class:`TraceWriter` buffers rows into Parquet row groups, rotates to a new
``accesses-NNNNN.parquet`` file every ``rows_per_file`` rows, and once ``max_rows``
is reached drops further rows with one warning (the count kept in ``meta.json``),
so a forgotten recorder cannot fill the disk. The writer *process* that feeds it
from the scheduler is ``trace.writer_process``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow.parquet as pq

from sgl_importance.trace.schema import (
    ACCESS_DEFAULTS,
    ACCESS_DTYPES,
    ACCESS_PREFIX,
    REQUEST_PREFIX,
    TraceMeta,
    access_schema,
    now_iso,
    request_schema,
)
from sgl_importance.trace.table_io import (
    access_arrow_table,
    request_arrow_table,
    table_files,
    write_meta,
)
from sgl_importance.trace.tables import Requests


class TraceWriter:
    """Streaming writer with a row-count bound.

    Rows are buffered and flushed as Parquet row groups; a new file starts every
    ``rows_per_file`` rows so no file grows without end; after ``max_rows``
    access rows further rows are dropped (one warning, the count kept in the
    sidecar) so a forgotten recorder cannot fill the disk.

    Args:
        path: trace directory (created).
        meta: sidecar contents; row counts are maintained by the writer.
        max_rows: bound on access rows kept; None = unbounded.
        rows_per_file: rotate to a new ``accesses-NNNNN.parquet`` after this many rows.
        row_group_rows: buffer size before a row group is written.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        meta: TraceMeta | None = None,
        *,
        max_rows: int | None = 50_000_000,
        rows_per_file: int = 5_000_000,
        row_group_rows: int = 262_144,
    ) -> None:
        if rows_per_file <= 0 or row_group_rows <= 0:
            raise ValueError("rows_per_file and row_group_rows must be positive")
        if max_rows is not None and max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 or None, got {max_rows}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        if table_files(self.path, ACCESS_PREFIX) or table_files(self.path, REQUEST_PREFIX):
            raise FileExistsError(f"{self.path} already holds a trace")
        self.meta = meta or TraceMeta()
        self.meta.created = self.meta.created or now_iso()
        self.max_rows = max_rows
        self.rows_per_file = rows_per_file
        self.row_group_rows = row_group_rows
        self._string_ids: bool | None = None
        self._req_string_ids: bool | None = None
        self._buf: list[dict[str, np.ndarray]] = []
        self._buf_rows = 0
        self._file_rows = 0
        self._file_index = 0
        self._writer: pq.ParquetWriter | None = None
        self._req_writer: pq.ParquetWriter | None = None
        self._warned = False
        self._closed = False
        write_meta(self.path, self.meta)

    # -- accesses ---------------------------------------------------------------
    def append(self, columns: Mapping[str, Any]) -> int:
        """Append a batch of access rows (column name -> array-like).

        Returns:
            The number of rows kept (less than given once the bound is hit).
        """
        if self._closed:
            raise RuntimeError("TraceWriter is closed")
        n = len(columns["step"]) if "step" in columns else 0
        if n == 0:
            return 0
        keep = n
        if self.max_rows is not None:
            keep = max(0, min(n, self.max_rows - self.meta.access_rows))
        if keep < n:
            self.meta.dropped_rows += n - keep
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"trace {self.path}: row bound max_rows={self.max_rows} reached; further rows are dropped",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if keep == 0:
            return 0
        ids = np.asarray(columns["request_id"])
        string_ids = ids.dtype.kind not in "iu"
        if self._string_ids is None:
            self._string_ids = string_ids
        elif self._string_ids != string_ids:
            raise TypeError("request_id changed between int64 and string within one trace")
        cols = {}
        for name, dt in ACCESS_DTYPES.items():
            if name == "request_id":
                v = ids.astype(str) if string_ids else ids.astype(np.int64, copy=False)
            elif name in columns:
                v = np.asarray(columns[name]).astype(dt, copy=False)
            else:
                v = np.full(n, ACCESS_DEFAULTS[name], dt)
            if v.shape != (n,):
                raise ValueError(f"accesses: column {name!r} has shape {v.shape}, expected ({n},)")
            cols[name] = v[:keep]
        self._buf.append(cols)
        self._buf_rows += keep
        self.meta.access_rows += keep
        if self._buf_rows >= self.row_group_rows:
            self._flush()
        return keep

    def _flush(self) -> None:
        if not self._buf:
            return
        merged = {name: np.concatenate([b[name] for b in self._buf]) for name in ACCESS_DTYPES}
        self._buf, self._buf_rows = [], 0
        start = 0
        total = len(merged["step"])
        while start < total:
            if self._writer is None:
                fname = self.path / f"{ACCESS_PREFIX}-{self._file_index:05d}.parquet"
                self._writer = pq.ParquetWriter(fname, access_schema(bool(self._string_ids)))
                self._file_rows = 0
            room = self.rows_per_file - self._file_rows
            part = {k: v[start : start + room] for k, v in merged.items()}
            rows = len(part["step"])
            self._writer.write_table(access_arrow_table(part, bool(self._string_ids)))
            self._file_rows += rows
            start += rows
            if self._file_rows >= self.rows_per_file:
                self._writer.close()
                self._writer = None
                self._file_index += 1

    # -- requests -------------------------------------------------------------
    def append_requests(self, requests: Requests) -> None:
        """Append request-arrival rows (the prefix-cache table)."""
        if self._closed:
            raise RuntimeError("TraceWriter is closed")
        string_ids = requests.request_labels is not None
        if self._req_writer is None:
            self._req_string_ids = string_ids
            self._req_writer = pq.ParquetWriter(
                self.path / f"{REQUEST_PREFIX}-00000.parquet", request_schema(string_ids)
            )
        elif self._req_string_ids != string_ids:
            raise TypeError("request_id changed between int64 and string within one trace")
        self._req_writer.write_table(request_arrow_table(requests))
        self.meta.request_rows += len(requests)

    def close(self) -> None:
        """Flush buffers, close files and write the final sidecar."""
        if self._closed:
            return
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._req_writer is not None:
            self._req_writer.close()
            self._req_writer = None
        write_meta(self.path, self.meta)
        self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
