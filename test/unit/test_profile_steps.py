"""benchmark/long_context/profile_steps.py: a profiler trace summed by kernel, or by the
host's top-level ops where it holds no kernel."""

import gzip
import json

from benchmark.long_context.profile_steps import kernel_table, markdown


def _trace(tmp_path, events):
    path = tmp_path / "step.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def _event(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_device_kernels_are_summed_by_name_per_step_and_host_ops_left_out(tmp_path):
    events = [
        _event("decode_stage1", "kernel", 0, 300.0),
        _event("decode_stage1", "kernel", 1000, 500.0),
        _event("tally", "kernel", 400, 100.0),
        _event("Memcpy DtoH", "gpu_memcpy", 600, 100.0),
        _event("aten::index", "cpu_op", 0, 5000.0),  # host time: not a kernel's
        {"ph": "i", "name": "marker", "cat": "kernel", "ts": 0},  # not a complete event
    ]
    table = kernel_table(_trace(tmp_path, events), steps=2)
    assert table["source"] == "device"
    assert [r["name"] for r in table["rows"]] == ["decode_stage1", "tally", "Memcpy DtoH"]
    first = table["rows"][0]
    assert first["calls_per_step"] == 1.0 and abs(first["ms_per_step"] - 0.4) < 1e-9
    assert abs(first["share"] - 0.8) < 1e-9 and abs(table["total_ms_per_step"] - 0.5) < 1e-9
    text = markdown(table, "hot-20 32768x1", top=2)
    assert "`decode_stage1` | 1.0 | 0.400 | 80.0% |" in text and "| (1 more) | | 0.050 | 10.0% |" in text


def test_without_kernels_the_hosts_top_level_ops_are_summed_not_their_callees(tmp_path):
    events = [
        _event("forward", "cpu_op", 0, 1000.0),
        _event("aten::mm", "cpu_op", 100, 400.0),  # inside forward: counted in it
        _event("aten::add", "cpu_op", 1200, 100.0),
        _event("aten::mm", "cpu_op", 0, 200.0, tid=2),  # another thread: top level there
    ]
    table = kernel_table(_trace(tmp_path, events), steps=1)
    assert table["source"] == "host"
    got = {r["name"]: r["ms_per_step"] for r in table["rows"]}
    assert got == {"forward": 1.0, "aten::mm": 0.2, "aten::add": 0.1}
    assert "top-level CPU ops" in markdown(table, "dense")
