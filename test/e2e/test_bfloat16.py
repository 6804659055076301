"""The product in bfloat16, on any CPU: what must hold there, checked on every machine.

torch_cpu serves in bfloat16 where the CPU has it natively and in float32 elsewhere, so a
suite run on one kind of machine never sees the other dtype (docs/testing.md). This module
pins ``--dtype bfloat16`` on one server (the README's hot-set line, with the host and
``file`` tiers) and checks the paths whose numbers differ in bfloat16: a prefix read back
from the device, from the host and from the file tier answers as it was computed until the
first near-tie (in bfloat16 a prefix prefilled at once and one read back before an extend
need not round alike); the hot set at a budget covering every page decodes as dense does
until a near-tie; at 20 % it serves and releases pages. Short prompts: bfloat16 runs
emulated, several times slower, on a CPU without it.
"""

from __future__ import annotations

import pytest

from sgl_importance.client import flush_cache, metrics_text
from sgl_importance.local_server import metric
from support.server import assert_same_until_a_near_tie, generate_with_tops
from support.storage import settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
MAX_NEW = 8
ARGS = [
    "--dtype", "bfloat16", "--page-size", str(PAGE), "--max-total-tokens", "2048",
    "--attention-backend", "importance_torch", "--radix-eviction-policy", "importance",
    "--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--enable-metrics",
    "--hot-set-policy", "importance", "--hot-set-budget", "0.2", "--hot-set-threshold", "256",
    # A storage hit must not depend on how busy the machine is (best_effort may admit first).
    "--hicache-storage-prefetch-policy", "wait_complete",
]  # fmt: skip


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("hicache")


@pytest.fixture(scope="module")
def server(launch, storage):
    return launch(ARGS, env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)})


@pytest.fixture(scope="module")
def prompt(token_ids) -> list[int]:
    text = "The lighthouse keeper wrote down every ship that passed, its flag and its cargo. "
    return token_ids(text * 40, 480)


def test_the_server_runs_in_bfloat16(server):
    assert "KV Cache is allocated. dtype: torch.bfloat16" in server.log()


def test_a_prefix_read_back_from_the_device_the_host_and_the_file_tier_answers_as_computed(server, storage, prompt):
    first = generate_with_tops(server, prompt, MAX_NEW)
    again = generate_with_tops(server, prompt, MAX_NEW)  # the device's copy
    assert again["meta_info"]["cached_tokens"] > 0
    assert_same_until_a_near_tie(again["output_ids"], first["output_ids"], first["tops"])
    # Flushed: the device and host pools emptied, the pages are in the file tier only.
    assert settled(storage), "nothing was written to the file tier"
    assert flush_cache(server.url)
    stored = generate_with_tops(server, prompt, MAX_NEW)
    assert stored["meta_info"]["cached_tokens_details"]["storage"] > 0, stored["meta_info"]
    assert_same_until_a_near_tie(stored["output_ids"], first["output_ids"], first["tops"])


def test_a_hot_set_covering_every_page_decodes_as_dense(server, token_ids):
    ids = token_ids("Ships came from the north and the south, and each was logged. " * 80, 700)
    dense = {"custom_params": {"hot_set": {"policy": "dense"}}}
    covering = {"custom_params": {"hot_set": {"policy": "importance", "budget": 1.0}}}
    dense = generate_with_tops(server, ids, MAX_NEW, sampling_params=dense)
    hot = generate_with_tops(server, ids, MAX_NEW, sampling_params=covering)
    assert_same_until_a_near_tie(hot["output_ids"], dense["output_ids"], dense["tops"])


def test_a_small_budget_serves_and_releases_pages(server, token_ids):
    before = metrics_text(server.url)
    ids = token_ids("The keeper's log grew a page a night through the long winter. " * 90, 900)
    out = generate_with_tops(server, ids, MAX_NEW)
    assert len(out["output_ids"]) == MAX_NEW
    after = metrics_text(server.url)
    steps = metric(after, "sgl_importance:hot_set_steps_total") - metric(before, "sgl_importance:hot_set_steps_total")
    assert steps == MAX_NEW - 1
    assert metric(after, "sgl_importance:hot_set_pages_released_total") > 0
