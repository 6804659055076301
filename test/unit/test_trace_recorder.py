"""The trace recorder without a server: flags, step capture, records through the writer process."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sgl_importance.config import ImportanceConfig, add_cli_args, from_namespace
from sgl_importance.trace import recorder as rec
from sgl_importance.trace.table_io import read_accesses, read_all, read_meta, read_requests
from sgl_importance.trace.tracing import Tracing
from support.fake_tree import FakeCache, FakeNode, FakeTreeCore, request, scheduler_of

PAGE = 4


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(list(argv))


# -- flags ---------------------------------------------------------------------------


def test_recording_is_off_by_default():
    config = from_namespace(parse())
    assert config.trace_dir is None and config.trace_max_rows == 5_000_000


def test_trace_flags_reach_the_config():
    config = from_namespace(parse("--importance-trace-dir", "/tmp/t", "--importance-trace-max-rows", "7"))
    assert (config.trace_dir, config.trace_max_rows) == ("/tmp/t", 7)


@pytest.mark.parametrize("value", [0, -1, 10**11])
def test_out_of_range_trace_max_rows_error_names_flag_value_and_range(value):
    with pytest.raises(ValueError) as err:
        ImportanceConfig(trace_max_rows=value)
    assert f"--importance-trace-max-rows {value}" in str(err.value)
    assert "[1, 10000000000]" in str(err.value)


def test_empty_trace_dir_is_rejected_with_the_flag_name():
    with pytest.raises(ValueError, match="--importance-trace-dir"):
        ImportanceConfig(trace_dir="")


def test_export_sets_the_environment_only_when_recording(tmp_path, monkeypatch):
    monkeypatch.delenv(rec.TRACE_DIR_ENV, raising=False)
    rec.export_trace_dir(parse("--importance-trace-dir", str(tmp_path / "t")))
    assert rec.recording_requested()
    rec.export_trace_dir(parse())
    assert not rec.recording_requested()


def test_export_refuses_a_directory_that_already_holds_a_trace(tmp_path, monkeypatch):
    monkeypatch.delenv(rec.TRACE_DIR_ENV, raising=False)
    (tmp_path / "accesses-00000.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="already holds a trace"):
        rec.export_trace_dir(parse("--importance-trace-dir", str(tmp_path)))


# -- step capture ----------------------------------------------------------------------


def table(reduce="mean", interval=1):
    return SimpleNamespace(reduce=reduce, sample_interval=interval, page_size=PAGE)


def layer_inputs(values):
    imp = torch.tensor(values, dtype=torch.float32)
    indptr = torch.tensor([0, 6], dtype=torch.int32)
    indices = torch.arange(100, 106, dtype=torch.int64)
    return imp, indptr, indices


def test_capture_reduces_layers_by_mean_like_the_table():
    cap, t = rec.StepCapture(), table("mean")
    cap.add_layer(t, *layer_inputs([[0.2, 0.8]]))
    cap.add_layer(t, *layer_inputs([[0.6, 0.4]]))
    cap.finish_step(t)
    (step,) = cap.pending
    assert step.step == 0
    assert torch.allclose(step.importance, torch.tensor([[0.4, 0.6]]))


def test_capture_reduces_layers_by_max_when_configured():
    cap, t = rec.StepCapture(), table("max")
    cap.add_layer(t, *layer_inputs([[0.2, 0.8]]))
    cap.add_layer(t, *layer_inputs([[0.6, 0.4]]))
    cap.finish_step(t)
    assert torch.allclose(cap.pending[0].importance, torch.tensor([[0.6, 0.8]]))


def test_capture_keeps_only_steps_the_sample_interval_records():
    cap, t = rec.StepCapture(), table("mean", interval=2)
    for _ in range(5):
        cap.add_layer(t, *layer_inputs([[0.5, 0.5]]))
        cap.finish_step(t)
    assert [s.step for s in cap.pending] == [0, 2, 4]


# -- recorder -> writer process -> Parquet -----------------------------------------------


class FakeReq:
    def __init__(self, rid, pool_idx, finished=False, last_node=None, prompt=6, output=2, cached=0):
        self.rid, self._finished = rid, finished
        self.kv = SimpleNamespace(req_pool_idx=pool_idx)
        self.last_node = last_node
        self.origin_input_ids = list(range(prompt))
        self.output_ids = list(range(output))
        self.cached_tokens = cached
        self.time_stats = SimpleNamespace(scheduler_recv_time=12.5)

    def finished(self):
        return self._finished


def fake_batch(reqs, req_to_token):
    mode = SimpleNamespace(is_decode=lambda: True)
    return SimpleNamespace(reqs=reqs, forward_mode=mode, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))


def two_request_step(cap, t):
    """Request a: 6 tokens in slots 16..21 (pages 4, 5); b: 3 tokens in slots 40..42 (page 10)."""
    req_to_token = torch.zeros(4, 16, dtype=torch.int64)
    req_to_token[1, :6] = torch.arange(16, 22)
    req_to_token[2, :3] = torch.arange(40, 43)
    indptr = torch.tensor([0, 6, 9], dtype=torch.int32)
    indices = torch.cat([req_to_token[1, :6], req_to_token[2, :3]])
    imp = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    cap.add_layer(t, imp, indptr, indices)
    cap.finish_step(t)
    return req_to_token


def wait_complete(out: Path, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "meta.json").exists() and read_meta(out).extra.get("complete"):
            return read_meta(out)
        time.sleep(0.1)
    raise TimeoutError(f"trace {out} not closed")


def test_records_reach_the_trace_with_request_ids_pages_and_positions(tmp_path):
    out = tmp_path / "trace"
    cap, t = rec.StepCapture(), table()
    r = rec.Recorder(str(out), max_rows=100, meta={"page_size": PAGE, "workload": "unit"})
    req_to_token = two_request_step(cap, t)
    reqs = [FakeReq("a", 1), FakeReq("b", 2)]
    assert r.record_batch(cap, fake_batch(reqs, req_to_token)) == 3
    r.close()
    wait_complete(out)
    tr = read_accesses(out)
    cols = tr.columns()
    got = sorted(zip(cols["request_id"], cols["position"], cols["page"], cols["importance"]))
    assert got == [("a", 0, 4, 0.25), ("a", 1, 5, 0.75), ("b", 0, 10, 1.0)]
    assert set(tr.step) == {0} and np.all(tr.layer == -1)
    assert tr.meta.workload == "unit" and tr.meta.page_size == PAGE


def test_a_step_is_not_filed_under_a_batch_whose_requests_hold_other_slots(tmp_path):
    cap, t = rec.StepCapture(), table()
    r = rec.Recorder(str(tmp_path / "trace"), max_rows=100, meta={})
    req_to_token = two_request_step(cap, t)
    other = req_to_token.clone()
    other[2, 0] = 99
    assert r.record_batch(cap, fake_batch([FakeReq("a", 1), FakeReq("b", 2)], other)) == 0
    assert len(cap.pending) == 1  # kept for the batch it belongs to
    r.close()


def test_rows_past_the_bound_are_dropped_and_counted(tmp_path):
    out = tmp_path / "trace"
    cap, t = rec.StepCapture(), table()
    r = rec.Recorder(str(out), max_rows=2, meta={})
    req_to_token = two_request_step(cap, t)
    r.record_batch(cap, fake_batch([FakeReq("a", 1), FakeReq("b", 2)], req_to_token))
    r.close()
    meta = wait_complete(out)
    assert (meta.access_rows, meta.dropped_rows) == (2, 1)


def test_writer_closes_the_trace_when_the_watched_process_dies(tmp_path):
    out = tmp_path / "trace"
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    endpoint = f"ipc://{tmp_path}/w"
    cmd = [sys.executable, "-m", "sgl_importance.trace.writer_process", "--endpoint", endpoint, "--out", str(out),
           "--meta", json.dumps({"page_size": PAGE}), "--watch-pid", str(victim.pid), "--detach"]  # fmt: skip
    assert subprocess.run(cmd, timeout=60).returncode == 0
    import zmq

    from sgl_importance.trace.writer_process import RECORD_DTYPE

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    records = np.zeros(3, RECORD_DTYPE)
    records["position"] = [0, 1, 2]
    records["importance"] = [0.5, 0.25, 0.25]
    sock.send_multipart([b"labels", json.dumps({"0": "x"}).encode()])
    sock.send_multipart([b"rows", records.tobytes()])
    sock.close(linger=2000)
    ctx.term()
    victim.kill()
    victim.wait()
    meta = wait_complete(out)
    assert meta.extra["closed_by"] == "scheduler exited"
    assert list(read_accesses(out).columns()["request_id"]) == ["x", "x", "x"]


def test_around_the_result_records_before_the_scheduler_frees_the_requests(tmp_path, monkeypatch):
    out = tmp_path / "trace"
    tracing = Tracing()
    cap = tracing.capture
    tracing.recorder = rec.Recorder(str(out), max_rows=100, meta={})
    req_to_token = two_request_step(cap, table())
    reqs = [FakeReq("a", 1), FakeReq("b", 2)]

    def process_batch_result(scheduler, batch):
        # What SGLang does to finished requests: release the KV row, mark them done.
        for r in batch.reqs:
            r.kv.req_pool_idx, r._finished = None, True
        return "result"

    scheduler = scheduler_of(FakeCache(FakeTreeCore()))
    assert tracing.around_batch_result(process_batch_result, scheduler, fake_batch(reqs, req_to_token)) == "result"
    tracing.recorder.close()
    wait_complete(out)
    assert len(read_accesses(out)) == 3


def test_a_recording_fault_stops_recording_but_not_the_scheduler(tmp_path, monkeypatch):
    tracing = Tracing()
    cap = tracing.capture
    tracing.recorder = rec.Recorder(str(tmp_path / "trace"), max_rows=100, meta={})
    two_request_step(cap, table())
    broken = SimpleNamespace(
        reqs=[FakeReq("a", 1), FakeReq("b", 2)], forward_mode=SimpleNamespace(is_decode=lambda: True)
    )
    assert (
        tracing.around_batch_result(lambda s, b: "result", scheduler_of(FakeCache(FakeTreeCore())), broken) == "result"
    )
    assert tracing.recorder is None
    wait_complete(tmp_path / "trace")


def test_a_request_finished_before_the_step_gets_no_rows_but_the_step_still_matches(tmp_path):
    # Overlap scheduling: the previous result finished "b" and released its KV row
    # while this batch, still holding "b", was already running.
    out = tmp_path / "trace"
    cap, t = rec.StepCapture(), table()
    r = rec.Recorder(str(out), max_rows=100, meta={})
    req_to_token = two_request_step(cap, t)
    done = FakeReq("b", None, finished=True)
    assert r.record_batch(cap, fake_batch([FakeReq("a", 1), done], req_to_token)) == 2
    r.close()
    wait_complete(out)
    assert set(read_accesses(out).columns()["request_id"]) == {"a"}


# -- radix node ids and the requests table ----------------------------------------------


def path_tree(*tokens: int) -> tuple[FakeTreeCore, list[FakeNode]]:
    """A chain of nodes below the root, holding ``tokens[i]`` tokens each, first to last."""
    tree, nodes = FakeTreeCore(), []
    for n in tokens:
        nodes.append(tree.add(nodes[-1] if nodes else None, n))
    return tree, nodes


def counted_path_queries(tree: FakeTreeCore) -> list:
    """The ``collect_path_info`` calls made on ``tree`` from now on (their handles)."""
    calls: list = []
    query = tree.collect_path_info
    tree.collect_path_info = lambda handles: calls.append(list(handles)) or query(handles)
    return calls


def test_each_page_row_names_the_radix_node_that_holds_it(tmp_path):
    # Request a: its first node holds tokens 0..4 (page 0), the second tokens 4..8 (page 1).
    out = tmp_path / "trace"
    cap, t = rec.StepCapture(), table()
    r = rec.Recorder(str(out), max_rows=100, meta={"page_size": PAGE})
    req_to_token = two_request_step(cap, t)
    tree, (first, second) = path_tree(4, 4)
    calls = counted_path_queries(tree)
    reqs = [FakeReq("a", 1, last_node=second.id), FakeReq("b", 2, last_node=None)]
    assert r.record_batch(cap, fake_batch(reqs, req_to_token), tree) == 3
    assert len(calls) == 1  # one path query per batch, not per request
    r.close()
    wait_complete(out)
    cols = read_accesses(out).columns()
    got = sorted(zip(cols["request_id"], cols["position"], cols["node_id"]))
    assert got == [("a", 0, first.id), ("a", 1, second.id), ("b", 0, -1)]


def test_pages_past_the_inserted_path_have_no_node_yet():
    path = ([3, 9], [0, 16], [16, 32])
    assert rec._page_nodes(path, 4, 8).tolist() == [3, 3, 9, 9]
    assert rec._page_nodes(path, 6, 8).tolist() == [3, 3, 9, 9, -1, -1]
    assert rec._page_nodes(None, 2, 8).tolist() == [-1, -1]


def test_a_vanished_node_costs_only_its_own_request_its_path():
    tree, (node,) = path_tree(4)
    paths = rec.request_paths(tree, [request(last_node=99), request(last_node=node.id)])
    assert paths == [None, ([node.id], [0], [4])]


def test_a_finished_request_is_filed_once_with_its_path_counts_and_times(tmp_path, monkeypatch):
    out = tmp_path / "trace"
    tracing = Tracing()
    cap = tracing.capture
    tracing.recorder = rec.Recorder(str(out), max_rows=100, meta={"page_size": PAGE})
    req_to_token = two_request_step(cap, table())
    # At finish SGLang has inserted prompt + output: the path grew by a second node.
    tree, (first, second) = path_tree(4, 4)
    scheduler = scheduler_of(FakeCache(tree))
    a = FakeReq("chat-c2-t3", 1, last_node=first.id, prompt=6, output=3, cached=4)
    b = FakeReq("b", 2, last_node=None)

    def process_batch_result(scheduler, batch):
        a._finished, a.last_node = True, second.id
        return "result"

    batch = fake_batch([a, b], req_to_token)
    assert tracing.around_batch_result(process_batch_result, scheduler, batch) == "result"
    # Overlap scheduling shows the finished request in one more batch: no second row.
    assert tracing.recorder.finish_requests(batch, 5, tree) == 0
    tracing.recorder.close()
    wait_complete(out)
    req = read_requests(out)
    assert list(req.labels()) == ["chat-c2-t3"]
    ids, tokens = req.path(0)
    assert (ids.tolist(), tokens.tolist()) == ([first.id, second.id], [4, 4])
    assert (req.conversation[0], req.turn[0]) == (2, 3)
    assert (req.prompt_tokens[0], req.output_tokens[0], req.cached_tokens[0]) == (6, 3, 4)
    assert (req.arrival_step[0], req.finish_step[0]) == (0, 1)
    assert req.arrival_ns[0] == 12_500_000_000 and req.finish_ns[0] > 0
    ts = read_all(out)
    # The access rows of the same request carry the same ids and its turn.
    rows = ts.accesses.columns()["request_id"] == "chat-c2-t3"
    assert set(ts.accesses.node_id[rows]) == {first.id, -1} and set(ts.accesses.turn[rows]) == {3}
