"""On-disk format of page-access traces.

A trace is a directory::

    meta.json                   sidecar: page_size, model, workload, created, row counts
    accesses-00000.parquet      table "accesses", rotated into more files when large
    accesses-00001.parquet
    requests-00000.parquet      table "requests" (prefix-cache regime), optional

Table ``accesses`` has one row per (decode step, request, layer, kv_head, page):

=============  ========  ====================================================================
column         type      meaning
=============  ========  ====================================================================
step           int64     scheduler decode iteration (global, shared by a batch)
time_ns        int64     wall clock of the step (``time.monotonic_ns``), 0 if unknown
request_id     int64 or  request identity; one type per trace (strings are dictionary-coded
               string    to int64 codes on read, the labels kept in ``Trace.request_labels``)
turn           int32     conversation turn of the request, 0 if unknown
layer          int16     model layer, -1 = reduced over layers
kv_head        int16     KV head, -1 = reduced over heads
page           int64     stable logical page id, opaque to readers (the recorder uses
                         ``node_id * 2**20 + page offset`` or the physical page)
node_id        int64     radix-tree node holding the page, -1 unknown
position       int32     index of the page within the request's sequence, -1 unknown
importance     float32   softmax mass of the page at this step; sums to ~1 over the pages
                         of one (step, request, layer, kv_head)
=============  ========  ====================================================================

Table ``requests`` has one row per request arrival, listing its radix path:

=============  ============  ==============================================================
request_id     int64/string  same identity as in ``accesses``
arrival_step   int64         decode step at which the request was scheduled
node_ids       list<int64>   radix path root -> leaf (root excluded); parent of
                             ``node_ids[i]`` is ``node_ids[i-1]``
node_tokens    list<int32>   token count of each node on the path
output_tokens  int32         tokens the request generated
=============  ============  ==============================================================

Writers: :func:`write_trace` / :func:`write_requests` for whole tables, and
:class:`TraceWriter` for streaming with a row-count bound (rotates files, and
once the bound is hit drops further rows with one warning, counting them in
``meta.json``). Readers: :func:`read_trace`, :func:`read_requests`,
:func:`read_meta`, :func:`read_all`; they return numpy struct-of-arrays.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_NAME = "sgl-importance-trace"
FORMAT_VERSION = 1
META_FILE = "meta.json"
ACCESS_PREFIX = "accesses"
REQUEST_PREFIX = "requests"

# Column -> numpy dtype. request_id is handled apart: int64 or string.
ACCESS_DTYPES: dict[str, np.dtype] = {
    "step": np.dtype(np.int64),
    "time_ns": np.dtype(np.int64),
    "request_id": np.dtype(np.int64),
    "turn": np.dtype(np.int32),
    "layer": np.dtype(np.int16),
    "kv_head": np.dtype(np.int16),
    "page": np.dtype(np.int64),
    "node_id": np.dtype(np.int64),
    "position": np.dtype(np.int32),
    "importance": np.dtype(np.float32),
}
ACCESS_REQUIRED = ("step", "request_id", "page", "importance")
# Recorders may leave these out; the value says "unknown" or "reduced".
ACCESS_DEFAULTS: dict[str, int] = {
    "time_ns": 0,
    "turn": 0,
    "layer": -1,
    "kv_head": -1,
    "node_id": -1,
    "position": -1,
}

_ARROW_TYPES = {
    np.dtype(np.int64): pa.int64(),
    np.dtype(np.int32): pa.int32(),
    np.dtype(np.int16): pa.int16(),
    np.dtype(np.float32): pa.float32(),
}


def access_schema(string_ids: bool = False) -> pa.Schema:
    """Arrow schema of the ``accesses`` table (request_id as string or int64)."""
    cols = []
    for name, dt in ACCESS_DTYPES.items():
        typ = pa.string() if (name == "request_id" and string_ids) else _ARROW_TYPES[dt]
        cols.append(pa.field(name, typ, nullable=False))
    return pa.schema(cols)


def request_schema(string_ids: bool = False) -> pa.Schema:
    """Arrow schema of the ``requests`` table."""
    return pa.schema(
        [
            pa.field("request_id", pa.string() if string_ids else pa.int64(), nullable=False),
            pa.field("arrival_step", pa.int64(), nullable=False),
            pa.field("node_ids", pa.list_(pa.int64()), nullable=False),
            pa.field("node_tokens", pa.list_(pa.int32()), nullable=False),
            pa.field("output_tokens", pa.int32(), nullable=False),
        ]
    )


@dataclass
class TraceMeta:
    """The JSON sidecar. ``extra`` carries anything else a recorder wants kept."""

    page_size: int = 16
    model: str = ""
    workload: str = ""
    created: str = ""
    access_rows: int = 0
    request_rows: int = 0
    dropped_rows: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "TraceMeta":
        if obj.get("format", FORMAT_NAME) != FORMAT_NAME:
            raise ValueError(f"not a {FORMAT_NAME} sidecar: format={obj.get('format')!r}")
        if int(obj.get("version", FORMAT_VERSION)) > FORMAT_VERSION:
            raise ValueError(f"trace format version {obj['version']} is newer than {FORMAT_VERSION}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Trace:
    """The ``accesses`` table as numpy arrays of equal length (one per column).

    ``request_id`` is always int64: the ids themselves when the trace stores
    integers, otherwise codes into ``request_labels``.
    """

    step: np.ndarray
    time_ns: np.ndarray
    request_id: np.ndarray
    turn: np.ndarray
    layer: np.ndarray
    kv_head: np.ndarray
    page: np.ndarray
    node_id: np.ndarray
    position: np.ndarray
    importance: np.ndarray
    request_labels: np.ndarray | None = None
    meta: TraceMeta = field(default_factory=TraceMeta)

    def __len__(self) -> int:
        return int(self.step.shape[0])

    @classmethod
    def from_columns(
        cls, columns: Mapping[str, Any], meta: TraceMeta | None = None
    ) -> "Trace":
        """Build from a mapping of column name -> array-like; optional columns get defaults.

        String request ids are dictionary-coded (sorted labels).
        """
        cols, labels = _normalise_access_columns(columns)
        return cls(**cols, request_labels=labels, meta=meta or TraceMeta())

    def columns(self) -> dict[str, np.ndarray]:
        """Column name -> array, with request ids decoded back to labels if any."""
        out = {name: getattr(self, name) for name in ACCESS_DTYPES}
        if self.request_labels is not None:
            out["request_id"] = self.request_labels[self.request_id]
        return out

    def take(self, index: np.ndarray) -> "Trace":
        """Rows selected by a boolean mask or an index array."""
        cols = {name: getattr(self, name)[index] for name in ACCESS_DTYPES}
        return Trace(**cols, request_labels=self.request_labels, meta=self.meta)


@dataclass
class Requests:
    """The ``requests`` table; the per-request lists are stored CSR style.

    Request ``i`` has path ``node_ids[node_ptr[i]:node_ptr[i+1]]`` with token
    counts ``node_tokens[...]`` over the same slice.
    """

    request_id: np.ndarray
    arrival_step: np.ndarray
    node_ptr: np.ndarray
    node_ids: np.ndarray
    node_tokens: np.ndarray
    output_tokens: np.ndarray
    request_labels: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.request_id.shape[0])

    def path(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.node_ptr[i], self.node_ptr[i + 1]
        return self.node_ids[lo:hi], self.node_tokens[lo:hi]

    @classmethod
    def from_lists(
        cls,
        request_id: Sequence[Any],
        arrival_step: Sequence[int],
        node_ids: Sequence[Sequence[int]],
        node_tokens: Sequence[Sequence[int]],
        output_tokens: Sequence[int],
    ) -> "Requests":
        if not (len(request_id) == len(arrival_step) == len(node_ids) == len(node_tokens) == len(output_tokens)):
            raise ValueError("requests: all columns need the same number of rows")
        lens = np.fromiter((len(p) for p in node_ids), np.int64, len(node_ids))
        if not np.array_equal(lens, np.fromiter((len(t) for t in node_tokens), np.int64, len(node_tokens))):
            raise ValueError("requests: node_ids and node_tokens differ in length on some row")
        ptr = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=ptr[1:])
        flat_ids = np.fromiter((x for p in node_ids for x in p), np.int64, int(ptr[-1]))
        flat_tok = np.fromiter((x for p in node_tokens for x in p), np.int32, int(ptr[-1]))
        codes, labels = _code_ids(request_id)
        return cls(
            request_id=codes,
            arrival_step=np.asarray(arrival_step, np.int64),
            node_ptr=ptr,
            node_ids=flat_ids,
            node_tokens=flat_tok,
            output_tokens=np.asarray(output_tokens, np.int32),
            request_labels=labels,
        )


def _code_ids(ids: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """int64 ids pass through; anything else is dictionary-coded over sorted labels."""
    arr = np.asarray(ids)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64, copy=False), None
    if arr.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, dtype=object)
    labels, codes = np.unique(arr.astype(str), return_inverse=True)
    return codes.astype(np.int64), labels.astype(object)


def _normalise_access_columns(columns: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    missing = [c for c in ACCESS_REQUIRED if c not in columns]
    if missing:
        raise ValueError(f"accesses: missing required column(s) {missing}")
    unknown = set(columns) - set(ACCESS_DTYPES)
    if unknown:
        raise ValueError(f"accesses: unknown column(s) {sorted(unknown)}")
    n = len(columns["step"])
    out: dict[str, np.ndarray] = {}
    labels = None
    for name, dt in ACCESS_DTYPES.items():
        if name == "request_id":
            out[name], labels = _code_ids(columns[name])
        elif name in columns:
            out[name] = np.asarray(columns[name]).astype(dt, copy=False)
        else:
            out[name] = np.full(n, ACCESS_DEFAULTS[name], dt)
        if out[name].shape != (n,):
            raise ValueError(f"accesses: column {name!r} has shape {out[name].shape}, expected ({n},)")
    return out, labels


def _access_table(cols: Mapping[str, np.ndarray], string_ids: bool) -> pa.Table:
    arrays = []
    for name in ACCESS_DTYPES:
        col = cols[name]
        if name == "request_id" and string_ids:
            arrays.append(pa.array(np.asarray(col).astype(str), pa.string()))
        else:
            arrays.append(pa.array(col))
    return pa.Table.from_arrays(arrays, schema=access_schema(string_ids))


def _request_table(req: Requests) -> pa.Table:
    string_ids = req.request_labels is not None
    ids = req.request_labels[req.request_id].astype(str) if string_ids else req.request_id
    offsets = pa.array(req.node_ptr.astype(np.int32))
    return pa.Table.from_arrays(
        [
            pa.array(ids, pa.string() if string_ids else pa.int64()),
            pa.array(req.arrival_step.astype(np.int64)),
            pa.ListArray.from_arrays(offsets, pa.array(req.node_ids.astype(np.int64))),
            pa.ListArray.from_arrays(offsets, pa.array(req.node_tokens.astype(np.int32))),
            pa.array(req.output_tokens.astype(np.int32)),
        ],
        schema=request_schema(string_ids),
    )


def write_meta(path: str | os.PathLike, meta: TraceMeta) -> None:
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta.to_json(), indent=1, sort_keys=True))
    # Atomic rename: a reader never sees half a sidecar.
    tmp.replace(d / META_FILE)


def read_meta(path: str | os.PathLike) -> TraceMeta:
    f = Path(path) / META_FILE
    if not f.exists():
        return TraceMeta()
    return TraceMeta.from_json(json.loads(f.read_text()))


def write_trace(path: str | os.PathLike, trace: Trace, meta: TraceMeta | None = None) -> None:
    """Write a whole ``accesses`` table (one file) and the sidecar.

    Args:
        path: trace directory, created if needed; existing access files are replaced.
        trace: the rows.
        meta: sidecar; defaults to ``trace.meta``. Row counts are filled in.
    """
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob(f"{ACCESS_PREFIX}-*.parquet"):
        old.unlink()
    string_ids = trace.request_labels is not None
    pq.write_table(_access_table(trace.columns(), string_ids), d / f"{ACCESS_PREFIX}-00000.parquet")
    meta = meta or trace.meta
    old_meta = read_meta(d)
    meta.access_rows = len(trace)
    meta.request_rows = old_meta.request_rows
    meta.created = meta.created or _now_iso()
    write_meta(d, meta)


def write_requests(path: str | os.PathLike, requests: Requests) -> None:
    """Write a whole ``requests`` table (one file) and update the sidecar's count."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob(f"{REQUEST_PREFIX}-*.parquet"):
        old.unlink()
    pq.write_table(_request_table(requests), d / f"{REQUEST_PREFIX}-00000.parquet")
    meta = read_meta(d)
    meta.request_rows = len(requests)
    meta.created = meta.created or _now_iso()
    write_meta(d, meta)


def _files(path: str | os.PathLike, prefix: str) -> list[Path]:
    return sorted(Path(path).glob(f"{prefix}-*.parquet"))


def _read_tables(path: str | os.PathLike, prefix: str) -> pa.Table | None:
    files = _files(path, prefix)
    if not files:
        return None
    tables = [pq.read_table(f) for f in files]
    # Files of one trace share a schema; promote anyway so an int/string mix fails clearly.
    return pa.concat_tables(tables, promote_options="none")


def _col(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).combine_chunks().to_numpy(zero_copy_only=False)


def _raw_trace(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    table = _read_tables(path, ACCESS_PREFIX)
    if table is None:
        return None
    cols = {name: _col(table, name).astype(dt, copy=False) for name, dt in ACCESS_DTYPES.items() if name != "request_id"}
    return cols, _col(table, "request_id")


def _raw_requests(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    table = _read_tables(path, REQUEST_PREFIX)
    if table is None:
        return None
    ids_list = table.column("node_ids").combine_chunks()
    tok_list = table.column("node_tokens").combine_chunks()
    # Lists are read in bulk through their offsets: no per-row Python.
    ptr = ids_list.offsets.to_numpy().astype(np.int64)
    node_ids = ids_list.values.to_numpy().astype(np.int64)
    node_tokens = tok_list.values.to_numpy().astype(np.int32)
    if ptr[0] != 0:
        node_ids, node_tokens, ptr = node_ids[ptr[0]:ptr[-1]], node_tokens[ptr[0]:ptr[-1]], ptr - ptr[0]
    cols = {
        "arrival_step": _col(table, "arrival_step").astype(np.int64),
        "node_ptr": ptr,
        "node_ids": node_ids,
        "node_tokens": node_tokens,
        "output_tokens": _col(table, "output_tokens").astype(np.int32),
    }
    return cols, _col(table, "request_id")


def read_trace(path: str | os.PathLike) -> Trace:
    """Read all ``accesses`` files of a trace directory into one :class:`Trace`."""
    raw = _raw_trace(path)
    if raw is None:
        raise FileNotFoundError(f"no {ACCESS_PREFIX}-*.parquet in {path}")
    cols, ids = raw
    codes, labels = _code_ids(ids)
    return Trace(**cols, request_id=codes, request_labels=labels, meta=read_meta(path))


def read_requests(path: str | os.PathLike) -> Requests:
    """Read the ``requests`` table of a trace directory."""
    raw = _raw_requests(path)
    if raw is None:
        raise FileNotFoundError(f"no {REQUEST_PREFIX}-*.parquet in {path}")
    cols, ids = raw
    codes, labels = _code_ids(ids)
    return Requests(request_id=codes, request_labels=labels, **cols)


@dataclass
class TraceSet:
    """Everything in a trace directory; either table may be absent."""

    meta: TraceMeta
    accesses: Trace | None
    requests: Requests | None


def read_all(path: str | os.PathLike) -> TraceSet:
    """Read both tables; string request ids get one code space shared by the two."""
    ra, rr = _raw_trace(path), _raw_requests(path)
    meta = read_meta(path)
    id_arrays = [r[1] for r in (ra, rr) if r is not None]
    string_ids = any(np.asarray(a).dtype.kind not in "iu" for a in id_arrays)
    labels = None
    if string_ids:
        labels = np.unique(np.concatenate([np.asarray(a).astype(str) for a in id_arrays])).astype(object)

    def code(a: np.ndarray) -> np.ndarray:
        if labels is None:
            return np.asarray(a).astype(np.int64)
        return np.searchsorted(labels.astype(str), np.asarray(a).astype(str)).astype(np.int64)

    acc = req = None
    if ra is not None:
        acc = Trace(**ra[0], request_id=code(ra[1]), request_labels=labels, meta=meta)
    if rr is not None:
        req = Requests(request_id=code(rr[1]), request_labels=labels, **rr[0])
    return TraceSet(meta=meta, accesses=acc, requests=req)


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
        if _files(self.path, ACCESS_PREFIX) or _files(self.path, REQUEST_PREFIX):
            raise FileExistsError(f"{self.path} already holds a trace")
        self.meta = meta or TraceMeta()
        self.meta.created = self.meta.created or _now_iso()
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
            part = {k: v[start:start + room] for k, v in merged.items()}
            rows = len(part["step"])
            self._writer.write_table(_access_table(part, bool(self._string_ids)))
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
        self._req_writer.write_table(_request_table(requests))
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
