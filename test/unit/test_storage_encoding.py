"""Storage-tier page encoding: pages stored at the model's dtype, 8 or 4 bits by class.

The encoding itself (``storage/encoding.py``: round trips within each class's bound,
keys per channel and values per token, determinism, sizes, grading), and the
integrity wrapper storing classes through SGLang's real ``file`` backend and a
dict-backed Mooncake store (class in the trailer under the checksum, pages refused
by a reader with the flag off, mixed classes in one prefix, a page written by
another server decoded by its own class). No server.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from sgl_importance.cache import stored
from sgl_importance.config import ImportanceConfig
from sgl_importance.storage import encoding
from sgl_importance.storage.encoding import FULL, INT4, INT8, LAYOUT_AXES, PageGeometry
from sgl_importance.storage.factory import wrap_backend
from sgl_importance.storage.page import (
    CHECKSUM,
    ENCODED_VERSION,
    SHORT,
    TRAILER,
    TRAILER_BYTES,
    check_whole,
    seal_encoded,
)
from sgl_importance.storage.precision import PageClasses, make_precision, page_classes_for

LAYERS, HEADS, DIM, PAGE = 2, 2, 8, 4
# SmolLM2-135M, the model the servers here run: 30 layers, 3 KV heads, 64 channels.
SMOLLM = PageGeometry(layers=30, tokens=16, heads=3, dim=64)


def random_page(geometry: PageGeometry, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(geometry.numel, generator=g) * scale


# -- the encoding -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUT_AXES))
@pytest.mark.parametrize("cls", [INT8, INT4])
def test_decoded_page_is_within_the_class_error_bound_in_every_layout(layout, cls):
    geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM, layout)
    page = random_page(geometry, seed=cls)
    back = encoding.decode(encoding.encode(page, geometry, cls), geometry, cls, torch.float32)
    error = (geometry.to_canonical(back) - geometry.to_canonical(page)).abs()
    bound = encoding.error_bound(page, geometry, cls)
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(error.max()) > 0  # quantised, not stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_full_class_stores_the_page_bytes_unchanged(dtype):
    geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM)
    page = random_page(geometry, seed=1).to(dtype)
    data = encoding.encode(page, geometry, FULL)
    assert data.numel() == page.numel() * page.element_size()
    assert torch.equal(encoding.decode(data, geometry, FULL, dtype), page)


def test_decoding_gives_the_host_pool_dtype():
    geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM)
    page = random_page(geometry, seed=2).to(torch.bfloat16)
    back = encoding.decode(encoding.encode(page, geometry, INT8), geometry, INT8, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.shape == page.shape
    assert float((back.float() - page.float()).abs().max()) < 0.2


def test_keys_are_quantised_per_channel_so_an_outlier_channel_costs_only_itself():
    geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM)
    canonical = torch.randn(2, LAYERS, HEADS, PAGE, DIM)
    canonical[0, :, :, :, 3] *= 1000.0  # one key channel a thousand times wider
    page = geometry.from_canonical(canonical)
    back = geometry.to_canonical(encoding.decode(encoding.encode(page, geometry, INT4), geometry, INT4, torch.float32))
    error = (back - canonical).abs()
    others = [c for c in range(DIM) if c != 3]
    # Per-channel groups: the other channels keep a normal-sized scale.
    assert float(error[0][..., others].max()) < 0.5
    assert float(error[0][..., 3].max()) > 10.0


def test_values_are_quantised_per_token_so_an_outlier_token_costs_only_itself():
    geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM)
    canonical = torch.randn(2, LAYERS, HEADS, PAGE, DIM)
    canonical[1, :, :, 2, :] *= 1000.0  # one value token a thousand times wider
    page = geometry.from_canonical(canonical)
    back = geometry.to_canonical(encoding.decode(encoding.encode(page, geometry, INT4), geometry, INT4, torch.float32))
    error = (back - canonical).abs()
    assert float(error[1][:, :, [0, 1, 3], :].max()) < 0.5
    assert float(error[1][:, :, 2, :].max()) > 10.0


@pytest.mark.parametrize("cls", [FULL, INT8, INT4])
def test_the_same_page_and_class_give_the_same_bytes(cls):
    geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM, "page_first")
    page = random_page(geometry, seed=3)
    first = encoding.encode(page, geometry, cls).clone()
    assert torch.equal(first, encoding.encode(page.clone(), geometry, cls))


def test_encoded_sizes_for_the_served_model_in_float32():
    assert encoding.encoded_nbytes(SMOLLM, FULL, torch.float32) == 737_280
    assert encoding.encoded_nbytes(SMOLLM, INT8, torch.float32) == 213_120
    assert encoding.encoded_nbytes(SMOLLM, INT4, torch.float32) == 120_960
    assert encoding.bits_per_element(SMOLLM, INT8, torch.float32) == pytest.approx(9.25)
    assert encoding.bits_per_element(SMOLLM, INT4, torch.float32) == pytest.approx(5.25)


def test_graded_defaults_store_at_most_a_quarter_of_float32():
    t = ImportanceConfig(storage_precision="graded").storage_precision_thresholds()
    full, int4 = t["keep"], t["cold"]
    bits = sum(
        share * encoding.bits_per_element(SMOLLM, cls, torch.float32)
        for share, cls in ((full, FULL), (1 - full - int4, INT8), (int4, INT4))
    )
    assert bits <= 32 / 4


def test_a_page_with_non_finite_elements_is_not_encoded():
    geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM)
    page = random_page(geometry, seed=4)
    page[5] = float("inf")
    assert encoding.encode(page, geometry, INT8) is None
    page[5] = 1e9  # a range float16 scales cannot hold
    assert encoding.encode(page, geometry, INT4) is None


def test_decoding_refuses_bytes_of_the_wrong_size():
    geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM)
    data = encoding.encode(random_page(geometry, 5), geometry, INT8)
    with pytest.raises(ValueError, match="needs"):
        encoding.decode(data[:-2], geometry, INT8, torch.float32)


# -- grading ------------------------------------------------------------------------------


def test_grading_keeps_sinks_and_the_most_important_and_puts_the_coldest_at_4_bits():
    scores = [0.0, 5.0, 1.0, 2.0, 9.0, 0.1, 0.2, 0.3, 3.0, 4.0]
    classes = encoding.grade(scores, sink=[True] + [False] * 9, keep=0.2, cold=0.5)
    assert classes[0] == FULL and classes[4] == FULL  # the sink, then the hottest
    assert [i for i, c in enumerate(classes) if c == INT4] == [2, 3, 5, 6, 7]
    assert classes.count(INT8) == 3


def test_grading_without_any_importance_keeps_only_sinks_and_puts_the_tail_at_4_bits():
    classes = encoding.grade([0.0] * 10, sink=[True] + [False] * 9, keep=0.2, cold=0.5)
    assert classes == [FULL, INT8, INT8, INT8, INT8, INT4, INT4, INT4, INT4, INT4]


def test_blind_grading_spends_the_same_bytes_without_looking_at_importance():
    scores = list(range(20))
    keys = [f"h{i}" for i in range(20)]
    by_importance = encoding.grade(scores, sink=[False] * 20, keep=0.1, cold=0.6, keys=keys)
    blind = encoding.grade(scores, sink=[False] * 20, keep=0.1, cold=0.6, order="blind", keys=keys)
    assert sorted(blind) == sorted(by_importance)
    assert blind != by_importance
    assert blind == encoding.grade(scores[::-1], sink=[False] * 20, keep=0.1, cold=0.6, order="blind", keys=keys)


# -- through the storage tier ---------------------------------------------------------------


class MHAPool:
    """The host-pool calls the wrapper makes, for pages of one MHA geometry."""

    def __init__(self, layout: str = "layer_first", dtype=torch.float32, pages: int = 8):
        self.geometry = PageGeometry(LAYERS, PAGE, HEADS, DIM, layout)
        self.layer_num, self.head_num, self.head_dim, self.page_size = LAYERS, HEADS, DIM, PAGE
        self.layout, self.dtype = layout, dtype
        self.pages = torch.zeros(pages, self.geometry.numel, dtype=dtype)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.pages.copy_((torch.randn(self.pages.shape, generator=g) * 2).to(self.dtype))

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.geometry.numel, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.pages[index // PAGE]

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self.pages[index // PAGE] = data


def storage_config() -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="m", extra_config=None,
    )  # fmt: skip


class Tier:
    """SGLang's HiCacheFile (directory from the environment) under the wrapper."""

    def __init__(self, precision: str = "off", thresholds: dict | None = None, **pool_kwargs):
        self.corrupt: list[str] = []
        self.pages: list[tuple[str, int, int]] = []
        self.pool = MHAPool(**pool_kwargs)
        # The process's grading under "graded" (the runtime's).
        self.classes = page_classes_for(precision, thresholds)
        self.storage = wrap_backend(
            HiCacheFile(storage_config()),
            "file",
            storage_config(),
            retry_s=30.0,
            precision=precision,
            classes=self.classes,
        )
        self.storage.on_corrupt = self.corrupt.append
        self.storage.on_page = lambda op, cls, n: self.pages.append((op, cls, n))
        self.storage.register_mem_pool_host(self.pool)

    @staticmethod
    def indices(pages: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])

    def write(self, keys: list[str], pages: list[int]) -> list[bool]:
        return self.storage.batch_set_v1(keys, self.indices(pages))

    def read(self, keys: list[str], into: list[int]) -> list[bool]:
        return self.storage.batch_get_v1(keys, self.indices(into))

    def file(self, key: str) -> Path:
        return Path(self.storage.ops.where(key))


@pytest.fixture
def tier_dir(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(directory))
    return directory


def canonical_error(pool: MHAPool, a: int, b: int) -> torch.Tensor:
    g = pool.geometry
    return (g.to_canonical(pool.pages[a].float()) - g.to_canonical(pool.pages[b].float())).abs()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("setting,cls", [("uniform8", INT8), ("uniform4", INT4)])
def test_uniform_pages_round_trip_through_the_file_tier_within_their_bound(tier_dir, layout, setting, cls):
    tier = Tier(setting, layout=layout)
    tier.pool.fill_random(0)
    assert tier.write(["k0", "k1"], [0, 1]) == [True, True]
    assert tier.read(["k0", "k1"], [4, 5]) == [True, True]
    for src, dst in ((0, 4), (1, 5)):
        bound = encoding.error_bound(tier.pool.pages[src], tier.pool.geometry, cls)
        assert bool((canonical_error(tier.pool, src, dst) <= bound).all())
    size = encoding.encoded_nbytes(tier.pool.geometry, cls, torch.float32)
    assert tier.file("k0").stat().st_size == size + TRAILER_BYTES
    assert [p for p in tier.pages if p[0] == "write"] == [("write", cls, size)] * 2
    assert tier.corrupt == []


def test_the_file_on_disk_records_the_class_in_a_version_2_trailer(tier_dir):
    tier = Tier("uniform4")
    tier.pool.fill_random(1)
    tier.write(["k0"], [0])
    raw = tier.file("k0").read_bytes()
    magic, version, cls, _, length, _ = TRAILER.unpack_from(raw, len(raw) - TRAILER_BYTES)
    assert (magic, version, cls, length) == (b"SGIK", ENCODED_VERSION, INT4, len(raw) - TRAILER_BYTES)


def test_the_same_page_and_class_are_stored_as_the_same_bytes(tmp_path, monkeypatch):
    files = []
    for run in ("a", "b"):
        monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / run))
        tier = Tier("uniform8")
        tier.pool.fill_random(7)
        tier.write(["k0"], [0])
        files.append(tier.file("k0").read_bytes())
    assert files[0] == files[1]


def test_the_checksum_covers_the_encoded_bytes_and_the_class(tier_dir):
    tier = Tier("uniform8")
    tier.pool.fill_random(2)
    tier.write(["k0", "k1"], [0, 1])
    one = bytearray(tier.file("k0").read_bytes())
    one[100] ^= 0x01  # a code in the encoded payload
    tier.file("k0").write_bytes(bytes(one))
    two = bytearray(tier.file("k1").read_bytes())
    struct.pack_into("<H", two, len(two) - TRAILER_BYTES + 6, INT4)  # the class, rewritten
    tier.file("k1").write_bytes(bytes(two))
    assert tier.read(["k0"], [4]) == [False]
    assert tier.read(["k1"], [5]) == [False]
    assert tier.corrupt == [CHECKSUM, CHECKSUM]
    assert not tier.file("k0").exists() and not tier.file("k1").exists()  # dropped, rewritable


def test_check_whole_reads_the_class_of_a_sealed_encoded_page():
    data = torch.arange(40, dtype=torch.uint8)
    sealed = seal_encoded("key", data, 1234, INT8).numpy()
    assert check_whole("key", sealed, 1234) == (None, INT8, 40)
    assert check_whole("other", sealed, 1234)[0] == CHECKSUM
    assert check_whole("key", sealed[:-1], 1234)[0] is not None


def test_a_server_with_the_flag_off_refuses_an_encoded_page_as_a_miss_and_recomputes(tier_dir):
    writer = Tier("uniform4")
    writer.pool.fill_random(3)
    writer.write(["k0"], [0])
    reader = Tier("off")
    reader.pool.pages.fill_(7.0)
    assert reader.read(["k0"], [4]) == [False]
    assert reader.corrupt == [SHORT]  # HiCacheFile reads a whole float32 page: the file is shorter
    assert torch.equal(reader.pool.pages[4], torch.full_like(reader.pool.pages[4], 7.0))  # nothing served
    assert not reader.file("k0").exists()  # dropped: the recomputed page is written again
    reader.pool.fill_random(3)
    assert reader.write(["k0"], [0]) == [True]
    assert reader.read(["k0"], [4]) == [True]
    assert torch.equal(reader.pool.pages[4], reader.pool.pages[0])


def test_pages_written_with_the_flag_off_are_counted_as_full(tier_dir):
    tier = Tier("off")
    tier.pool.fill_random(11)
    tier.write(["k0"], [0])
    tier.read(["k0"], [4])
    n = tier.pool.geometry.numel * 4
    assert tier.pages == [("write", FULL, n), ("read", FULL, n)]


def test_a_server_with_the_flag_on_serves_pages_written_unencoded(tier_dir):
    writer = Tier("off")
    writer.pool.fill_random(4)
    writer.write(["k0"], [0])
    reader = Tier("graded")
    assert reader.read(["k0"], [4]) == [True]
    assert torch.equal(reader.pool.pages[4], writer.pool.pages[0])
    assert reader.pages == [("read", FULL, writer.pool.pages[0].numel() * 4)]


def test_a_page_written_by_another_server_is_decoded_by_its_own_class(tier_dir):
    writer = Tier("uniform4")
    writer.pool.fill_random(5)
    writer.write(["k0"], [0])
    reader = Tier("uniform8")  # another setting: the trailer's class decides, not the reader's
    assert reader.read(["k0"], [4]) == [True]
    bound = encoding.error_bound(writer.pool.pages[0], writer.pool.geometry, INT4)
    error = (
        reader.pool.geometry.to_canonical(reader.pool.pages[4])
        - writer.pool.geometry.to_canonical(writer.pool.pages[0])
    ).abs()
    assert bool((error <= bound).all())
    assert reader.pages == [("read", INT4, encoding.encoded_nbytes(writer.pool.geometry, INT4, torch.float32))]


def test_mixed_classes_in_one_prefix_round_trip_each_within_its_own_bound(tier_dir):
    tier = Tier("graded", thresholds={"keep": 0.25, "cold": 0.5, "sink_pages": 1})
    tier.pool.fill_random(6)
    keys = ["p0", "p1", "p2", "p3"]
    classes = tier.classes.assign(keys, [0.0, 0.9, 0.5, 0.1], first_page=0)
    assert classes == [FULL, INT8, INT4, INT4]  # sink; then by importance: 0.9 int8, coldest int4
    assert tier.write(keys, [0, 1, 2, 3]) == [True] * 4
    assert tier.read(keys, [4, 5, 6, 7]) == [True] * 4
    for i, cls in enumerate(classes):
        bound = encoding.error_bound(tier.pool.pages[i], tier.pool.geometry, cls)
        assert bool((canonical_error(tier.pool, i, 4 + i) <= bound).all()), i
    assert torch.equal(tier.pool.pages[4], tier.pool.pages[0])  # the full page is exact
    sizes = [tier.file(k).stat().st_size - TRAILER_BYTES for k in keys]
    assert sizes == [encoding.encoded_nbytes(tier.pool.geometry, c, torch.float32) for c in classes]


def test_a_page_never_graded_is_stored_at_8_bits_and_counted(tier_dir):
    tier = Tier("graded")
    tier.pool.fill_random(8)
    tier.write(["stray"], [0])
    assert [p[1] for p in tier.pages] == [INT8]
    assert tier.classes.ungraded == 1


class FlatPool(MHAPool):
    """A pool whose pages are not one K and one V per layer (no MHA geometry)."""

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.geometry.numel + 1, dtype=self.dtype)


def test_a_host_pool_that_is_not_mha_keeps_its_pages_at_its_dtype(tier_dir):
    tier = Tier("uniform4")
    tier.pool = FlatPool()
    tier.pool.pages = torch.randn(8, tier.pool.geometry.numel + 1)
    tier.storage.register_mem_pool_host(tier.pool)
    assert tier.write(["k0"], [0]) == [True]
    assert tier.read(["k0"], [4]) == [True]
    assert torch.equal(tier.pool.pages[4], tier.pool.pages[0])
    assert [p[1] for p in tier.pages] == [FULL, FULL]


# -- Mooncake (whole objects through the store client) ----------------------------------------


class DictStore:
    """The calls MooncakePages makes on Mooncake's store client."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def put(self, key, value):
        self.objects[key] = bytes(value)
        return 0

    def get(self, key):
        return self.objects.get(key, b"")

    def is_exist(self, key):
        return 1 if key in self.objects else 0

    def batch_is_exist(self, keys):
        return [self.is_exist(k) for k in keys]

    def remove(self, key):
        self.objects.pop(key, None)
        return 0


def mooncake_tier(store: DictStore, precision: str) -> tuple:
    from sgl_importance.storage.mooncake import MooncakePages, mooncake_ops
    from sgl_importance.storage.wrapper import IntegrityStorage

    pages = MooncakePages(SimpleNamespace(store=store, config_prefix="m"), rank=0)
    wrapped = IntegrityStorage(
        pages,
        {"model": "m"},
        ops=mooncake_ops(pages),
        precision=make_precision(precision, page_classes_for(precision, None)),
    )
    pool = MHAPool()
    wrapped.register_mem_pool_host(pool)
    return wrapped, pool


def test_mooncake_pages_are_stored_encoded_and_read_back_whole():
    store = DictStore()
    writer, pool = mooncake_tier(store, "uniform4")
    pool.fill_random(9)
    assert writer.batch_set_v1(["h0"], Tier.indices([0])) == [True]
    (obj,) = store.objects.values()
    assert len(obj) == encoding.encoded_nbytes(pool.geometry, INT4, torch.float32) + TRAILER_BYTES
    reader, other = mooncake_tier(store, "graded")
    assert reader.batch_get_v1(["h0"], Tier.indices([2])) == [True]
    bound = encoding.error_bound(pool.pages[0], pool.geometry, INT4)
    error = (pool.geometry.to_canonical(other.pages[2]) - pool.geometry.to_canonical(pool.pages[0])).abs()
    assert bool((error <= bound).all())


def test_mooncake_reader_with_the_flag_off_refuses_an_encoded_page():
    store = DictStore()
    writer, pool = mooncake_tier(store, "uniform8")
    pool.fill_random(10)
    writer.batch_set_v1(["h0"], Tier.indices([0]))
    reader, other = mooncake_tier(store, "off")
    corrupt: list[str] = []
    reader.on_corrupt = corrupt.append
    assert reader.batch_get_v1(["h0"], Tier.indices([2])) == [False]
    assert len(corrupt) == 1 and store.objects == {}  # refused, dropped


# -- the flag ------------------------------------------------------------------------------------


def test_storage_precision_is_off_by_default():
    assert ImportanceConfig().storage_precision == "off"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"storage_precision": "int3"}, "--importance-storage-precision 'int3' is invalid"),
        ({"storage_precision": "graded", "storage_integrity": "off"}, "needs --importance-storage-integrity on"),
        ({"storage_precision_config": "[1]"}, "a JSON object"),
        ({"storage_precision_config": json.dumps({"hot": 0.1})}, "unknown keys"),
        ({"storage_precision_config": json.dumps({"keep": 1.5})}, "keep=1.5 is invalid"),
        ({"storage_precision_config": json.dumps({"keep": 0.5, "cold": 0.6})}, "keep \\+ cold"),
        ({"storage_precision_config": json.dumps({"sink_pages": -1})}, "sink_pages=-1"),
        ({"storage_precision_config": json.dumps({"order": "random"})}, "order='random'"),
    ],
)
def test_invalid_storage_precision_settings_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImportanceConfig(**kwargs)


def test_thresholds_json_overrides_only_the_keys_it_names():
    config = ImportanceConfig(storage_precision="graded", storage_precision_config='{"cold": 0.7}')
    assert config.storage_precision_thresholds() == {"keep": 0.05, "cold": 0.7, "sink_pages": 1, "order": "importance"}


def test_per_class_pages_and_bytes_are_counted_on_their_own_series():
    from prometheus_client import CollectorRegistry

    from sgl_importance.metrics import StorageIntegrityMetrics

    registry = CollectorRegistry()
    metrics = StorageIntegrityMetrics({"tp_rank": 0}, registry=registry)
    metrics.page_of_class("write", INT4, 120)
    metrics.page_of_class("write", INT4, 120)
    metrics.page_of_class("read", FULL, 400)
    labels = {"tp_rank": "0"}
    get = registry.get_sample_value
    assert get("sgl_importance:storage_pages_total", {**labels, "op": "write", "precision": "int4"}) == 2
    assert get("sgl_importance:storage_page_bytes_total", {**labels, "op": "write", "precision": "int4"}) == 240
    assert get("sgl_importance:storage_pages_total", {**labels, "op": "read", "precision": "full"}) == 1


# -- grading at the write ------------------------------------------------------------------------


def fake_node(hashes: list[str], slots: torch.Tensor, parent=None, start_tokens: int = 0):
    root = SimpleNamespace(parent=None, key=[])
    if parent is None and start_tokens:
        parent = SimpleNamespace(parent=root, key=[0] * start_tokens)
    return SimpleNamespace(
        hash_value=hashes,
        component_data=[SimpleNamespace(value=slots)],
        parent=parent or root,
        key=list(range(len(slots))),
    )


def test_pages_are_graded_by_their_accumulated_attention_when_their_node_is_written(monkeypatch):
    from sgl_importance.importance import page_importance

    tables = page_importance.PageImportanceHolder()
    table = tables.current = page_importance.PageImportanceTable(16, page_size=PAGE)
    table.accumulated[:] = torch.tensor([0.0, 0, 0, 0, 0.9, 0.1, 0.8, 0.0, 0.05, 0.3, 0, 0, 0, 0, 0, 0])
    classes = PageClasses(keep=0.2, cold=0.4, sink_pages=1)
    # Device pages 4..9 hold the node's six pages; it starts at token 32 (page 8: no sink).
    slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in range(4, 10)])
    node = fake_node([f"h{i}" for i in range(6)], slots, start_tokens=32)
    cache = SimpleNamespace(page_size=PAGE, tree_core=SimpleNamespace(node_by_id=lambda i: node))
    assert stored.grade_before_storage_write(classes, tables, cache, 1) == 6
    got = [classes.class_of(f"h{i}") for i in range(6)]
    # scores 0.9 0.1 0.8 0.0 0.05 0.3: keep 1 (0.9), cold 2 (0.0, 0.05), the rest int8
    assert got == [FULL, INT8, INT8, INT4, INT4, INT8]


def test_the_first_page_of_a_sequence_is_a_sink_and_kept(monkeypatch):
    from sgl_importance.importance import page_importance

    tables = page_importance.PageImportanceHolder()  # no table: a node's pages score its importance
    classes = PageClasses(keep=0.0, cold=1.0, sink_pages=1)
    slots = torch.arange(3 * PAGE)
    node = fake_node(["a", "b", "c"], slots)
    cache = SimpleNamespace(page_size=PAGE, tree_core=SimpleNamespace(node_by_id=lambda i: node))
    stored.grade_before_storage_write(classes, tables, cache, 1)
    assert [classes.class_of(h) for h in "abc"] == [FULL, INT4, INT4]


def test_grading_is_a_no_op_unless_the_setting_is_graded():
    from sgl_importance.importance.page_importance import PageImportanceHolder

    assert stored.grade_before_storage_write(None, PageImportanceHolder(), SimpleNamespace(), 1) == 0
