"""Cost of storage-tier integrity: SGLang's `file` backend with and without the wrapper.

Writes N pages through ``HiCacheFile`` (its copy path: ``batch_set`` / ``batch_get``
of flat pages, as SGLang's controller drives it) into a fresh directory, reads them
back, and does the same through ``IntegrityStorage`` (seal + xxh3-64 on write,
verify + one memcpy on read). Reads are served from the OS page cache (the files
were just written), which is the case where the wrapper's CPU work shows most.
Also times xxh3-64 alone over the same pages, to separate hashing from I/O.

    python -m benchmark.storage.bench_integrity --out benchmark/storage/out
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
import xxhash

# Bytes of one 16-token page: SmolLM2-135M (30 layers, 3 KV heads, dim 64, bf16, K and V)
# and a Llama-3-8B-shaped model (32 layers, 8 KV heads, dim 128).
PAGE_SHAPES = {
    "smollm2-135m": 30 * 2 * 3 * 64 * 16,
    "llama3-8b": 32 * 2 * 8 * 128 * 16,
}


class FlatPool:
    """Flat bf16 pages, the host-pool calls the backends make."""

    def __init__(self, pages: int, elements: int):
        self.page_size, self.dtype, self.layout = 16, torch.bfloat16, "page_first"
        self.elements = elements
        self.data = torch.randn(pages, elements).to(torch.bfloat16)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.elements, dtype=self.dtype)


def storage_config():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench",
    )  # fmt: skip


def make_backend(directory: Path, wrapped: bool, pool: FlatPool):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from sgl_importance.storage.factory import wrap_backend

    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(directory)
    backend = HiCacheFile(storage_config())
    if wrapped:
        backend = wrap_backend(backend, "file", storage_config(), retry_s=30.0)
    backend.register_mem_pool_host(pool)
    return backend


def run_once(root: Path, wrapped: bool, pool: FlatPool, batch: int) -> tuple[float, float]:
    """Seconds to write all pages, seconds to read them all back (verified equal)."""
    directory = root / ("wrapped" if wrapped else "raw")
    shutil.rmtree(directory, ignore_errors=True)
    backend = make_backend(directory, wrapped, pool)
    keys = [f"page{i:06d}" for i in range(len(pool.data))]
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        assert backend.batch_set(keys[i : i + batch], list(pool.data[i : i + batch]))
    t1 = time.perf_counter()
    out = []
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        out += backend.batch_get(chunk, [pool.get_dummy_flat_data_page() for _ in chunk])
    t2 = time.perf_counter()
    assert all(o is not None for o in out) and torch.equal(torch.stack(out), pool.data)
    shutil.rmtree(directory, ignore_errors=True)
    return t1 - t0, t2 - t1


def hash_seconds(pool: FlatPool) -> float:
    t0 = time.perf_counter()
    for page in pool.data:
        xxhash.xxh3_64_intdigest(page.view(torch.uint8).numpy())
    return time.perf_counter() - t0


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, load average {load:.1f} at start"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256, help="pages per shape and run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the best is kept")
    parser.add_argument("--batch", type=int, default=128, help="pages per batch call (SGLang's STORAGE_BATCH_SIZE)")
    parser.add_argument("--dir", default=None, help="where page files go (default: a temp dir under /tmp)")
    parser.add_argument("--out", default="benchmark/storage/out")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-integrity-", dir=args.dir))
    rows = []
    try:
        for shape, elements in PAGE_SHAPES.items():
            pool = FlatPool(args.pages, elements)
            total = pool.data.numel() * 2
            best = {}
            for wrapped in (False, True):
                times = [run_once(root, wrapped, pool, args.batch) for _ in range(args.repeats)]
                best[wrapped] = (min(t[0] for t in times), min(t[1] for t in times))
            hashed = min(hash_seconds(pool) for _ in range(args.repeats))
            row = {
                "page": shape,
                "page_bytes": elements * 2,
                "pages": args.pages,
                "raw_write_gbs": total / best[False][0] / 1e9,
                "sealed_write_gbs": total / best[True][0] / 1e9,
                "raw_read_gbs": total / best[False][1] / 1e9,
                "verified_read_gbs": total / best[True][1] / 1e9,
                "xxh3_gbs": total / hashed / 1e9,
            }
            row["write_ratio"] = row["sealed_write_gbs"] / row["raw_write_gbs"]
            row["read_ratio"] = row["verified_read_gbs"] / row["raw_read_gbs"]
            rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    header = (
        "| page | bytes | write raw GB/s | write sealed GB/s | ratio "
        "| read raw GB/s | read verified GB/s | ratio | xxh3 alone GB/s |"
    )
    lines = [header, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['page']} | {r['page_bytes']} | {r['raw_write_gbs']:.2f} | {r['sealed_write_gbs']:.2f} | "
            f"{r['write_ratio']:.2f} | {r['raw_read_gbs']:.2f} | {r['verified_read_gbs']:.2f} | "
            f"{r['read_ratio']:.2f} | {r['xxh3_gbs']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    (out / "results.json").write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=2))
    (out / "table.md").write_text(table + "\n")
    plot(rows, out / "integrity.png")
    print(f"machine: {machine()}\nwrote {out}/table.md, results.json, integrity.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['page']}\n{op}" for r in rows for op in ("write", "read")]
    raw = [r[k] for r in rows for k in ("raw_write_gbs", "raw_read_gbs")]
    sealed = [r[k] for r in rows for k in ("sealed_write_gbs", "verified_read_gbs")]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], raw, width=0.4, label="file tier")
    ax.bar([i + 0.2 for i in x], sealed, width=0.4, label="file tier + integrity")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("GB/s")
    ax.set_title("Storage-tier throughput with and without page integrity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
