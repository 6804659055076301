"""scripts/prepare_model.py: converted once, verified by a tensor hash."""

import importlib.util
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("prepare_model", REPO / "scripts" / "prepare_model.py")
prepare_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare_model)


def test_prepared_folder_is_recognised_and_carries_sampling_defaults(model_path):
    folder = Path(model_path)
    assert prepare_model.is_prepared(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    for key, value in prepare_model.SAMPLING_DEFAULTS.items():
        assert generation[key] == value
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config


def test_rerun_on_a_prepared_folder_does_not_rewrite_it(model_path):
    weights = Path(model_path) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare_model.prepare(Path(model_path), quiet=True) == Path(model_path).resolve()
    assert weights.stat().st_mtime_ns == before


def test_changed_weights_fail_the_hash_check(model_path, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model_path, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # inside the last tensor's bytes
    weights.write_bytes(bytes(data))
    assert not prepare_model.is_prepared(copy)


def test_missing_marker_means_not_prepared(model_path, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model_path, copy)
    (copy / prepare_model.MARKER).unlink()
    assert not prepare_model.is_prepared(copy)
