"""``make serve``'s decode against transformers on the same model, measured in turns in one run.

The server is ``make serve``'s: no attention or page flag (torch_cpu's default backend,
SGLang's page of 1 token, no HiCache), only ``--dtype`` and what measuring needs (a pool
that holds the largest batch, the context, the per-step log: ``bench_speed``'s ``serve``
configuration). The peer is transformers' own model of the folder (SDPA attention, its
``DynamicCache``) in the same dtype, decoding greedily with forward + argmax per step:
``generate``'s loop without its logits processors, so a peer no slower than ``generate``.

For each dtype, length and batch both sides decode the same cached prompts (distinct
essay slices, prefilled once per side) in turns: transformers, the server, transformers,
the server... (``--rounds``), so a machine shared with other work slows both alike. Each
side's step is the median over its rounds (transformers' from its timed steps, the
server's from the requests' wall time over their tokens: no per-step log line, whose
writing the server would pay); the ratio is the median of the rounds' ratios
(tok/s of the server's turn over the transformers turn just before it), with their
range. Beside it, the same comparison in CPU seconds per step (the scheduler process's,
from /proc, against the transformers thread's): what each side's decode costs, which a
machine shared with other work leaves much as it is while it scatters the wall times.
Both stay loaded for the whole dtype; a batch whose transformers cache would not fit in
the memory left is skipped, and said so.

Writes RESULTS.md (table, command, machine), results.json and serve_speed.png into
``--out``, and prints the table.

    OMP_NUM_THREADS=1 python -m benchmark.serving.bench_serve_speed --out /tmp/bench_serve_speed
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmark.long_context import bench_speed as speed
from sgl_importance.client import generate, greedy
from sgl_importance.local_server import LocalServer, model_path

DTYPES = ("float32", "bfloat16")


def kv_bytes_per_token(shape: dict[str, int], dtype: str) -> int:
    """K and V bytes of one token in every layer."""
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * speed.DTYPE_BYTES[dtype]


def available_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo (0 where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def scheduler_pid(server: LocalServer) -> int:
    """The server's scheduler process (a child of the launcher named ``sglang::scheduler``)."""
    for child in Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split():
        if "scheduler" in Path(f"/proc/{child}/cmdline").read_text():
            return int(child)
    raise RuntimeError(f"no scheduler among the children of {server.proc.pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has run (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_step(server: LocalServer, ids: list[list[int]], new_tokens: int, pid: int) -> tuple[list[float], float]:
    """Seconds per token step of ``len(ids)`` cached prompts decoding at once, and the
    scheduler's CPU seconds per step: the requests' wall time and the scheduler's CPU time
    over ``new_tokens`` (the cached prompts' one-token prefill counted as a step, the HTTP
    round trip in the wall time). From the outside: a per-step log line would cost the
    server the time it takes to write it (5 % of a 64-token step at batch 8)."""
    cpu, start = cpu_seconds(pid), time.perf_counter()
    pool = ThreadPoolExecutor(len(ids))
    try:
        params = greedy(new_tokens, ignore_eos=True)
        list(pool.map(lambda p: generate(server.url, input_ids=p, sampling_params=params, timeout=3600), ids))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [(time.perf_counter() - start) / new_tokens], (cpu_seconds(pid) - cpu) / new_tokens


def transformers_step(model: Any, keys: list, values: list, firsts: list[int], batch: int, steps: int):
    """transformers' decode step times, and its CPU seconds per step (this thread's)."""
    cpu = time.thread_time()
    times = speed.transformers_decode(model, keys, values, firsts, batch, steps)
    return times, (time.thread_time() - cpu) / steps


def measure_dtype(dtype: str, model_dir: str, prompts: dict[int, list[list[int]]], a, shape: dict, logs: Path):
    """Both sides in one dtype: rows of every length and batch, and what was skipped."""
    longest = max(prompts)
    args = argparse.Namespace(dtype=dtype, server_args=a.server_args)
    max_tokens = max(a.batches) * (longest + a.new_tokens + speed.PAGE) + 64 * speed.PAGE
    server_args, env = speed.server_args(
        "serve", args, max_tokens, 0.0, speed.context_length(list(prompts), a.new_tokens)
    )
    at = server_args.index("--decode-log-interval")  # make serve's own logging: timed from outside
    del server_args[at : at + 2]
    server = LocalServer(model_dir, server_args, logs / f"server_{dtype}.log", env=env)
    print(f"{dtype}: {shlex.join(server.cmd)}", flush=True)
    rows, skipped = [], {}
    model = speed.load_transformers(model_dir, dtype)
    try:
        server.wait_ready(timeout=900)
        pid = scheduler_pid(server)
        for length, ids in prompts.items():
            steps = a.new_tokens if length <= 2048 else a.long_new_tokens
            # The transformers store and a batch's grown cache beside it, with 2 GiB to spare:
            # the largest batch that fits now is the last one measured.
            free = available_bytes()
            fits = [
                b for b in a.batches if 2 * b * (length + steps) * kv_bytes_per_token(shape, dtype) + (2 << 30) < free
            ]
            for batch in a.batches:
                if batch not in fits:
                    skipped[f"{dtype} {length} x{batch}"] = (
                        f"transformers' cache would not fit in {free / 2**30:.1f} GiB"
                    )
                    print(f"skipped {dtype} {length} x{batch}: {skipped[f'{dtype} {length} x{batch}']}", flush=True)
            if not fits:
                continue
            ids = ids[: max(fits)]
            started = time.time()
            list(ThreadPoolExecutor(len(ids)).map(lambda p: server_step(server, [p], 1, pid), ids))  # cached
            server_step(server, ids[:1], 4, pid)  # warm-up
            keys, values, firsts = speed.transformers_prefill(model, ids)
            print(f"{dtype} {length}: prefilled both sides in {time.time() - started:.0f} s", flush=True)
            for batch in fits:
                times: dict[str, list[float]] = {"transformers": [], "serve": []}
                cpu: dict[str, list[float]] = {"transformers": [], "serve": []}
                ratios, cpu_ratios = [], []
                for _ in range(a.rounds):
                    t, t_cpu = transformers_step(model, keys, values, firsts, batch, steps - 1)
                    s, s_cpu = server_step(server, ids[:batch], steps, pid)
                    times["transformers"] += t
                    times["serve"] += s
                    cpu["transformers"].append(t_cpu)
                    cpu["serve"].append(s_cpu)
                    cpu_ratios.append(t_cpu / s_cpu)
                    if s:
                        ratios.append(statistics.median(t) / statistics.median(s))
                for side, got in times.items():
                    if not got:
                        skipped[f"{dtype} {length} x{batch} {side}"] = "no step logged with the whole batch"
                        continue
                    rows.append(
                        {
                            "side": side,
                            "dtype": dtype,
                            "length": length,
                            "batch": batch,
                            "step_s": statistics.median(got),
                            "steps": len(got),
                            "tok_s": batch / statistics.median(got),
                            "round_ratios": ratios,
                            "cpu_step_s": statistics.median(cpu[side]),
                            "cpu_ratios": cpu_ratios,
                            "load": speed.load_average(),
                        }
                    )
                print(f"{dtype} {length} x{batch}: " + row_text(rows[-2:]), flush=True)
            del keys, values
            gc.collect()
    finally:
        server.stop()
        del model
        gc.collect()
    return rows, skipped


def row_text(pair: list[dict]) -> str:
    return ", ".join(f"{r['side']} {r['tok_s']:.1f} tok/s ({r['step_s'] * 1e3:.1f} ms)" for r in pair)


def paired(rows: list[dict]) -> list[dict]:
    """One entry per (dtype, length, batch): both sides and serve's tok/s over transformers'."""
    out = {}
    for r in rows:
        entry = out.setdefault((r["dtype"], r["length"], r["batch"]), {"dtype": r["dtype"], "length": r["length"]})
        entry["batch"] = r["batch"]
        entry[r["side"]] = r
    for e in out.values():
        rounds = e["serve"]["round_ratios"] if "serve" in e and "transformers" in e else []
        if rounds:
            # The median of the rounds' ratios: each round's two sides ran back to back,
            # under much the same load from the machine's other work.
            e["ratio"] = statistics.median(rounds)
            e["round_range"] = (min(rounds), max(rounds))
            e["cpu_ratio"] = statistics.median(e["serve"]["cpu_ratios"])
    return sorted(out.values(), key=lambda e: (DTYPES.index(e["dtype"]), e["length"], e["batch"]))


def table_lines(pairs: list[dict]) -> list[str]:
    lines = [
        "| dtype | prompt tokens | batch | make serve tok/s | transformers tok/s | make serve / transformers "
        "(median of rounds) | rounds' range | CPU s per step, make serve / transformers, inverted |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for e in pairs:
        serve, peer, rng = e.get("serve"), e.get("transformers"), e.get("round_range")
        cells = [
            e["dtype"],
            e["length"],
            e["batch"],
            f"{serve['tok_s']:.1f}" if serve else "-",
            f"{peer['tok_s']:.1f}" if peer else "-",
            f"**{e['ratio']:.2f}x**" if "ratio" in e else "-",
            f"{rng[0]:.2f}-{rng[1]:.2f}x" if rng else "-",
            f"{e['cpu_ratio']:.2f}x" if "cpu_ratio" in e else "-",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def plot(pairs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    done = [e for e in pairs if "ratio" in e]
    for dtype, marker in zip(DTYPES, "os"):
        mine = [e for e in done if e["dtype"] == dtype]
        cells = [f"{e['length']}x{e['batch']}" for e in mine]
        ax.plot(cells, [e["ratio"] for e in mine], marker, label=f"{dtype}, tok/s (median of rounds)", ms=7)
        ax.plot(cells, [e["cpu_ratio"] for e in mine], marker, mfc="none", label=f"{dtype}, CPU s per step (inverted)")
    ax.axhline(1.0, color="k", ls="--", lw=1, label="transformers")
    ax.set_xlabel("prompt tokens x batch")
    ax.set_ylabel("make serve / transformers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="64,1024,7600", help="prompt tokens")
    ap.add_argument("--batches", default="1,4,8", help="requests decoding at once")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per request up to 2,048 prompt tokens")
    ap.add_argument("--long-new-tokens", type=int, default=12, help="greedy tokens per request past 2,048")
    ap.add_argument("--rounds", type=int, default=4, help="turns of each side per cell")
    ap.add_argument("--server-args", default="", help="flags added to the server's (none: make serve's own)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench_serve_speed_")))
    a = ap.parse_args()
    a.batches = sorted({int(x) for x in a.batches.split(",")})
    lengths = [int(x) for x in a.lengths.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)
    started = time.time()
    model_dir = model_path()
    from transformers import AutoConfig, AutoTokenizer

    prompts = speed.make_prompts(AutoTokenizer.from_pretrained(model_dir), lengths, max(a.batches))
    shape = speed.model_shape(AutoConfig.from_pretrained(model_dir).to_dict())
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    for dtype in a.dtypes.split(","):
        got, missed = measure_dtype(dtype, model_dir, prompts, a, shape, logs)
        rows += got
        skipped.update(missed)
        (a.out / "rows-partial.json").write_text(json.dumps(rows))
    import platform

    import torch

    pairs = paired(rows)
    meta = {
        "command": "python -m benchmark.serving.bench_serve_speed " + shlex.join(sys.argv[1:]),
        "minutes": (time.time() - started) / 60,
        "machine": f"{platform.machine()}, {speed._cpu_name()}, {torch.get_num_threads()} torch threads",
        "skipped": skipped,
    }
    text = "\n".join(
        [
            "# make serve's decode against transformers (bench_serve_speed.py)",
            "",
            f"Command (took {meta['minutes']:.0f} min): `{meta['command']}`",
            "",
            f"Machine: {meta['machine']}. Rounds per cell: {a.rounds}; new tokens {a.new_tokens} "
            f"({a.long_new_tokens} past 2,048 prompt tokens).",
            "",
            *table_lines(pairs),
            "",
            *[f"Skipped: {k}: {v}" for k, v in skipped.items()],
        ]
    )
    (a.out / "RESULTS.md").write_text(text)
    (a.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if pairs:
        plot(pairs, a.out / "serve_speed.png")
    print(text)


if __name__ == "__main__":
    main()
