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
time_ns        int64     clock of the step (``time.perf_counter_ns``), 0 if unknown
request_id     int64 or  request identity; one type per trace (strings are dictionary-coded
               string    to int64 codes on read, the labels kept in ``Trace.request_labels``)
turn           int32     conversation turn of the request (see :func:`parse_rid`), 0 if unknown
layer          int16     model layer, -1 = reduced over layers
kv_head        int16     KV head, -1 = reduced over heads
page           int64     stable page id, opaque to readers (live traces: the physical KV
                         page, stable while the request runs; synthetic traces:
                         ``node_id * 2**20 + page offset``)
node_id        int64     radix-tree node holding the page, -1 unknown (see below)
position       int32     index of the page within the request's sequence, -1 unknown
importance     float32   softmax mass of the page at this step; sums to ~1 over the pages
                         of one (step, request, layer, kv_head)
=============  ========  ====================================================================

Table ``requests`` has one row per request, listing its radix path:

=============  ============  ==============================================================
request_id     int64/string  same identity as in ``accesses``
arrival_step   int64         decode step at which the request was first seen decoding (or,
                             if it never decoded, at which it finished); replay order
node_ids       list<int64>   radix path root -> leaf (root excluded); parent of
                             ``node_ids[i]`` is ``node_ids[i-1]``
node_tokens    list<int32>   token count of each node on the path
output_tokens  int32         tokens the request generated
conversation   int32         conversation the request belongs to, -1 unknown
turn           int32         turn within the conversation, 0 unknown
prompt_tokens  int32         prompt length in tokens, -1 unknown
cached_tokens  int32         prompt tokens the server matched in its prefix cache, -1 unknown
finish_step    int64         decode step at which the request finished, -1 unknown
arrival_ns     int64         the scheduler received it (``time.perf_counter_ns`` clock), 0 unknown
finish_ns      int64         it finished (same clock), 0 unknown
=============  ============  ==============================================================

The columns after ``output_tokens`` came with format version 2; readers fill
them with the "unknown" values for version-1 traces.

Conversation and turn come from the request id: an id ending in
``-c<conversation>-t<turn>`` (e.g. ``chat-c2-t3``) names both (:func:`parse_rid`);
the trace generators name their requests that way, so no header is needed.

Radix node ids (live traces). The recorder writes SGLang's own node ids
(``node.id`` of the unified radix tree, read with ``collect_path_info`` from each
request's ``last_node``): in ``accesses`` the node holding the page at that step
(by the page's token offset ``position * page_size`` on the request's path; -1
for pages not in the tree yet, i.e. tokens generated since the last insert), in
``requests`` the path when the request finished (its prompt and its output, after
SGLang inserted them). SGLang splits a node in place: the suffix keeps the id
and a new node takes the prefix, so a node's end offset on the path never
changes while its start can only grow. Paths recorded before a split therefore
name the unsplit node; :func:`resolve_splits` rewrites every path and access row
to the finest split seen anywhere in the trace, after which every node has one
parent and requests sharing a prefix share the node ids of the shared pages.
Synthetic traces are already in that form (resolution leaves them unchanged).

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
import re
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_NAME = "sgl-importance-trace"
FORMAT_VERSION = 2
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


# Per-request scalar columns after the path, with their type and "unknown" value
# (version-1 traces lack them; readers fill these).
REQUEST_EXTRA: dict[str, tuple[np.dtype, int]] = {
    "conversation": (np.dtype(np.int32), -1),
    "turn": (np.dtype(np.int32), 0),
    "prompt_tokens": (np.dtype(np.int32), -1),
    "cached_tokens": (np.dtype(np.int32), -1),
    "finish_step": (np.dtype(np.int64), -1),
    "arrival_ns": (np.dtype(np.int64), 0),
    "finish_ns": (np.dtype(np.int64), 0),
}

RID_RE = re.compile(r"-c(\d+)-t(\d+)$")


def parse_rid(rid: Any) -> tuple[int, int]:
    """(conversation, turn) named by a request id ending in ``-c<conv>-t<turn>``, else (-1, 0)."""
    m = RID_RE.search(str(rid))
    return (int(m.group(1)), int(m.group(2))) if m else (-1, 0)


def request_schema(string_ids: bool = False) -> pa.Schema:
    """Arrow schema of the ``requests`` table."""
    return pa.schema(
        [
            pa.field("request_id", pa.string() if string_ids else pa.int64(), nullable=False),
            pa.field("arrival_step", pa.int64(), nullable=False),
            pa.field("node_ids", pa.list_(pa.int64()), nullable=False),
            pa.field("node_tokens", pa.list_(pa.int32()), nullable=False),
            pa.field("output_tokens", pa.int32(), nullable=False),
            *[pa.field(name, _ARROW_TYPES[dt], nullable=False) for name, (dt, _) in REQUEST_EXTRA.items()],
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
    counts ``node_tokens[...]`` over the same slice. The columns of
    ``REQUEST_EXTRA`` default to their "unknown" value when not given.
    """

    request_id: np.ndarray
    arrival_step: np.ndarray
    node_ptr: np.ndarray
    node_ids: np.ndarray
    node_tokens: np.ndarray
    output_tokens: np.ndarray
    request_labels: np.ndarray | None = None
    conversation: np.ndarray | None = None
    turn: np.ndarray | None = None
    prompt_tokens: np.ndarray | None = None
    cached_tokens: np.ndarray | None = None
    finish_step: np.ndarray | None = None
    arrival_ns: np.ndarray | None = None
    finish_ns: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = self.request_id.shape[0]
        for name, (dt, unknown) in REQUEST_EXTRA.items():
            v = getattr(self, name)
            v = np.full(n, unknown, dt) if v is None else np.asarray(v).astype(dt, copy=False)
            if v.shape != (n,):
                raise ValueError(f"requests: column {name!r} has shape {v.shape}, expected ({n},)")
            setattr(self, name, v)

    def __len__(self) -> int:
        return int(self.request_id.shape[0])

    def path(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.node_ptr[i], self.node_ptr[i + 1]
        return self.node_ids[lo:hi], self.node_tokens[lo:hi]

    def labels(self) -> np.ndarray:
        """Request ids as given (strings decoded from their codes)."""
        return self.request_id if self.request_labels is None else self.request_labels[self.request_id]

    @classmethod
    def from_lists(
        cls,
        request_id: Sequence[Any],
        arrival_step: Sequence[int],
        node_ids: Sequence[Sequence[int]],
        node_tokens: Sequence[Sequence[int]],
        output_tokens: Sequence[int],
        **extra: Sequence[int],
    ) -> "Requests":
        """Build from one list per column; ``extra`` takes the ``REQUEST_EXTRA`` columns."""
        if not (len(request_id) == len(arrival_step) == len(node_ids) == len(node_tokens) == len(output_tokens)):
            raise ValueError("requests: all columns need the same number of rows")
        unknown = set(extra) - set(REQUEST_EXTRA)
        if unknown:
            raise ValueError(f"requests: unknown column(s) {sorted(unknown)}")
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
            **{k: np.asarray(v) for k, v in extra.items()},
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
    names = set(table.column_names)
    for name, (dt, _) in REQUEST_EXTRA.items():
        # Absent in version-1 traces: Requests fills the "unknown" value.
        cols[name] = _col(table, name).astype(dt) if name in names else None
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


def resolve_splits(
    requests: Requests, accesses: Trace | None = None, page_size: int | None = None
) -> tuple[Requests, Trace | None]:
    """Rewrite paths and access rows recorded before a radix split to the finest split seen.

    SGLang splits a node by giving its prefix to a new parent and keeping the id on
    the suffix, so a node's end offset is fixed and its final start is the largest
    start any path shows for it; its final parent is the parent in that path. An
    entry that covered more (an earlier start) becomes the chain of final
    ancestors covering the same tokens. A piece no recorded path names (its
    request was never recorded) becomes a new node id above the largest one.

    Args:
        requests: the ``requests`` table.
        accesses: the ``accesses`` table; rows are re-assigned by token offset
            ``position * page_size`` (rows without a position keep their node).
        page_size: tokens per page; default ``accesses.meta.page_size``.

    Returns:
        Both tables rewritten (the inputs themselves when nothing was split).
    """
    ptr = requests.node_ptr
    ids = requests.node_ids.astype(np.int64)
    tok = requests.node_tokens.astype(np.int64)
    n_ent = ids.shape[0]
    if n_ent == 0:
        return requests, accesses
    lens = np.diff(ptr)
    row_start = np.repeat(ptr[:-1], lens)
    csum = np.cumsum(tok)
    end = csum - np.repeat(np.concatenate([[0], csum])[ptr[:-1]], lens)
    start = end - tok
    first = np.arange(n_ent) == row_start
    parent = np.where(first, -1, np.concatenate([[-1], ids[:-1]]))

    uniq, inv = np.unique(ids, return_inverse=True)
    inv = inv.reshape(-1)
    node_end = np.full(uniq.shape[0], -1, np.int64)
    node_end[inv] = end
    if (node_end[inv] != end).any():
        warnings.warn("resolve_splits: a node id ends at different offsets in different paths; "
                      "node ids do not follow SGLang's split rule, paths left as recorded", RuntimeWarning)
        return requests, accesses
    final_start = np.full(uniq.shape[0], -1, np.int64)
    np.maximum.at(final_start, inv, start)
    if (start == final_start[inv]).all():
        return requests, accesses
    final_parent = np.full(uniq.shape[0], -1, np.int64)
    at_final = start == final_start[inv]
    final_parent[inv[at_final]] = parent[at_final]
    index = {int(n): i for i, n in enumerate(uniq)}
    S, E, P = final_start.tolist(), node_end.tolist(), final_parent.tolist()
    next_id = int(uniq.max()) + 1
    gaps: dict[tuple[int, int], int] = {}

    def chain(n: int, s: int) -> list[tuple[int, int]]:
        """(node, tokens) from offset ``s`` down to node ``n``'s end."""
        nonlocal next_id
        i = index[n]
        out = [(n, E[i] - S[i])]
        cur = i
        while S[cur] > s:
            p = P[cur]
            pi = index.get(p) if p >= 0 else None
            if pi is None or E[pi] != S[cur] or S[pi] < s:
                key = (s, S[cur])
                if key not in gaps:
                    gaps[key] = next_id
                    next_id += 1
                out.append((gaps[key], S[cur] - s))
                break
            out.append((p, E[pi] - S[pi]))
            cur = pi
        return out[::-1]

    new_ids: list[int] = []
    new_tok: list[int] = []
    new_ptr = [0]
    ids_l, start_l, ptr_l = ids.tolist(), start.tolist(), ptr.tolist()
    for r in range(len(requests)):
        for k in range(ptr_l[r], ptr_l[r + 1]):
            for n, t in chain(ids_l[k], start_l[k]):
                new_ids.append(n)
                new_tok.append(t)
        new_ptr.append(len(new_ids))
    out_req = Requests(
        request_id=requests.request_id,
        arrival_step=requests.arrival_step,
        node_ptr=np.asarray(new_ptr, np.int64),
        node_ids=np.asarray(new_ids, np.int64),
        node_tokens=np.asarray(new_tok, np.int32),
        output_tokens=requests.output_tokens,
        request_labels=requests.request_labels,
        **{name: getattr(requests, name) for name in REQUEST_EXTRA},
    )
    if accesses is None or len(accesses) == 0:
        return out_req, accesses
    ps = int(page_size if page_size is not None else accesses.meta.page_size)
    node = accesses.node_id.astype(np.int64)
    pos = np.searchsorted(uniq, node)
    known = (node >= 0) & (accesses.position >= 0) & (pos < uniq.shape[0])
    known[known] = uniq[pos[known]] == node[known]
    cur = np.where(known, pos, -1)
    offset = accesses.position.astype(np.int64) * ps
    par_idx = np.array([index.get(p, -1) if p >= 0 else -1 for p in P], np.int64)
    # Walk each row up the final parents until its node starts at or before the row's offset.
    while True:
        move = (cur >= 0) & (offset < np.where(cur >= 0, final_start[np.maximum(cur, 0)], 0))
        move &= par_idx[np.maximum(cur, 0)] >= 0
        if not move.any():
            break
        cur[move] = par_idx[cur[move]]
    new_node = np.where(cur >= 0, uniq[np.maximum(cur, 0)], node)
    out_acc = Trace(**{**{name: getattr(accesses, name) for name in ACCESS_DTYPES}, "node_id": new_node},
                    request_labels=accesses.request_labels, meta=accesses.meta)
    return out_req, out_acc


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
