"""Live-trace fields: the requests table's per-request columns, radix splits, and the
prefix regime replaying a trace in the recorder's form (hand-built, known answers)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sgl_importance.sim.__main__ import main as sim_main
from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.prefix import prepare_prefix, replay_prefix
from sgl_importance.trace.schema import REQUEST_EXTRA, TraceMeta, parse_rid
from sgl_importance.trace.splits import resolve_splits
from sgl_importance.trace.streaming import TraceWriter
from sgl_importance.trace.table_io import read_all, read_requests, write_requests
from sgl_importance.trace.tables import Accesses, Requests

PAGE = 16


@pytest.mark.parametrize(
    "rid, expected",
    [
        ("chat-c2-t3", (2, 3)),
        ("agent-c0-t11", (0, 11)),
        ("rag-c7-t0", (7, 0)),
        ("3f2a9c", (-1, 0)),
        ("x-c1-t2-y", (-1, 0)),
    ],
)
def test_conversation_and_turn_come_from_the_rid_suffix(rid, expected):
    assert parse_rid(rid) == expected


def test_requests_table_round_trips_every_per_request_column(tmp_path):
    req = Requests.from_lists(
        ["chat-c0-t0", "chat-c0-t1"], [3, 40], [[11, 12], [11, 12, 13]], [[32, 16], [32, 16, 48]], [20, 9],
        conversation=[0, 0], turn=[0, 1], prompt_tokens=[40, 90], cached_tokens=[0, 48],
        finish_step=[25, 50], arrival_ns=[10**9, 2 * 10**9], finish_ns=[3 * 10**9, 4 * 10**9],
    )  # fmt: skip
    write_requests(tmp_path, req)
    back = read_requests(tmp_path)
    assert list(back.labels()) == ["chat-c0-t0", "chat-c0-t1"]
    assert back.path(1)[0].tolist() == [11, 12, 13] and back.path(1)[1].tolist() == [32, 16, 48]
    for name in REQUEST_EXTRA:
        assert getattr(back, name).tolist() == getattr(req, name).tolist(), name
        assert getattr(back, name).dtype == REQUEST_EXTRA[name][0], name


def test_streaming_writer_keeps_the_per_request_columns(tmp_path):
    with TraceWriter(tmp_path, TraceMeta(page_size=PAGE)) as w:
        w.append({"step": [0], "request_id": ["a"], "page": [1], "importance": [1.0]})
        w.append_requests(Requests.from_lists(["a"], [0], [[5]], [[16]], [1], cached_tokens=[16], finish_ns=[7]))
    req = read_all(tmp_path).requests
    assert (req.cached_tokens.tolist(), req.finish_ns.tolist(), req.prompt_tokens.tolist()) == ([16], [7], [-1])


def test_a_version_1_requests_table_reads_with_unknown_values(tmp_path):
    # The five columns of format version 1, as an older recorder wrote them.
    offsets = pa.array([0, 2], pa.int32())
    table = pa.table(
        {
            "request_id": pa.array([4], pa.int64()),
            "arrival_step": pa.array([0], pa.int64()),
            "node_ids": pa.ListArray.from_arrays(offsets, pa.array([1, 2], pa.int64())),
            "node_tokens": pa.ListArray.from_arrays(offsets, pa.array([16, 16], pa.int32())),
            "output_tokens": pa.array([3], pa.int32()),
        }
    )
    pq.write_table(table, tmp_path / "requests-00000.parquet")
    req = read_requests(tmp_path)
    assert req.path(0)[0].tolist() == [1, 2]
    assert {name: int(getattr(req, name)[0]) for name in REQUEST_EXTRA} == {
        name: unknown for name, (_, unknown) in REQUEST_EXTRA.items()
    }


# -- radix splits -----------------------------------------------------------------------


def _split_trace():
    """What the recorder writes when a later request splits an earlier one's node.

    a: prompt of 100 tokens in node 1 (recorded before any split).
    b: shares a's first 64 tokens; SGLang split node 1 into 7 (tokens 0..64, new id)
       and 1 (64..100, old id), and b added node 8 (20 tokens).
    c: a's prompt again, now seen through the split: [7, 1].
    """
    req = Requests.from_lists(
        ["a", "b", "c"], [0, 10, 20], [[1], [7, 8], [7, 1]], [[100], [64, 20], [64, 36]], [4, 4, 4]
    )
    # a's pages at its decode step: positions 0..6, all in node 1 as recorded.
    acc = Accesses.from_columns(
        {
            "step": [0] * 7 + [10] * 6,
            "request_id": ["a"] * 7 + ["b"] * 6,
            "page": list(range(7)) + [0, 1, 2, 3, 50, 51],
            "node_id": [1] * 7 + [7, 7, 7, 7, 8, 8],
            "position": list(range(7)) + list(range(6)),
            "importance": [0.1, 0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1, 0.3, 0.3],
        },
        TraceMeta(page_size=PAGE),
    )
    return req, acc


def test_a_path_recorded_before_a_split_becomes_the_split_nodes():
    req, acc = _split_trace()
    out_req, out_acc = resolve_splits(req, acc)
    assert [out_req.path(i)[0].tolist() for i in range(3)] == [[7, 1], [7, 8], [7, 1]]
    assert out_req.path(0)[1].tolist() == [64, 36]
    # a's pages 0..3 (tokens 0..63) now belong to node 7, pages 4..6 stay in node 1.
    a_rows = out_acc.request_labels[out_acc.request_id] == "a"
    assert out_acc.node_id[a_rows].tolist() == [7, 7, 7, 7, 1, 1, 1]
    # Requests sharing the prefix share the node ids of the shared pages.
    b_rows = ~a_rows
    shared = {int(p): int(n) for p, n in zip(out_acc.position[a_rows], out_acc.node_id[a_rows]) if p < 4}
    assert all(shared[int(p)] == int(n) for p, n in zip(out_acc.position[b_rows], out_acc.node_id[b_rows]) if p < 4)


def test_a_node_split_twice_resolves_to_the_finest_pieces():
    # a saw node 1 whole (0..100); b saw it after two splits: 2 (0..10), 3 (10..50), 1 (50..100).
    req = Requests.from_lists(["a", "b"], [0, 1], [[1], [2, 3, 1]], [[100], [10, 40, 50]], [1, 1])
    out, _ = resolve_splits(req)
    assert out.path(0)[0].tolist() == [2, 3, 1] and out.path(0)[1].tolist() == [10, 40, 50]
    # A deeper node under an unsplit parent is untouched.
    req = Requests.from_lists(["a", "b"], [0, 1], [[2, 1], [2, 4, 1]], [[10, 90], [10, 20, 70]], [1, 1])
    assert resolve_splits(req)[0].path(0)[0].tolist() == [2, 4, 1]


def test_node_ids_that_break_the_split_rule_are_left_as_recorded_with_a_warning():
    # Node 1 ends at 100 in one path and at 60 in the other: not SGLang's split rule.
    req = Requests.from_lists(["a", "b"], [0, 1], [[1], [1]], [[100], [60]], [1, 1])
    with pytest.warns(RuntimeWarning, match="different offsets"):
        out, _ = resolve_splits(req)
    assert out is req


def test_a_trace_without_splits_is_returned_unchanged():
    req = Requests.from_lists(["a", "b"], [0, 1], [[1, 2], [1, 3]], [[32, 16], [32, 48]], [1, 1])
    out, acc = resolve_splits(req, None)
    assert out is req and acc is None


# -- prefix regime on the recorder's form -----------------------------------------------


def test_prefix_regime_replays_a_trace_with_pre_split_paths():
    req, acc = _split_trace()
    pd = prepare_prefix(req, acc)
    assert pd.has_importance
    _, hits = replay_prefix(pd, make_policy("lru"), 10_000)
    # b hits a's first 64 tokens; c hits all 100 of a's prompt tokens.
    assert hits.tolist() == [0, 64, 100]
    # Node 7 carries a's mass of pages 0..3 (0.4 at its one step), node 1 pages 4..6 (0.6).
    a_mass = pd.path_mass[pd.path_ptr[0] : pd.path_ptr[1]]
    assert a_mass.tolist() == pytest.approx([0.4, 0.6])


def test_prefix_regime_orders_requests_by_arrival_step_then_arrival_time():
    req = Requests.from_lists(
        ["late", "early"], [5, 5], [[1, 3], [1, 2]], [[50, 5], [50, 5]], [1, 1], arrival_ns=[20, 10]
    )
    pd = prepare_prefix(req)
    assert list(req.request_labels[pd.request_id]) == ["early", "late"]


def test_cli_replays_a_live_format_trace_in_both_regimes(tmp_path):
    req, acc = _split_trace()
    trace_dir = tmp_path / "live"
    with TraceWriter(trace_dir, TraceMeta(page_size=PAGE, workload="live")) as w:
        w.append(acc.columns())
        w.append_requests(
            Requests.from_lists(
                ["a", "b", "c"], [0, 10, 20], [[1], [7, 8], [7, 1]], [[100], [64, 20], [64, 36]], [4, 4, 4],
                cached_tokens=[0, 64, 100], prompt_tokens=[100, 84, 100],
            )
        )  # fmt: skip
    out = tmp_path / "out"
    assert sim_main(["replay", "--trace", str(trace_dir), "--out", str(out), "--policies", "lru,decayed_mass",
                     "--budgets", "1", "--quiet"]) == 0  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    regimes = {r["regime"] for r in results}
    assert regimes == {"hot", "prefix"}
    prefix_lru = next(r for r in results if r["regime"] == "prefix" and r["policy"] == "lru")
    assert prefix_lru["hit_rate"] == pytest.approx(164 / (100 + 84 + 100))
    report = (out / "report.md").read_text()
    assert "the server itself matched 164 tokens" in report
