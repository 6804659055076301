"""The hot-set decode step as a CUDA graph would run it: launches counted on a CPU, bytes by arithmetic.

Issue 47: an eager hot-set step is launch-bound on a GPU (0.12-0.13x dense with graphs on an
H200, ``benchmark/gpu/RESULTS.md``). This reports, with nothing run on a GPU:

1. **Launches**, counted by ``HostSyncCounter`` (``test/support/host_syncs.py``: torch calls
   that compute into a device tensor, and each Triton kernel, under the interpreter) over the
   plugin's ``importance_triton`` backend on a hot-set world (``test/support/hot_set_world.py``:
   a short request beside long ones, the guard off), for the same batches run two ways: the
   eager step (``init_forward_metadata``, every layer, the step's end in the last) and the
   captured step (``test/support/graph_runner.py``: the plugin's hook around ``can_run_graph``
   plans it; the out-of-graph prep, the in-graph prologue, the layers, the fold after
   ``execute``). A graph replays its launches without the host issuing them; what the host
   still issues per step is the prep and the fold (between steps).
2. **Buffers and bytes** for a Llama-3.1-8B shape (32 layers, 8 KV heads, D 128, page 16,
   bf16): the captured step's buffers as ``GraphStep`` allocates them (built on the ``meta``
   device: the shipped code's shapes, no memory), for ``--rows`` rows at 32K and 128K of
   context; and the bytes one captured layer-step reads per request at the hot set's 20 %:
   the listed pages' KV, the page tally's reads (the per-KV-head masses of every column and
   the key ranges of every full page), against dense's KV.

    python -m benchmark.long_context.bench_graph_step --out /tmp/graph_step

(~2 min on 2 CPU cores, most of it the Triton interpreter.)
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is imported

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))  # the test worlds, importable as ``support``

from sgl_importance.hot_set import HotSetParams, KeyRanges  # noqa: E402
from sgl_importance.hot_set.graph.step import GraphCapacity, GraphStep  # noqa: E402
from support.counted_world import triton_launches_counted  # noqa: E402
from support.graph_runner import GraphRunner  # noqa: E402
from support.host_syncs import LAUNCH, SYNC_KINDS, HostSyncCounter  # noqa: E402
from support.hot_set_world import DIM, KV_HEADS, LAYERS, Q_HEADS, World, parents_metadata  # noqa: E402

torch.set_grad_enabled(False)

WARMUP = 2
KV_WRITE = "sgl_importance/attention/triton_backend.py"  # the backend's _store_kv: SGLang's KV write
READ_BACK = ("sgl_importance/hot_set/graph/step.py", "sgl_importance/hot_set/graph/guard.py")  # the tallies' copies
LLAMA = dict(layers=32, kv_heads=8, q_heads=32, dim=128, page=16, kv_bytes=2)


def count_launches(lengths: list[int], steps: int, guard: float = 1.0) -> dict:
    """Launches per step where the host issues them, eager and captured, for one batch."""
    # The CI launch test's world (test_hot_set_host_syncs.py): the hot set at 20 %, the guard off
    # (``guard`` 1) or on.
    params = HotSetParams(policy="importance", budget=0.2, window=1, sinks=1, guard_threshold=guard)
    pools = dict(device_pages=160, host_pages=0, release=False)
    counters = {"eager": HostSyncCounter(), "graph": HostSyncCounter()}
    # Built with each counter on (paused), so that it sees which tensors the device holds.
    with counters["eager"], counters["eager"].paused():
        eager = World("triton", params, **pools)
    with counters["graph"], counters["graph"].paused():
        graphed = World("triton", params, **pools)
        runner = GraphRunner(graphed, params, rows=len(lengths))  # captured up to support.graph_runner.MAX_BS
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(lengths):
        k, v = (torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) for _ in range(2))
        for w in (eager, graphed):
            w.place(f"r{i}", k, v)
    bs = len(lengths)
    for step in range(WARMUP + steps):  # warm-up: a request's first step is dense; workspaces grow once
        kv = [torch.randn(LAYERS, bs, KV_HEADS, DIM, generator=g) for _ in range(2)]
        q = torch.randn(LAYERS, bs, Q_HEADS, DIM, generator=g)
        for name, counter in counters.items():
            if step >= WARMUP:
                counter.begin_step()
            with triton_launches_counted(counter), counter.paused() if step < WARMUP else nullcontext():
                if name == "eager":
                    eager.step(*kv, q, counter=counter)  # it enters the counter itself
                else:
                    with counter:
                        runner.step(*kv, q, counter=counter)

    replayed = [i for i, variant in enumerate(runner.variants_run[WARMUP:]) if variant is not None]

    def per(c: HostSyncCounter, over: Optional[list[int]] = None, **m) -> float:
        """Launches a step (of the steps ``over``: the captured columns count replayed steps
        only), SGLang's KV write (the backend's _store_kv) aside: it is the same both ways."""
        over = list(range(steps)) if over is None else over
        total = 0
        for step in over:
            sites = c.by("site", kinds=[LAUNCH], device_only=True, step=step, **m)
            total += sum(n for site, n in sites.items() if not site.startswith(KV_WRITE))
        return total / max(len(over), 1)

    e, gr = counters["eager"], counters["graph"]
    layer_e = [per(e, where=i) for i in range(LAYERS)]
    layer_g = [per(gr, replayed, where=i) for i in range(LAYERS)]
    return {
        "guard": guard < 1.0,
        "batch": bs,
        "lengths": lengths,
        "eager_step_start": per(e, where="host"),
        "eager_layer": layer_e[0],
        "eager_last_layer": layer_e[-1],
        "graph_prep": per(gr, replayed, where="prep"),
        "graph_prologue": per(gr, replayed, where="prologue"),
        "graph_layer": layer_g[0],
        "graph_last_layer": layer_g[-1],
        "graph_fold_and_end": per(gr, replayed, where="step"),
        # Host reads inside the graph (none: the tallies are read back after the replay).
        "graph_syncs_inside": sum(
            gr.total(kinds=SYNC_KINDS, device_only=True, where=w) for w in ("prologue", *range(LAYERS))
        ),
        "graph_tally_copies": sum(
            n
            for site, n in gr.by("site", kinds=SYNC_KINDS, device_only=True, where="step").items()
            if site.startswith(READ_BACK)
        )
        / steps,
        "replayed": runner.replayed,
        "variants": runner.variants_run[WARMUP:],
    }


def host_time(bs: int, context: int, steps: int, layers: int = 32, page: int = 16) -> dict:
    """Host milliseconds a step costs around its layers, eager against captured, at ``bs`` x
    ``context`` tokens (``layers`` layers, the hot set at 20 %, the guard off; one KV head of 8
    channels: the host's work is sized by pages, requests and layers, not by the heads). Eager:
    ``begin_step`` (plan, lists, tally) and ``end_step`` (fold, summaries, next plan). Captured:
    ``plan_step`` and ``GraphStep.prepare`` before the replay, ``fold`` and ``end_step`` after.
    The layers run in between, untimed (on a GPU they are the device's work)."""
    import time

    from sgl_importance.hot_set import HotSetDecoder

    g = torch.Generator().manual_seed(1)
    pages = context // page + 2
    pool = bs * pages + 1
    k = [torch.randn(pool * page, 1, 8, generator=g) for _ in range(layers)]
    v = [torch.randn(pool * page, 1, 8, generator=g) for _ in range(layers)]
    req_to_token = torch.zeros(bs + 1, pages * page, dtype=torch.int32)
    for r in range(bs):
        req_to_token[r + 1] = torch.arange(pages * page, dtype=torch.int32) + (1 + r * pages) * page
    params = HotSetParams(policy="importance", budget=0.2, window=4, sinks=1, guard_threshold=1.0)

    def decoder() -> HotSetDecoder:
        ranges = KeyRanges(layers, 1, 8, capacity_pages=pool, dtype=torch.float32)
        return HotSetDecoder(params, ranges, pool_pages=pool, page_size=page, threshold=1024)

    eager, graphed = decoder(), decoder()
    step = GraphStep(GraphCapacity(bs, pages), num_layers=layers, page_size=page, ranges=graphed.ranges, device="cpu")
    rids = [f"r{r}" for r in range(bs)]
    times = {"eager": [], "graph": []}
    out = torch.zeros(bs, 2, 8)
    for i in range(2 + steps):  # two warm-up steps (the first is the dense warm-up)
        length = context + i
        slots = [req_to_token[r + 1, :length] for r in range(bs)]
        q = torch.randn(layers, bs, 2, 8, generator=g)
        t0 = time.perf_counter()
        eager.begin_step(rids, slots)
        t1 = time.perf_counter()
        for layer in range(layers):
            eager.attend(layer, q[layer], k[layer], v[layer], sm_scale=0.35)
        t2 = time.perf_counter()
        eager.end_step()
        t3 = time.perf_counter()
        live = graphed.plan_step(rids, slots)
        assert step.prepare(live, list(range(1, bs + 1))) is None
        t4 = time.perf_counter()
        step.prologue(bs, req_to_token, pool)
        for layer in range(layers):
            kp, vp = graphed.pool_as_pages(layer, k[layer], v[layer])
            step.attend(layer, q[layer], kp, vp, out, sm_scale=0.35)
        t5 = time.perf_counter()
        step.fold(step.read_back())
        graphed.end_step()
        t6 = time.perf_counter()
        if i >= 2:
            times["eager"].append((t1 - t0 + t3 - t2) * 1e3)
            times["graph"].append((t4 - t3 + t6 - t5) * 1e3)
    return {"batch": bs, "context": context, "layers": layers,
            **{f"{k}_host_ms": sorted(v)[len(v) // 2] for k, v in times.items()}}  # fmt: skip


def llama_bytes(rows: int, context: int, hot: float) -> dict:
    """The captured step's buffers (``GraphStep`` on the meta device) and one layer-step's reads."""
    m = LLAMA
    pages = context // m["page"]
    ranges = KeyRanges(m["layers"], m["kv_heads"], m["dim"], capacity_pages=1, dtype=torch.bfloat16, device="meta")
    step = GraphStep(GraphCapacity(rows, pages), num_layers=m["layers"], page_size=m["page"], ranges=ranges,
                     device="meta")  # fmt: skip
    host = sum(t.numel() * t.element_size() for t in (*step._stages, *step._tally_hosts))
    kv_page = 2 * m["page"] * m["kv_heads"] * m["dim"] * m["kv_bytes"]  # one layer's K and V of a page
    dense = pages * kv_page
    listed = int(hot * pages + 0.999)
    masses = pages * m["kv_heads"] * 4  # the tally reads every column's per-KV-head mass (float32)
    ranges_read = pages * 2 * m["kv_heads"] * m["dim"] * 2  # key min/max of every full page (16-bit)
    return {
        "rows": rows,
        "context": context,
        "device_buffers_mib": step.nbytes / 2**20,
        "host_pinned_mib": host / 2**20,
        "dense_layer_mib": dense / 2**20,
        "hot_layer_mib": (listed * kv_page + masses + ranges_read) / 2**20,
        "hot_over_dense": (listed * kv_page + masses + ranges_read) / dense,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/graph_step"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8, help="--hot-set-graph-rows for the byte arithmetic")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    with parents_metadata():
        launches = [count_launches(lengths, a.steps) for lengths in ([5, 120, 180], [5, 120, 130, 150])]
        launches.append(count_launches([5, 120, 180], a.steps, guard=0.1))
    sizes = [llama_bytes(a.rows, context, 0.2) for context in (32768, 131072)]
    hosts = [host_time(bs, 32768, a.steps) for bs in (1, 8)]
    (a.out / "results.json").write_text(json.dumps({"launches": launches, "llama_8b": sizes, "host": hosts}, indent=1))
    lines = ["| guard | batch | eager: step start | eager: layer | eager: last layer | graph: prep | graph: prologue "
             "| graph: layer | graph: last layer | graph: fold + end | host reads in graph | tally copies |",
             "|" + "---|" * 12]  # fmt: skip
    for r in launches:
        lines.append(
            f"| {'on' if r['guard'] else 'off'} | {r['batch']} | {r['eager_step_start']:.0f} | "
            f"{r['eager_layer']:.0f} | {r['eager_last_layer']:.0f} | {r['graph_prep']:.0f} | "
            f"{r['graph_prologue']:.0f} | {r['graph_layer']:.0f} | {r['graph_last_layer']:.0f} | "
            f"{r['graph_fold_and_end']:.0f} | {r['graph_syncs_inside']} | {r['graph_tally_copies']:.0f} |"
        )
    lines += ["", "| Llama-3.1-8B, rows | context | device buffers (MiB) | pinned host (MiB) | dense layer-step "
              "(MiB/request) | captured hot 20 % (MiB/request) | ratio |", "|" + "---|" * 7]  # fmt: skip
    for s in sizes:
        lines.append(
            f"| {s['rows']} | {s['context'] // 1024}K | {s['device_buffers_mib']:.1f} | {s['host_pinned_mib']:.1f} | "
            f"{s['dense_layer_mib']:.1f} | {s['hot_layer_mib']:.1f} | {s['hot_over_dense']:.3f} |"
        )
    lines += ["", "| batch | context | layers | eager: host ms a step (begin + end) | captured: host ms a step "
              "(plan + prepare, fold + end) |", "|---|---|---|---|---|"]  # fmt: skip
    for h in hosts:
        lines.append(
            f"| {h['batch']} | {h['context'] // 1024}K | {h['layers']} | {h['eager_host_ms']:.1f} | "
            f"{h['graph_host_ms']:.1f} |"
        )
    table = "\n".join(lines)
    (a.out / "RESULTS.md").write_text(table + "\n")
    print(table)
    _plot(launches, a.out / "launches.png")


def _plot(launches: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    keys = [("eager_layer", "eager: a layer"), ("graph_layer", "captured: a layer (replayed)"),
            ("eager_step_start", "eager: step start"), ("graph_prep", "captured: prep (host)")]  # fmt: skip
    width = 0.8 / len(launches)
    for i, r in enumerate(launches):
        ax.bar([k + i * width for k in range(len(keys))], [r[k] for k, _ in keys], width, label=f"batch {r['batch']}")
    ax.set_xticks([k + width * (len(launches) - 1) / 2 for k in range(len(keys))], [n for _, n in keys], fontsize=8)
    ax.set_ylabel("launches (counted on the CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
