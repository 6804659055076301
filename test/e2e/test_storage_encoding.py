"""Storage-tier pages encoded by importance, through real servers (``--importance-storage-precision``).

A float32 server with ``graded`` on SGLang's ``file`` tier writes a document's pages
in mixed classes (the sink page at float32, the rest at 8 and 4 bits) and, after
``/flush_cache``, serves the document back from them; a server with the flag off
on the same directory refuses every encoded page as a miss and answers exactly as
dense did; a ``graded`` server on a real Mooncake Store stores and serves encoded
pages too. Kept short: three servers, a few requests each.
"""

from __future__ import annotations

import time

import pytest

from sgl_importance.client import flush_cache, metrics_text
from sgl_importance.local_server import metric
from support.server import output_ids_and_logprobs
from support.storage import page_files, settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
TRAILER = 32
# SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 channels x 16 tokens, K and V.
FULL_BYTES, INT8_BYTES, INT4_BYTES = 737_280, 213_120, 120_960
PAGES = "sgl_importance:storage_pages_total"
CORRUPT = "sgl_importance:storage_corrupt_pages_total"


def server_args(precision: str, backend: str = "file") -> list[str]:
    return [
        "--dtype", "float32",
        "--page-size", str(PAGE),
        "--max-total-tokens", "1024",
        "--enable-hierarchical-cache",
        "--hicache-ratio", "4",
        "--hicache-storage-backend", backend,
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--attention-backend", "importance_torch",
        "--radix-eviction-policy", "importance",
        "--importance-storage-precision", precision,
        "--enable-metrics",
        "--enable-cache-report",
    ]  # fmt: skip


def document() -> str:
    # ~600 tokens (SGLang fetches from storage only when >= 256 tokens come back).
    return "Inventory: " + " ".join(f"crate{j} holds {j * 7 % 97} bolts." for j in range(60))


def flush(server) -> None:
    r = flush_cache(server.url)
    assert r.status_code == 200, r.text


def storage_tokens(out: dict) -> int:
    return (out["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)


def metrics(server) -> str:
    return metrics_text(server.url, timeout=30)


@pytest.fixture(scope="module")
def file_tier(launch, tmp_path_factory):
    """A graded server's answers from the device and from its file tier, and the tier.

    Returns (directory, dense output, output from storage, its storage tokens, /metrics text).
    """
    directory = tmp_path_factory.mktemp("tier") / "pages"
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(directory), "OMP_NUM_THREADS": "1"}
    server = launch(server_args("graded"), env)
    dense = server.generate(document(), max_new_tokens=8)
    settled(directory)
    flush(server)
    again = server.generate(document(), max_new_tokens=8)
    text = metrics(server)
    server.stop()
    return directory, dense, again, storage_tokens(again), text


def test_graded_pages_on_disk_mix_the_model_dtype_8_and_4_bits(file_tier):
    directory, *_ = file_tier
    sizes = [p.stat().st_size - TRAILER for p in page_files(directory)]
    assert set(sizes) == {FULL_BYTES, INT8_BYTES, INT4_BYTES}, sorted(set(sizes))
    assert sum(sizes) <= len(sizes) * FULL_BYTES / 4  # at most a quarter of float32's bytes


def test_a_flushed_prompt_is_served_from_encoded_pages(file_tier):
    _, dense, again, from_storage, text = file_tier
    assert from_storage >= 256, again["meta_info"]
    for cls in ("full", "int8", "int4"):
        assert metric(text, PAGES, op="write", precision=cls) > 0, cls
        assert metric(text, PAGES, op="read", precision=cls) > 0, cls
    # Decode attends the decoded pages: close to dense, and never garbage.
    ids, logprobs = output_ids_and_logprobs(again)
    dense_ids, dense_logprobs = output_ids_and_logprobs(dense)
    assert ids[0] == dense_ids[0]
    assert abs(logprobs[0] - dense_logprobs[0]) < 0.5


def test_a_server_with_the_flag_off_refuses_encoded_pages_and_answers_like_dense(file_tier, launch_here):
    directory, dense, *_ = file_tier
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(directory), "OMP_NUM_THREADS": "1"}
    server = launch_here(server_args("off"), env)
    out = server.generate(document(), max_new_tokens=8)
    assert storage_tokens(out) == 0
    refused = sum(metric(metrics(server), CORRUPT, reason=r) for r in ("short", "format"))
    assert refused > 0
    ids, logprobs = output_ids_and_logprobs(out)
    dense_ids, dense_logprobs = output_ids_and_logprobs(dense)
    assert ids == dense_ids
    assert logprobs == pytest.approx(dense_logprobs, abs=1e-4)
    server.stop()


def test_mooncake_stores_and_serves_encoded_pages(mooncake_store, launch_here, file_tier):
    _, dense, *_ = file_tier
    server = launch_here(
        server_args("graded", backend="mooncake"), {**mooncake_store.server_env(), "OMP_NUM_THREADS": "1"}
    )
    first = server.generate(document(), max_new_tokens=8)
    assert output_ids_and_logprobs(first)[0] == output_ids_and_logprobs(dense)[0]
    deadline = time.time() + 60
    while metric(metrics(server), PAGES, op="write", precision="int4") == 0 and time.time() < deadline:
        time.sleep(0.5)
    flush(server)
    again = server.generate(document(), max_new_tokens=8)
    assert storage_tokens(again) >= 256, again["meta_info"]
    text = metrics(server)
    for cls in ("full", "int8", "int4"):
        assert metric(text, PAGES, op="read", precision=cls) > 0, cls
    written = sum(
        metric(text, "sgl_importance:storage_page_bytes_total", op="write", precision=c)
        for c in ("full", "int8", "int4")
    )
    pages = sum(metric(text, PAGES, op="write", precision=c) for c in ("full", "int8", "int4"))
    assert written <= pages * FULL_BYTES / 4
    assert output_ids_and_logprobs(again)[0][0] == output_ids_and_logprobs(dense)[0][0]
    server.stop()
