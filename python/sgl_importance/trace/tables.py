"""The two tables of a trace in memory, as numpy struct-of-arrays.

:class:`Accesses` holds the ``accesses`` table, :class:`Requests` the ``requests``
table (paths stored CSR style), :class:`TraceSet` a whole trace directory. Column
names, types and "unknown" values are those of ``trace.schema``; string request ids
are dictionary-coded to int64 codes with the labels kept beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from sgl_importance.trace.schema import (
    ACCESS_DEFAULTS,
    ACCESS_DTYPES,
    ACCESS_REQUIRED,
    REQUEST_EXTRA,
    TraceMeta,
)


@dataclass
class Accesses:
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
    def from_columns(cls, columns: Mapping[str, Any], meta: TraceMeta | None = None) -> "Accesses":
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

    def take(self, index: np.ndarray) -> "Accesses":
        """Rows selected by a boolean mask or an index array."""
        cols = {name: getattr(self, name)[index] for name in ACCESS_DTYPES}
        return Accesses(**cols, request_labels=self.request_labels, meta=self.meta)


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
        codes, labels = code_ids(request_id)
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


def code_ids(ids: Any) -> tuple[np.ndarray, np.ndarray | None]:
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
            out[name], labels = code_ids(columns[name])
        elif name in columns:
            out[name] = np.asarray(columns[name]).astype(dt, copy=False)
        else:
            out[name] = np.full(n, ACCESS_DEFAULTS[name], dt)
        if out[name].shape != (n,):
            raise ValueError(f"accesses: column {name!r} has shape {out[name].shape}, expected ({n},)")
    return out, labels


@dataclass
class TraceSet:
    """Everything in a trace directory; either table may be absent."""

    meta: TraceMeta
    accesses: Accesses | None
    requests: Requests | None
