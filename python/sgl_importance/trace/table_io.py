"""Reading and writing whole trace tables (Parquet files and the JSON sidecar).

Writers: :func:`write_accesses` / :func:`write_requests` replace a table with one
file; :func:`write_meta` writes the sidecar atomically. Readers:
:func:`read_accesses`, :func:`read_requests`, :func:`read_meta`, :func:`read_all`
(both tables with one code space for string request ids). For streaming with a
row bound see ``trace.streaming``; the files' layout is ``trace.schema``'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sgl_importance.trace.schema import (
    ACCESS_DTYPES,
    ACCESS_PREFIX,
    META_FILE,
    REQUEST_EXTRA,
    REQUEST_PREFIX,
    TraceMeta,
    access_schema,
    now_iso,
    request_schema,
)
from sgl_importance.trace.tables import Accesses, Requests, TraceSet, code_ids


def access_arrow_table(cols: Mapping[str, np.ndarray], string_ids: bool) -> pa.Table:
    arrays = []
    for name in ACCESS_DTYPES:
        col = cols[name]
        if name == "request_id" and string_ids:
            arrays.append(pa.array(np.asarray(col).astype(str), pa.string()))
        else:
            arrays.append(pa.array(col))
    return pa.Table.from_arrays(arrays, schema=access_schema(string_ids))


def request_arrow_table(req: Requests) -> pa.Table:
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
            *[pa.array(getattr(req, name).astype(dt)) for name, (dt, _) in REQUEST_EXTRA.items()],
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


def write_accesses(path: str | os.PathLike, trace: Accesses, meta: TraceMeta | None = None) -> None:
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
    pq.write_table(access_arrow_table(trace.columns(), string_ids), d / f"{ACCESS_PREFIX}-00000.parquet")
    meta = meta or trace.meta
    old_meta = read_meta(d)
    meta.access_rows = len(trace)
    meta.request_rows = old_meta.request_rows
    meta.created = meta.created or now_iso()
    write_meta(d, meta)


def write_requests(path: str | os.PathLike, requests: Requests) -> None:
    """Write a whole ``requests`` table (one file) and update the sidecar's count."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob(f"{REQUEST_PREFIX}-*.parquet"):
        old.unlink()
    pq.write_table(request_arrow_table(requests), d / f"{REQUEST_PREFIX}-00000.parquet")
    meta = read_meta(d)
    meta.request_rows = len(requests)
    meta.created = meta.created or now_iso()
    write_meta(d, meta)


def table_files(path: str | os.PathLike, prefix: str) -> list[Path]:
    return sorted(Path(path).glob(f"{prefix}-*.parquet"))


def _read_tables(path: str | os.PathLike, prefix: str) -> pa.Table | None:
    files = table_files(path, prefix)
    if not files:
        return None
    tables = [pq.read_table(f) for f in files]
    # Files of one trace share a schema; promote anyway so an int/string mix fails clearly.
    return pa.concat_tables(tables, promote_options="none")


def _col(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).combine_chunks().to_numpy(zero_copy_only=False)


def _raw_accesses(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    table = _read_tables(path, ACCESS_PREFIX)
    if table is None:
        return None
    cols = {
        name: _col(table, name).astype(dt, copy=False) for name, dt in ACCESS_DTYPES.items() if name != "request_id"
    }
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
        node_ids, node_tokens, ptr = node_ids[ptr[0] : ptr[-1]], node_tokens[ptr[0] : ptr[-1]], ptr - ptr[0]
    cols = {
        "arrival_step": _col(table, "arrival_step").astype(np.int64),
        "node_ptr": ptr,
        "node_ids": node_ids,
        "node_tokens": node_tokens,
        "output_tokens": _col(table, "output_tokens").astype(np.int32),
    }
    names = set(table.column_names)
    for name, (dt, _) in REQUEST_EXTRA.items():
        # Absent in version-1 traces: Requests fills the "unknown" value.
        cols[name] = _col(table, name).astype(dt) if name in names else None
    return cols, _col(table, "request_id")


def _coded(raw: Any, prefix: str, path: str | os.PathLike) -> dict[str, Any]:
    """A table's columns with its request ids coded (``request_id``, ``request_labels``)."""
    if raw is None:
        raise FileNotFoundError(f"no {prefix}-*.parquet in {path}")
    cols, ids = raw
    codes, labels = code_ids(ids)
    return {**cols, "request_id": codes, "request_labels": labels}


def read_accesses(path: str | os.PathLike) -> Accesses:
    """Read all ``accesses`` files of a trace directory into one :class:`Accesses`."""
    return Accesses(**_coded(_raw_accesses(path), ACCESS_PREFIX, path), meta=read_meta(path))


def read_requests(path: str | os.PathLike) -> Requests:
    """Read the ``requests`` table of a trace directory."""
    return Requests(**_coded(_raw_requests(path), REQUEST_PREFIX, path))


def read_all(path: str | os.PathLike) -> TraceSet:
    """Read both tables; string request ids get one code space shared by the two."""
    ra, rr = _raw_accesses(path), _raw_requests(path)
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
        acc = Accesses(**ra[0], request_id=code(ra[1]), request_labels=labels, meta=meta)
    if rr is not None:
        req = Requests(request_id=code(rr[1]), request_labels=labels, **rr[0])
    return TraceSet(meta=meta, accesses=acc, requests=req)
