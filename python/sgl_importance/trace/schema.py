"""The on-disk schema of page-access traces: files, columns, types, the sidecar.

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
               string    to int64 codes on read, the labels kept in ``Accesses.request_labels``)
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
name the unsplit node; ``trace.splits.resolve_splits`` rewrites every path and access row
to the finest split seen anywhere in the trace, after which every node has one
parent and requests sharing a prefix share the node ids of the shared pages.
Synthetic traces are already in that form (resolution leaves them unchanged).
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

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


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
