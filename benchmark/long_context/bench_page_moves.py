"""A hot-set step's page moves: one copy each way for the whole batch, and how fast.

The residency owner (``hot_set/residency.py``) makes a step's releases one device→host
copy and its promotions one host→device copy, whatever the batch, through the native
platforms' HiCache host pool (``platform/host_pool.TorchMHAHostPool``: per layer, a
gather of the pages' rows and one write into the other pool, K and V). This times that
copy, pages of the embedded model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim
64, float32, pages of 16 tokens) scattered over the pools as a running server leaves
them, against a plain torch copy of the same bytes (one contiguous ``copy_``), on this
machine; and it states what the same copy would move on a GPU for a Llama-3.1-8B shape
(arithmetic: bytes per page over PCIe at ~50 GB/s and over HBM at ~3 TB/s).

    python -m benchmark.long_context.bench_page_moves --out /tmp/page_moves
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sgl_importance.platform.host_pool import TorchMHAHostPool

LAYERS, HEADS, DIM, PAGE = 30, 3, 64, 16
# A Llama-3.1-8B shape: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes x 16 tokens.
LLAMA_PAGE_BYTES = 32 * 8 * 128 * 2 * 2 * 16
PCIE_GBPS, HBM_GBPS = 50.0, 3000.0


def host_pool(pages: int, device_pages: int) -> TorchMHAHostPool:
    """The platform's host pool (layer_first) over a device pool, as SGLang builds them, but
    only the attributes the copies read (its constructor needs SGLang's device pool)."""
    pool = object.__new__(TorchMHAHostPool)
    pool.layout, pool.page_size = "layer_first", PAGE
    pool.layer_num = pool.target_layer_num = LAYERS
    kv = torch.zeros(2, LAYERS, pages * PAGE, HEADS, DIM)
    pool.kv_buffer = kv
    pool.k_data_refs = [kv[0, layer] for layer in range(LAYERS)]
    pool.v_data_refs = [kv[1, layer] for layer in range(LAYERS)]
    pool.device_k_buffers = tuple(torch.randn(device_pages * PAGE, HEADS, DIM) for _ in range(LAYERS))
    pool.device_v_buffers = tuple(torch.randn(device_pages * PAGE, HEADS, DIM) for _ in range(LAYERS))
    return pool


def slots_of(pages: torch.Tensor) -> torch.Tensor:
    return (pages[:, None] * PAGE + torch.arange(PAGE)[None, :]).flatten()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(n: int, repeats: int) -> tuple:
    """(pages, bytes, release s, promotion s, plain copy s, Llama-8B bytes) of ``n`` pages."""
    pool = host_pool(4 * n, 4 * n)
    device = slots_of(torch.randperm(4 * n)[:n])  # scattered, as a running server leaves them
    host = slots_of(torch.randperm(4 * n)[:n])
    nbytes = 2 * LAYERS * n * PAGE * HEADS * DIM * 4

    def promote() -> None:
        for layer in range(LAYERS):
            pool.load_to_device_per_layer(None, host, device, layer, "direct")

    out = timed(lambda: pool.backup_from_device_all_layer(None, host, device, "direct"), repeats)
    back = timed(promote, repeats)
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    plain = timed(lambda: dst.copy_(src), repeats)
    return n, nbytes, out, back, plain, n * LLAMA_PAGE_BYTES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", default="8,64,256", help="pages moved in one step (the batch's releases)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="page_moves_")))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = [measure(int(n), a.repeats) for n in a.pages.split(",")]
    lines = [
        "| pages a step | bytes | release copy ms (GB/s) | promotion copy ms (GB/s) | plain copy ms (GB/s) "
        "| release / plain | Llama-3.1-8B: MiB, ms over PCIe, ms over HBM |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n, nbytes, out, back, plain, llama in rows:
        out_gb, back_gb, plain_gb = (nbytes / t / 1e9 for t in (out, back, plain))
        lines.append(
            f"| {n} | {nbytes / 2**20:.1f} MiB | {out * 1e3:.2f} ({out_gb:.1f}) | {back * 1e3:.2f} ({back_gb:.1f}) "
            f"| {plain * 1e3:.2f} ({plain_gb:.1f}) | {out / plain:.2f} "
            f"| {llama / 2**20:.0f}, {llama / PCIE_GBPS / 1e6:.2f}, {llama / HBM_GBPS / 1e6:.3f} |"
        )
    command = "python -m benchmark.long_context.bench_page_moves " + " ".join(sys.argv[1:])
    text = (
        "# A step's page moves: one copy each way (bench_page_moves.py)\n\n"
        f"```\n{command}\n```\n\nSmolLM2-135M pages (30 layers x 3 KV heads x 64, float32, 16 tokens: "
        f"{2 * LAYERS * PAGE * HEADS * DIM * 4 / 2**10:.0f} KiB a page), {torch.get_num_threads()} threads; "
        "median of the repeats.\n\n" + "\n".join(lines) + "\n"
    )
    (a.out / "RESULTS_page_moves.md").write_text(text)
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    pages = [r[0] for r in rows]
    for label, col in (("release", 2), ("promotion", 3), ("plain copy", 4)):
        ax.plot(pages, [r[1] / r[col] / 1e9 for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("pages moved in one step")
    ax.set_ylabel("GB/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out / "page_moves.png", dpi=120)


if __name__ == "__main__":
    main()
