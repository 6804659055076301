"""Storage-tier integrity: pages are sealed on write, verified on read, and a damaged,
short, foreign or missing page is a miss that is dropped, counted and logged once.

Runs SGLang's real ``file`` backend (HiCacheFile) in a temporary directory under the
wrapper, with a small host pool; no server.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, HiCacheStorageConfig

from sgl_importance.config import ImportanceConfig
from sgl_importance.storage import file
from sgl_importance.storage.breaker import MAX_WRITE_FAILURES, WriteBreaker
from sgl_importance.storage.factory import check_cli_args, wrap_backend
from sgl_importance.storage.page import CHECKSUM, FORMAT, LAYOUT, SHORT, TRAILER_BYTES, check, layout_fingerprint, seal
from sgl_importance.storage.wrapper import IntegrityStorage

PAGE = 4
WIDTH = 24  # elements per token in the flat page


class HostPool:
    """The host-pool calls storage backends make: flat pages in and out by token index."""

    def __init__(self, pages: int = 8, page_size: int = PAGE, dtype=torch.bfloat16, layout="page_first"):
        self.page_size, self.dtype, self.layout = page_size, dtype, layout
        self.buffer = torch.zeros(pages * page_size, WIDTH, dtype=dtype)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.buffer.copy_(torch.randn(self.buffer.shape, generator=g).to(self.dtype))

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * WIDTH, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buffer[index : index + self.page_size].flatten()

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self.buffer[index : index + self.page_size] = data.view(self.page_size, WIDTH)

    def page(self, i: int) -> torch.Tensor:
        return self.buffer[i * self.page_size : (i + 1) * self.page_size]


def storage_config(model: str = "m") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=None,
    )  # fmt: skip


class Tier:
    """A HiCacheFile in ``directory`` under the wrapper, with its own host pool and counts."""

    def __init__(self, directory: Path, model: str = "m", **pool_kwargs):
        self.corrupt: list[str] = []
        self.pool = HostPool(**pool_kwargs)
        inner = HiCacheFile(storage_config(model))
        self.storage = wrap_backend(inner, "file", storage_config(model), retry_s=30.0)
        self.storage.on_corrupt = self.corrupt.append
        self.storage.register_mem_pool_host(self.pool)
        self.directory = directory

    def indices(self, pages: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])

    def files(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if p.suffix == ".bin")


@pytest.fixture
def tier_dir(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(directory))
    return directory


@pytest.fixture
def written(tier_dir) -> Tier:
    """Three pages of random KV written under keys k0..k2."""
    tier = Tier(tier_dir)
    tier.pool.fill_random(0)
    assert tier.storage.batch_set_v1(["k0", "k1", "k2"], tier.indices([0, 1, 2])) == [True] * 3
    return tier


def read_back(tier: Tier, keys: list[str]) -> tuple[list[bool], torch.Tensor]:
    """Read ``keys`` into pages 4.. of the pool; returns results and those pages."""
    results = tier.storage.batch_get_v1(keys, tier.indices(list(range(4, 4 + len(keys)))))
    return results, tier.pool.buffer[4 * PAGE : (4 + len(keys)) * PAGE]


def file_of(tier: Tier, key: str) -> Path:
    return Path(tier.storage.ops.where(key))


# -- the format --------------------------------------------------------------------------


def test_sealed_page_is_its_bytes_followed_by_a_32_byte_trailer():
    payload = torch.arange(64, dtype=torch.int16)
    sealed = seal("key", payload, fingerprint=7)
    assert sealed.numel() == payload.numel() * 2 + TRAILER_BYTES
    assert torch.equal(sealed[:128], payload.view(torch.uint8))
    assert check("key", sealed, 7, 128) is None


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda b: b.__setitem__(5, b[5] ^ 0x01), CHECKSUM),  # one bit in the payload
        (lambda b: b.__setitem__(slice(None), 0), FORMAT),  # zero-filled
        (lambda b: b.__setitem__(128 + 12, b[128 + 12] ^ 0xFF), LAYOUT),  # fingerprint field
        (lambda b: b.__setitem__(-1, b[-1] ^ 0x80), CHECKSUM),  # the stored checksum
    ],
    ids=["bit_flip", "zero_fill", "fingerprint", "checksum_field"],
)
def test_each_kind_of_damage_to_a_sealed_page_is_detected(damage, reason):
    sealed = seal("key", torch.arange(64, dtype=torch.int16), fingerprint=7)
    damage(sealed)
    assert check("key", sealed, 7, 128) == reason


def test_a_page_sealed_under_another_key_or_layout_is_refused():
    sealed = seal("key", torch.arange(64, dtype=torch.int16), fingerprint=7)
    assert check("other", sealed, 7, 128) == CHECKSUM
    assert check("key", sealed, 8, 128) == LAYOUT
    assert check("key", sealed[:-1], 7, 128) == SHORT


def test_layout_fingerprint_changes_with_every_field():
    base = dict(model="m", dtype="bf16", page_size=16, layout="page_first", page_shape=(1, 2))
    reference = layout_fingerprint(**base)
    for field, other in [
        ("model", "n"),
        ("dtype", "fp16"),
        ("page_size", 32),
        ("layout", "layer_first"),
        ("page_shape", (2, 1)),
    ]:
        assert layout_fingerprint(**{**base, field: other}) != reference, field


# -- through SGLang's file tier ----------------------------------------------------------


def test_pages_round_trip_through_the_file_tier(written):
    results, pages = read_back(written, ["k0", "k1", "k2"])
    assert results == [True, True, True]
    assert torch.equal(pages, written.pool.buffer[: 3 * PAGE])
    assert written.corrupt == []


def test_copy_path_get_and_set_round_trip(tier_dir):
    tier = Tier(tier_dir)
    tier.pool.fill_random(1)
    assert tier.storage.batch_set(["a", "b"], [tier.pool.get_data_page(0), tier.pool.get_data_page(PAGE)])
    got = tier.storage.batch_get(["a", "b"], [tier.pool.get_dummy_flat_data_page() for _ in range(2)])
    assert torch.equal(got[0], tier.pool.get_data_page(0)) and torch.equal(got[1], tier.pool.get_data_page(PAGE))


def test_file_on_disk_holds_the_trailer_after_the_page(written):
    size = file_of(written, "k0").stat().st_size
    assert size == PAGE * WIDTH * 2 + TRAILER_BYTES


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 0x10]) + p.read_bytes()[1:]), CHECKSUM),
        (lambda p: p.write_bytes(p.read_bytes()[:100]), SHORT),
        (lambda p: p.write_bytes(bytes(p.stat().st_size)), FORMAT),
    ],
    ids=["flipped", "truncated", "zero_filled"],
)
def test_damaged_page_file_is_a_miss_dropped_counted_and_rewritable(written, damage, reason):
    path = file_of(written, "k1")
    damage(path)
    results, pages = read_back(written, ["k0", "k1", "k2"])
    # Storage is a prefix: the damaged page and everything after it are misses.
    assert results == [True, False, False]
    assert torch.equal(pages[:PAGE], written.pool.page(0))
    assert written.corrupt == [reason]
    assert not path.exists() and not written.storage.exists("k1")
    # Recomputed KV is written again and then served.
    assert written.storage.batch_set_v1(["k1"], written.indices([1])) == [True]
    assert read_back(written, ["k0", "k1", "k2"])[0] == [True, True, True]


def test_pages_after_a_damaged_one_are_verified_too_so_one_request_repairs_the_prefix(written):
    for key in ("k0", "k2"):
        path = file_of(written, key)
        path.write_bytes(bytes(path.stat().st_size))
    assert read_back(written, ["k0", "k1", "k2"])[0] == [False, False, False]
    assert written.corrupt == [FORMAT, FORMAT]
    assert [p.name for p in written.files()] == [file_of(written, "k1").name]


def test_missing_page_file_is_an_ordinary_miss_not_corruption(written):
    file_of(written, "k2").unlink()
    assert read_back(written, ["k0", "k1", "k2"])[0] == [True, True, False]
    assert written.corrupt == []


def test_page_written_by_another_model_or_page_layout_is_refused(tier_dir, written):
    other = Tier(tier_dir, dtype=torch.float16)
    assert read_back(other, ["k0"])[0] == [False]
    assert other.corrupt == [LAYOUT]


def test_raw_page_written_without_the_wrapper_is_refused(tier_dir):
    tier = Tier(tier_dir)
    tier.pool.fill_random(2)
    raw = HiCacheFile(storage_config())
    assert raw.set("raw", tier.pool.get_data_page(0))
    # Exactly one page long, no trailer: reading a sealed page's length comes up short.
    assert tier.storage.get("raw", tier.pool.get_dummy_flat_data_page()) is None
    assert tier.corrupt in ([SHORT], [FORMAT])


def test_damaged_file_is_logged_once_with_its_path(written, caplog):
    path = file_of(written, "k0")
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        path.write_bytes(bytes(path.stat().st_size))
        assert read_back(written, ["k0"])[0] == [False]
        written.storage.batch_set_v1(["k0"], written.indices([0]))
    lines = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(lines) == 1 and "refused" in lines[0]
    assert written.corrupt == [FORMAT, FORMAT]


def test_per_pool_transfers_are_sealed_too(tier_dir):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    tier = Tier(tier_dir)
    tier.pool.fill_random(3)
    tier.storage.register_mem_host_pool_v2(tier.pool, PoolName.KV)
    out = tier.storage.batch_set_v2(
        [PoolTransfer(name=PoolName.KV, host_indices=tier.indices([0, 1]), keys=["x", "y"])]
    )
    assert out[PoolName.KV] == [True, True]
    back = tier.storage.batch_get_v2(
        [PoolTransfer(name=PoolName.KV, host_indices=tier.indices([5, 6]), keys=["x", "y"])]
    )
    assert back[PoolName.KV] == [True, True]
    assert torch.equal(tier.pool.buffer[5 * PAGE : 7 * PAGE], tier.pool.buffer[: 2 * PAGE])


# -- write failures --------------------------------------------------------------------


class FailingStore(HiCacheStorage):
    """A backend whose writes fail until ``healthy`` is set; counts attempts."""

    def __init__(self):
        self.healthy, self.attempts, self.data = False, 0, {}

    def get(self, key, target_location=None, target_sizes=None):
        if key not in self.data:
            return None
        target_location.copy_(self.data[key])
        return target_location

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self.attempts += 1
        if not self.healthy:
            raise OSError(28, "No space left on device")
        self.data[key] = value.clone()
        return True

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, t) for k, t in zip(keys, target_locations)]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return all(self.set(k, v) for k, v in zip(keys, values))

    def exists(self, key):
        return key in self.data


def test_writes_pause_after_repeated_failures_warn_once_and_resume_after_the_retry_delay(caplog):
    now = [0.0]
    pauses = []
    store = FailingStore()
    breaker = WriteBreaker(
        MAX_WRITE_FAILURES, 10.0, "test store", clock=lambda: now[0], on_pause=lambda: pauses.append(1)
    )
    storage = IntegrityStorage(store, {"model": "m"}, breaker=breaker)
    pool = HostPool()
    storage.register_mem_pool_host(pool)
    caplog.set_level(logging.WARNING)
    for _ in range(3 * MAX_WRITE_FAILURES):
        assert storage.set("k", pool.get_data_page(0)) is False
    assert store.attempts == MAX_WRITE_FAILURES  # later writes never reach the disk
    now[0] = 11.0
    assert storage.set("k", pool.get_data_page(0)) is False  # one retry, fails, pauses again
    assert store.attempts == MAX_WRITE_FAILURES + 1
    store.healthy = True
    now[0] = 22.0
    assert storage.set("k", pool.get_data_page(0)) is True
    assert storage.get("k", pool.get_dummy_flat_data_page()) is not None
    paused = [r for r in caplog.records if "writes paused" in r.getMessage()]
    assert len(paused) == 1 and "test store" in paused[0].getMessage()
    assert any("writes resumed" in r.getMessage() for r in caplog.records)
    assert pauses == [1]


def test_reads_keep_working_while_writes_are_paused(tier_dir):
    tier = Tier(tier_dir)
    tier.pool.fill_random(4)
    assert tier.storage.batch_set_v1(["k0"], tier.indices([0])) == [True]
    for _ in range(MAX_WRITE_FAILURES):
        tier.storage.breaker.record(False)
    assert tier.storage.batch_set_v1(["k1"], tier.indices([1])) == [False]
    assert read_back(tier, ["k0"])[0] == [True]


# -- the file tier's directory ---------------------------------------------------------


def test_a_regular_file_at_the_storage_path_is_refused_in_one_line(tmp_path):
    path = tmp_path / "hicache"
    path.write_text("not a directory")
    with pytest.raises(ValueError) as err:
        file.check_storage_dir(str(path))
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "regular file" in message


def test_the_launcher_check_reads_the_file_directory_from_the_extra_config(tmp_path, monkeypatch):
    path = tmp_path / "hicache"
    path.write_text("not a directory")
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    args = argparse.Namespace(
        hicache_storage_backend="file",
        enable_hierarchical_cache=True,
        hicache_storage_backend_extra_config=json.dumps({"file_storage_path": str(path)}),
    )
    with pytest.raises(ValueError, match="regular file"):
        check_cli_args(args)
    # Without the hierarchical cache the storage tier is never built: nothing to check.
    check_cli_args(argparse.Namespace(**{**vars(args), "enable_hierarchical_cache": False}))


def test_a_missing_storage_directory_is_created(tmp_path):
    path = tmp_path / "a" / "b"
    file.check_storage_dir(str(path))
    assert path.is_dir()


def test_unfinished_temporary_files_are_removed_and_pages_kept(tmp_path):
    (tmp_path / ".0123abcd.tmp").write_bytes(b"partial")
    (tmp_path / "page_m_0_1.bin").write_bytes(b"page")
    assert file.remove_leftovers(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == ["page_m_0_1.bin"]


def test_wrapping_cleans_leftovers_of_a_killed_writer(tier_dir):
    tier_dir.mkdir()
    (tier_dir / ".deadbeef.tmp").write_bytes(b"partial")
    Tier(tier_dir)
    assert not (tier_dir / ".deadbeef.tmp").exists()


# -- configuration ---------------------------------------------------------------------


def test_integrity_is_on_by_default_and_can_be_turned_off():
    assert ImportanceConfig().storage_integrity == "on"
    assert ImportanceConfig(storage_integrity="off").storage_integrity == "off"
    with pytest.raises(ValueError, match="--importance-storage-integrity 'maybe' is invalid"):
        ImportanceConfig(storage_integrity="maybe")


@pytest.mark.parametrize("value", [0, -1.0, 1e9])
def test_retry_delay_out_of_range_names_the_flag(value):
    with pytest.raises(ValueError, match="--importance-storage-retry-s"):
        ImportanceConfig(storage_retry_s=value)


def test_refused_pages_and_pauses_are_counted_by_reason_on_their_own_series():
    from prometheus_client import CollectorRegistry

    from sgl_importance.metrics import StorageIntegrityMetrics

    registry = CollectorRegistry()
    metrics = StorageIntegrityMetrics({"tp_rank": 0, "pp_rank": 0}, registry=registry)
    metrics.corrupt(CHECKSUM)
    metrics.corrupt(CHECKSUM)
    metrics.corrupt(SHORT)
    metrics.paused()
    value = registry.get_sample_value
    labels = {"tp_rank": "0", "pp_rank": "0"}
    assert value("sgl_importance:storage_corrupt_pages_total", {**labels, "reason": CHECKSUM}) == 2
    assert value("sgl_importance:storage_corrupt_pages_total", {**labels, "reason": SHORT}) == 1
    assert value("sgl_importance:storage_write_pauses_total", labels) == 1
