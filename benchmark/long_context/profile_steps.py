"""Where a served decode step's time goes: SGLang's profiler over a few steps, its trace
summed by kernel.

``bench_speed.py --profile-steps N`` calls :func:`profile_decode` after each row it measures:
the row's requests are sent again and, once the server logs their decode, ``/start_profile``
asks SGLang's scheduler for ``N`` forward steps of ``torch.profiler`` (it stops and writes a
chrome trace by itself). :func:`kernel_table` sums the trace's device kernels (and copies) by
name: total and per-step milliseconds, launches per step. Kernels replayed from a CUDA graph
are traced one by one, so a captured step's kernels show as an eager one's do. Where the trace
holds no device kernel (a CPU server) it sums the top-level CPU ops instead, each with
everything it called, so the table says what the host ran.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import requests

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
DECODE_LINE = "Decode batch"


def profile_decode(
    url: str,
    log: Callable[[], str],
    send: Callable[[], Any],
    out_dir: Path,
    steps: int,
    activities: Sequence[str],
    timeout: float = 600.0,
) -> Path:
    """Run ``send`` (the row's requests, decoding) and profile ``steps`` of its decode
    steps once the server's log shows them decoding; returns the trace written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.trace.json.gz"))
    mark = log().count(DECODE_LINE)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(send)
        deadline = time.time() + timeout
        while log().count(DECODE_LINE) <= mark + 1:  # past the first decode step (graphs warm)
            if sent.done() or time.time() > deadline:
                sent.result()  # a failure surfaces here
                raise RuntimeError("the requests finished before a decode step could be profiled")
            time.sleep(0.05)
        body = {"output_dir": str(out_dir), "num_steps": steps, "activities": list(activities)}
        requests.post(f"{url}/start_profile", json=body, timeout=timeout).raise_for_status()
        sent.result(timeout=timeout)
    while time.time() < deadline:  # the trace is written after the last profiled step
        written = sorted(set(out_dir.glob("*.trace.json.gz")) - before, key=lambda p: p.stat().st_mtime)
        if written and _complete(written[-1]):
            return written[-1]
        time.sleep(0.5)
    raise RuntimeError(f"no trace written to {out_dir} within {timeout:.0f} s")


def _complete(path: Path) -> bool:
    try:
        with gzip.open(path, "rt") as f:
            json.load(f)
        return True
    except (OSError, EOFError, ValueError):
        return False


def kernel_table(trace: Path, steps: int) -> dict:
    """The trace summed by name: ``{"source": "device" | "host", "rows": [...], "total_ms"}``,
    rows ``{"name", "calls_per_step", "ms_per_step", "share"}`` most time first."""
    with gzip.open(trace, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    source = "device" if device else "host"
    picked = device or _top_level([e for e in events if e.get("cat") == "cpu_op"])
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in picked:
        total[e["name"]] += float(e.get("dur", 0.0))
        calls[e["name"]] += 1
    whole = sum(total.values())
    rows = [
        {
            "name": name,
            "calls_per_step": calls[name] / steps,
            "ms_per_step": us / 1e3 / steps,
            "share": us / whole if whole else 0.0,
        }
        for name, us in sorted(total.items(), key=lambda kv: -kv[1])
    ]
    return {"source": source, "rows": rows, "total_ms_per_step": whole / 1e3 / steps}


def _top_level(ops: list[dict]) -> list[dict]:
    """The CPU ops no other op on the same thread encloses (their time holds their callees')."""
    out, end = [], {}
    for e in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        thread = (e.get("pid"), e.get("tid"))
        if e["ts"] >= end.get(thread, -1.0):
            out.append(e)
            end[thread] = e["ts"] + e.get("dur", 0.0)
    return out


def markdown(table: dict, title: str, top: int = 25) -> str:
    """The table's ``top`` rows as markdown, under ``title``."""
    what = "device kernels and copies" if table["source"] == "device" else "top-level CPU ops (callees included)"
    lines = [
        f"### {title}",
        "",
        f"{what}: {table['total_ms_per_step']:.2f} ms a step in all",
        "",
        "| name | calls / step | ms / step | share |",
        "|---|---:|---:|---:|",
    ]
    for row in table["rows"][:top]:
        name = row["name"] if len(row["name"]) <= 90 else row["name"][:87] + "..."
        lines.append(f"| `{name}` | {row['calls_per_step']:.1f} | {row['ms_per_step']:.3f} | {row['share']:.1%} |")
    rest = table["rows"][top:]
    if rest:
        ms = sum(r["ms_per_step"] for r in rest)
        lines.append(f"| ({len(rest)} more) | | {ms:.3f} | {sum(r['share'] for r in rest):.1%} |")
    return "\n".join(lines) + "\n"
