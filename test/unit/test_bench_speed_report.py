"""benchmark/long_context/bench_speed.py: configurations, byte counts, log parsing and the table."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_speed", REPO / "benchmark" / "long_context" / "bench_speed.py")
bench_speed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_speed)

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def test_configuration_names_map_to_their_server_and_hot_set():
    assert bench_speed.parse_config("transformers")["server"] is None
    assert bench_speed.parse_config("reference") == {"name": "reference", "server": "reference", "hot_set": None}
    assert bench_speed.parse_config("hot-dense")["hot_set"] == {"policy": "dense"}
    assert bench_speed.parse_config("hot-20")["hot_set"] == {
        "policy": "importance",
        "budget": 0.2,
        "guard_threshold": 1.0,
    }
    # The guarded configuration leaves the threshold to the server's default.
    assert bench_speed.parse_config("hot-20-guard")["hot_set"] == {"policy": "importance", "budget": 0.2}
    for bad in ("hot-0", "hot-101", "sparse", "hot-20-guardx", "sglang-", "sglang-Triton", "sglang-a b"):
        with pytest.raises(ValueError, match="unknown configuration"):
            bench_speed.parse_config(bad)


def test_a_peer_is_a_server_of_its_own_with_sglang_s_backend():
    assert bench_speed.parse_config("sglang-triton") == {
        "name": "sglang-triton",
        "server": "sglang-triton",
        "hot_set": None,
        "backend": "triton",
    }
    assert bench_speed.parse_config("sglang-torch_native")["backend"] == "torch_native"


def test_a_peer_server_gets_dense_s_flags_with_its_own_backend():
    a = argparse.Namespace(
        attention_backend="importance_triton", dtype="bfloat16", no_hicache=True, hicache_ratio=1.5,
        threshold=1024, server_args="--load-format dummy --skip-tokenizer-init",
    )  # fmt: skip
    dense, _ = bench_speed.server_args("dense", a, 4096, 0.1, 8272)
    peer, _ = bench_speed.server_args("sglang-triton", a, 4096, 0.1, 8272)
    assert _flag(dense, "--attention-backend") == "importance_triton"
    assert _flag(peer, "--attention-backend") == "triton"
    assert [x for x in peer if x != "triton"] == [x for x in dense if x != "importance_triton"]
    assert _flag(dense, "--context-length") == "8272"
    assert "--enable-hierarchical-cache" not in dense
    # --server-args come last, split as a shell would.
    assert dense[-3:] == ["--load-format", "dummy", "--skip-tokenizer-init"]
    a.no_hicache = False
    hot, _ = bench_speed.server_args("hot", a, 4096, 0.1, 8272)
    assert "--enable-hierarchical-cache" in hot and _flag(hot, "--hot-set-policy") == "importance"


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_context_length_holds_the_longest_prompt_its_new_tokens_and_a_page():
    assert bench_speed.context_length([8192, 32768], 64) == 32768 + 64 + 16
    assert bench_speed.context_length([1024], 16) == 1056


def test_the_load_format_is_read_from_the_extra_server_flags():
    assert bench_speed.load_format(["--load-format", "dummy", "--skip-tokenizer-init"]) == "dummy"
    assert bench_speed.load_format(["--load-format=dummy"]) == "dummy"
    assert bench_speed.load_format(["--skip-tokenizer-init"]) is None


def test_prompts_slice_the_filler_or_read_it_as_a_ring_where_it_is_short():
    filler = list(range(1000))
    sliced = bench_speed.prompts_from_filler(filler, [100], 4)[100]
    assert [p[0] for p in sliced] == [0, 225, 450, 675] and all(len(p) == 100 for p in sliced)
    ring = bench_speed.prompts_from_filler(filler, [2500], 4)[2500]
    assert [p[0] for p in ring] == [0, 250, 500, 750]
    assert all(len(p) == 2500 for p in ring)
    assert ring[1][750:752] == [0, 1]  # wrapped around
    assert len({tuple(p[:16]) for p in ring}) == 4  # distinct from the first page
    assert ring == bench_speed.prompts_from_filler(filler, [2500], 4)[2500]  # deterministic


def test_peers_come_first_in_the_table_after_transformers():
    names = ["hot-20", "dense", "sglang-triton", "transformers", "hot-20-guard", "hot-dense"]
    assert sorted(names, key=bench_speed.config_order) == [
        "transformers", "sglang-triton", "dense", "hot-dense", "hot-20", "hot-20-guard",
    ]  # fmt: skip


def test_the_weights_a_step_reads_are_smollm2_s_135m_parameters():
    shape = bench_speed.model_shape(SMOLLM2)
    params = bench_speed.weight_bytes(shape, 1)
    assert params == 30 * (576 * (576 + 384) + 576 * 576 + 3 * 576 * 1536 + 2 * 576) + 576 + 49152 * 576
    assert 134e6 < params < 135e6
    assert bench_speed.weight_bytes(shape, 4) == 4 * params


def test_a_page_s_kv_bytes_count_k_and_v_in_every_layer():
    shape = bench_speed.model_shape(SMOLLM2)
    assert bench_speed.kv_bytes_per_page(shape, 4) == 2 * 16 * 3 * 64 * 4 * 30


def test_dense_pages_follow_the_growing_sequence():
    # 64 prompt tokens: steps at 65..67 tokens read 5 pages each.
    assert bench_speed.dense_pages_per_step(64, 1, 4) == 5
    assert bench_speed.dense_pages_per_step(64, 3, 4) == 15
    # 62 tokens: 63 and 64 fit 4 pages, 65 needs a fifth.
    assert bench_speed.dense_pages_per_step(62, 1, 4) == pytest.approx(13 / 3)


def test_step_times_come_from_log_lines_of_the_whole_batch_and_skip_the_first_gap():
    line = (
        "[2026-11-25 12:18:43] Decode batch, #running-req: {n}, #token: 1280, token usage: 0.03, "
        "cpu graph: False, gen throughput (token/s): {rate}, #queue-req: 0\n"
    )
    log = (
        line.format(n=4, rate=1.0)  # the gap since the last decode: idle time, dropped
        + line.format(n=4, rate=40.0)
        + line.format(n=3, rate=30.0)  # a request finished early: not the measured batch
        + line.format(n=4, rate=20.0)
    )
    assert bench_speed.step_times_from_log(log, 4) == pytest.approx([0.1, 0.2])


def _row(config, length, batch, step_s, hot_ratio=None):
    return {
        "config": config,
        "length": length,
        "batch": batch,
        "step_s": step_s,
        "step_mean_s": step_s,
        "steps": 31,
        "hot_ratio": hot_ratio,
        "bandwidth_gbs": 20.0,
        "load": 1.0,
    }


def test_rows_get_pages_bytes_the_read_once_time_and_ratios_to_dense_and_transformers(tmp_path):
    shape = bench_speed.model_shape(SMOLLM2)
    rows = [
        _row("hot-20", 4096, 4, 0.05, hot_ratio=0.25),  # listed before its peers on purpose
        _row("transformers", 4096, 4, 0.2),
        _row("dense", 4096, 4, 0.1),
        _row("sglang-torch_native", 4096, 4, 0.125),
    ]
    done = {r["config"]: r for r in bench_speed.complete_rows(rows, shape, 4, 32)}
    dense_pages = bench_speed.dense_pages_per_step(4096, 4, 32)
    assert done["dense"]["pages_per_step"] == pytest.approx(dense_pages)
    assert done["hot-20"]["pages_per_step"] == pytest.approx(dense_pages / 4)
    weights = bench_speed.weight_bytes(shape, 4)
    assert done["dense"]["bytes_per_step"] == pytest.approx(weights + dense_pages * 2 * 16 * 3 * 64 * 4 * 30)
    assert done["dense"]["read_once_s"] == pytest.approx(done["dense"]["bytes_per_step"] / 20e9)
    assert done["hot-20"]["vs_dense"] == pytest.approx(2.0)
    assert done["hot-20"]["vs_transformers"] == pytest.approx(4.0)
    assert done["dense"]["tok_s"] == pytest.approx(40.0)
    assert done["hot-20"]["vs_peer"] == pytest.approx(2.5)
    assert done["sglang-torch_native"]["vs_dense"] == pytest.approx(0.8)

    meta = {"command": "x", "minutes": 1.0, "machine": "m", "model": "SmolLM2", "dtype": "float32",
            "new_tokens": 32, "threshold": 1024}  # fmt: skip
    text = bench_speed.write_report(list(done.values()), meta, tmp_path)
    table = [line for line in text.splitlines() if line.startswith("| 4096 ")]
    # Sorted: transformers, the peer, dense, then the hot set.
    assert [line.split("|")[3].strip() for line in table] == ["transformers", "sglang-torch_native", "dense", "hot-20"]
    assert "| vs dense | vs sglang-torch_native | vs transformers |" in text
    assert "| 2.00x | 2.50x | 4.00x |" in table[3]
    assert (tmp_path / "speed.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == 4


def test_a_failed_configuration_is_recorded_and_the_others_kept(tmp_path):
    shape = bench_speed.model_shape(SMOLLM2)
    done = bench_speed.complete_rows([_row("dense", 1024, 1, 0.1)], shape, 4, 16)
    errors = {"hot-20": "RuntimeError: server exited with 1"}
    meta = {"command": "x", "minutes": 1.0, "machine": "m", "model": "m", "dtype": "float32",
            "new_tokens": 16, "threshold": 512, "errors": errors}  # fmt: skip
    text = bench_speed.write_report(done, meta, tmp_path)
    assert "Not measured (failed): hot-20: RuntimeError: server exited with 1" in text
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["errors"] == errors
    short = bench_speed.short_table(done, errors)
    assert "dense" in short and "NOT MEASURED hot-20: RuntimeError" in short
    # Nothing measured at all: the report is still written, without a plot.
    (tmp_path / "none").mkdir()
    bench_speed.write_report([], meta, tmp_path / "none")
    assert (tmp_path / "none" / "results.json").exists() and not (tmp_path / "none" / "speed.png").exists()
