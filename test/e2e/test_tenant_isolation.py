"""Tenants never share cached tokens, in any tier (issue #9).

A request's ``cache_salt`` or ``extra_key`` (top-level fields of ``/generate``)
is its tenant. SGLang keys its radix tree by the pair and seeds the storage
tier's page hashes with it, so an identical prompt from another tenant matches
nothing: not on the device, not in the host pool, not in the ``file`` tier after
``/flush_cache``, and not after a restart on the same storage directory. Each
tier is checked by the owner getting a hit there while everyone else gets none,
under the plugin's ``importance`` policy with its storage admission and its
remembered importance of stored pages.
"""

from __future__ import annotations

import pytest

from sgl_importance.client import flush_cache

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
DEVICE_TOKENS = 512
OWNER = {"cache_salt": "tenant-a"}
# Another salt, an extra_key spelled like the owner's salt, and no tenant at all.
OTHERS = [{"cache_salt": "tenant-b"}, {"extra_key": "tenant-a"}, {}]
TIERS = ("device", "host", "storage")


def document(name: str, items: int = 50) -> str:
    # ~4 tokens an item: 50 make ~200 tokens, 13 pages.
    return f"Document {name}: " + " ".join(f"{name}item{j}" for j in range(items))


def server_args() -> list[str]:
    return [
        "--page-size", str(PAGE),
        "--max-total-tokens", str(DEVICE_TOKENS),
        "--attention-backend", "importance_torch",
        "--radix-eviction-policy", "importance",
        "--enable-hierarchical-cache",
        # Room in the host pool for every document of the module.
        "--hicache-ratio", "8",
        "--hicache-storage-backend", "file",
        # A request waits for its storage fetch, so a storage hit never depends
        # on how busy the machine is (best_effort may admit it before the fetch).
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--enable-cache-report",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("hicache")


@pytest.fixture(scope="module")
def server(launch, storage):
    return launch(server_args(), env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)})


def cached(server, text: str, tenant: dict) -> dict:
    """{device, host, storage} tokens the request found cached."""
    meta = server.generate(text, max_new_tokens=2, **tenant)["meta_info"]
    # SGLang reports no details at all when nothing was cached.
    reported = meta["cached_tokens_details"] or {}
    details = {tier: reported.get(tier, 0) for tier in TIERS}
    assert sum(details.values()) == meta["cached_tokens"], meta
    return details


def push_out_of_device(server, tag: str) -> None:
    # Two untenanted documents of ~320 tokens overflow the device pool by
    # themselves; older pages move to the host.
    for i in range(2):
        server.generate(document(f"{tag}{i}", items=80), max_new_tokens=1)


def flush(server) -> bool:
    # Right after a response the scheduler may not be idle yet; SGLang's
    # `timeout` defers the flush until it is, instead of refusing it.
    r = flush_cache(server.url)
    return r.status_code == 200


# SGLang fetches from the storage tier only when at least `prefetch_threshold`
# tokens (256 by default) would come back, so the storage tests use documents
# longer than that (~400 tokens; the device and host tests' ~200 would never be
# fetched, by anyone).
STORED_ITEMS = 100


def assert_nothing_shared(server, text: str) -> None:
    for tenant in OTHERS:
        details = cached(server, text, tenant)
        assert sum(details.values()) == 0, (tenant, details)


def test_another_tenant_finds_none_of_a_prompt_cached_on_the_device(server):
    text = document("device")
    cached(server, text, OWNER)
    assert cached(server, text, OWNER)["device"] > 0
    # The other tenants' own runs land in the tree next to the owner's; none reuses it.
    assert_nothing_shared(server, text)


def test_another_tenant_finds_none_of_a_prompt_moved_to_the_host_pool(server):
    text = document("host")
    cached(server, text, OWNER)
    push_out_of_device(server, "host")
    assert cached(server, text, OWNER)["host"] > 0
    # Loaded back, the owner's pages are now on the device and in the host pool.
    assert_nothing_shared(server, text)


def test_another_tenant_finds_none_of_a_prompt_in_storage_after_flush_cache(server):
    text = document("storage", items=STORED_ITEMS)
    cached(server, text, OWNER)
    push_out_of_device(server, "storage")
    assert flush(server)
    assert_nothing_shared(server, text)
    # The others' runs are stored too; flush again so the owner can only hit storage.
    assert flush(server)
    details = cached(server, text, OWNER)
    assert details["storage"] > 0 and details["device"] == 0 and details["host"] == 0, details


def test_another_tenant_finds_none_of_a_prompt_stored_before_a_restart(server, launch, storage):
    # Last in the module: replaces the shared server with one on the same storage.
    text = document("restart", items=STORED_ITEMS)
    cached(server, text, OWNER)
    push_out_of_device(server, "restart")
    assert flush(server)
    assert cached(server, text, OWNER)["storage"] > 0, "the owner's pages never reached storage"
    server.stop()

    restarted = launch(server_args(), env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)})
    assert_nothing_shared(restarted, text)
    assert flush(restarted)
    assert cached(restarted, text, OWNER)["storage"] > 0
