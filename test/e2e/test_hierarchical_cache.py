"""SGLang's hierarchical cache on torch_cpu: device -> host pool -> `file` storage.

A device pool smaller than the working set pushes a prompt's KV out to the
host tier; asking again must load it back (host hits), and after /flush_cache
empties device and host, from the file tier (storage hits). Tiering must never
change answers: output ids and logprobs equal the uncached run.
"""

from __future__ import annotations

import pytest

from sgl_importance.client import flush_cache
from support.server import output_ids_and_logprobs
from support.storage import settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
DEVICE_TOKENS = 1024


def document(i: int) -> str:
    # ~600 tokens each: two of them overflow the 1024-token device pool.
    return f"Document {i}: " + " ".join(f"item{i}x{j}" for j in range(110))


def run_round_trip(server, storage) -> None:
    uncached = server.generate(document(0))
    assert uncached["meta_info"]["cached_tokens"] == 0
    reference = output_ids_and_logprobs(uncached)

    for i in (1, 2):
        server.generate(document(i))

    from_host = server.generate(document(0))
    details = from_host["meta_info"]["cached_tokens_details"]
    assert details["host"] > 0, details
    assert output_ids_and_logprobs(from_host)[0] == reference[0]
    assert output_ids_and_logprobs(from_host)[1] == pytest.approx(reference[1], abs=1e-6)

    assert settled(storage), "nothing was written to the file tier"
    r = flush_cache(server.url)
    assert r.status_code == 200, r.text
    from_storage = server.generate(document(0))
    details = from_storage["meta_info"]["cached_tokens_details"]
    assert details["storage"] > 0 and details["device"] == 0, details
    assert output_ids_and_logprobs(from_storage)[0] == reference[0]
    assert output_ids_and_logprobs(from_storage)[1] == pytest.approx(reference[1], abs=1e-6)


# The two layouts of the direct io backend. SGLang's default (page_first with the "kernel"
# io backend) is what every other tiered test runs (the eviction, storage, tenant and bfloat16
# modules read prompts back from the host and file tiers on it): not started once more here.
LAYOUTS = [
    ("layer_first", "direct"),
    ("page_first_direct", "direct"),
]


@pytest.mark.parametrize("layout,io_backend", LAYOUTS)
def test_prompt_evicted_from_device_returns_from_host_then_from_file_storage(launch_here, tmp_path, layout, io_backend):
    storage = tmp_path / "hicache"
    storage.mkdir()
    server = launch_here(
        [
            # Float32 pinned: the point is bit-exact reuse (a prefix read back from the host or file tier answers
            # as computed); in bfloat16 a prefix prefilled at once and one read back before an
            # extend need not give the same greedy tokens (docs/testing.md).
            "--dtype",
            "float32",
            "--page-size",
            str(PAGE),
            "--max-total-tokens",
            str(DEVICE_TOKENS),
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            "4",
            "--hicache-mem-layout",
            layout,
            "--hicache-io-backend",
            io_backend,
            "--hicache-storage-backend",
            "file",
            "--enable-cache-report",
            # A request waits for its storage fetch: under best_effort a busy machine (CI, 2 cores)
            # may admit it before the fetch lands and report no storage hit.
            "--hicache-storage-prefetch-policy",
            "wait_complete",
        ],
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)},
    )
    try:
        run_round_trip(server, storage)
    finally:
        server.stop()
