from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from sgl_importance.trace.schema import ACCESS_DTYPES, TraceMeta
from sgl_importance.trace.streaming import TraceWriter
from sgl_importance.trace.table_io import (
    read_accesses,
    read_all,
    read_meta,
    read_requests,
    write_accesses,
    write_requests,
)
from sgl_importance.trace.tables import Accesses, Requests
from support.traces import rng  # noqa: F401  (fixture)


def _random_columns(rng: np.random.Generator, n: int, string_ids: bool = False) -> dict[str, np.ndarray]:
    ids = rng.integers(0, 5, n)
    return {
        "step": rng.integers(0, 1000, n),
        "time_ns": rng.integers(0, 10**12, n),
        "request_id": np.array([f"req-{i}" for i in ids]) if string_ids else ids * 1_000_003,
        "turn": rng.integers(0, 4, n),
        "layer": rng.integers(-1, 30, n),
        "kv_head": rng.integers(-1, 3, n),
        "page": rng.integers(0, 2**40, n),
        "node_id": rng.integers(-1, 100, n),
        "position": rng.integers(0, 500, n),
        "importance": rng.random(n).astype(np.float32),
    }


def _assert_same(a: Accesses, b: Accesses) -> None:
    for name in ACCESS_DTYPES:
        x, y = a.columns()[name], b.columns()[name]
        assert np.array_equal(x, y), name
        if name != "request_id" or a.request_labels is None:
            assert getattr(b, name).dtype == ACCESS_DTYPES[name], name


def test_write_then_read_returns_identical_columns_and_dtypes(tmp_path, rng):
    tr = Accesses.from_columns(_random_columns(rng, 1000), TraceMeta(page_size=32, model="m", workload="w"))
    write_accesses(tmp_path, tr)
    back = read_accesses(tmp_path)
    _assert_same(tr, back)
    assert back.request_labels is None
    meta = read_meta(tmp_path)
    assert (meta.page_size, meta.model, meta.workload, meta.access_rows) == (32, "m", "w", 1000)
    assert meta.created  # filled in on write


def test_string_request_ids_round_trip_through_codes_and_labels(tmp_path, rng):
    tr = Accesses.from_columns(_random_columns(rng, 300, string_ids=True))
    assert tr.request_id.dtype == np.int64
    write_accesses(tmp_path, tr)
    back = read_accesses(tmp_path)
    assert np.array_equal(back.columns()["request_id"], tr.columns()["request_id"])
    assert set(back.request_labels) == {f"req-{i}" for i in range(5)}


def test_optional_columns_take_documented_defaults():
    tr = Accesses.from_columns({"step": [0, 1], "request_id": [7, 7], "page": [3, 4], "importance": [0.5, 0.5]})
    assert tr.layer.tolist() == [-1, -1] and tr.kv_head.tolist() == [-1, -1]
    assert tr.node_id.tolist() == [-1, -1] and tr.position.tolist() == [-1, -1]
    with pytest.raises(ValueError, match="missing required"):
        Accesses.from_columns({"step": [0], "page": [1], "importance": [1.0]})


def test_requests_round_trip_keeps_variable_length_paths(tmp_path):
    req = Requests.from_lists([5, 6, 7], [0, 10, 3], [[1, 2], [1, 3, 4], []], [[16, 8], [16, 4, 4], []], [9, 10, 0])
    write_requests(tmp_path, req)
    back = read_requests(tmp_path)
    for i in range(3):
        ids, tok = back.path(i)
        ids0, tok0 = req.path(i)
        assert ids.tolist() == ids0.tolist() and tok.tolist() == tok0.tolist()
    assert back.arrival_step.tolist() == [0, 10, 3]
    assert back.output_tokens.tolist() == [9, 10, 0]
    assert read_meta(tmp_path).request_rows == 3


def test_read_all_gives_string_ids_one_code_space_across_tables(tmp_path):
    tr = Accesses.from_columns({"step": [0, 0], "request_id": ["b", "c"], "page": [1, 2], "importance": [1.0, 1.0]})
    write_accesses(tmp_path, tr)
    write_requests(tmp_path, Requests.from_lists(["a", "c"], [0, 0], [[1], [2]], [[4], [4]], [1, 1]))
    ts = read_all(tmp_path)
    labels = list(ts.accesses.request_labels)
    assert labels == list(ts.requests.request_labels) == ["a", "b", "c"]
    assert ts.accesses.request_id.tolist() == [1, 2]
    assert ts.requests.request_id.tolist() == [0, 2]


def test_streaming_writer_rotates_files_and_reads_back_in_order(tmp_path, rng):
    cols = _random_columns(rng, 2500)
    with TraceWriter(tmp_path, TraceMeta(workload="stream"), rows_per_file=1000, row_group_rows=300) as w:
        for i in range(0, 2500, 170):
            w.append({k: v[i : i + 170] for k, v in cols.items()})
    files = sorted(p.name for p in tmp_path.glob("accesses-*.parquet"))
    assert files == ["accesses-00000.parquet", "accesses-00001.parquet", "accesses-00002.parquet"]
    _assert_same(Accesses.from_columns(cols), read_accesses(tmp_path))
    assert read_meta(tmp_path).access_rows == 2500


def test_streaming_writer_stops_at_row_bound_with_one_warning_and_counts_dropped(tmp_path, rng):
    cols = _random_columns(rng, 100)
    w = TraceWriter(tmp_path, max_rows=250)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = [w.append(cols) for _ in range(4)]
    w.close()
    assert kept == [100, 100, 50, 0]
    assert sum(issubclass(c.category, RuntimeWarning) for c in caught) == 1
    assert len(read_accesses(tmp_path)) == 250
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["dropped_rows"] == 150 and meta["access_rows"] == 250


def test_streaming_writer_also_writes_the_requests_table(tmp_path):
    with TraceWriter(tmp_path) as w:
        w.append({"step": [0], "request_id": [1], "page": [9], "importance": [1.0]})
        w.append_requests(Requests.from_lists([1], [0], [[4, 5]], [[16, 3]], [12]))
        w.append_requests(Requests.from_lists([2], [4], [[4]], [[16]], [3]))
    ts = read_all(tmp_path)
    assert len(ts.accesses) == 1 and len(ts.requests) == 2
    assert ts.requests.path(0)[0].tolist() == [4, 5]


def test_writer_refuses_a_directory_that_already_holds_a_trace(tmp_path):
    write_accesses(tmp_path, Accesses.from_columns({"step": [0], "request_id": [1], "page": [2], "importance": [1.0]}))
    with pytest.raises(FileExistsError):
        TraceWriter(tmp_path)


def test_writer_rejects_switching_request_id_type_mid_trace(tmp_path):
    with TraceWriter(tmp_path) as w:
        w.append({"step": [0], "request_id": [1], "page": [2], "importance": [1.0]})
        with pytest.raises(TypeError):
            w.append({"step": [1], "request_id": ["x"], "page": [2], "importance": [1.0]})
