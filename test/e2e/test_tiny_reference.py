"""The seeded tiny model, made afresh and served on torch_cpu, answers the committed
greedy reference token for token (what a GPU run is compared against)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_importance import local_server
from support.scripts import load_script
from support.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "benchmark" / "gpu" / "tiny_reference.json"


def test_fresh_tiny_model_reproduces_the_committed_reference(model_path, tmp_path):
    reference = json.loads(REFERENCE.read_text())
    tiny = tmp_path / "tiny"
    sha = load_script("make_models").make_tiny(tiny, Path(model_path), seed=reference["model"]["seed"])
    assert sha == reference["model"]["tensor_sha256"]
    # float32 as recorded: SGLang's --dtype auto would serve a float32 checkpoint as float16.
    server = local_server.start_with_retry(lambda: Server(str(tiny), ["--dtype", "float32"], {}, tmp_path / "log"))
    try:
        results = load_script("compare_greedy").compare(reference, server.url)
    finally:
        server.stop()
    assert [r.first_difference for r in results] == [None] * len(reference["prompts"])
    assert max(r.max_logprob_diff for r in results) < 1e-3
