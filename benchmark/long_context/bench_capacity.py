"""Long requests served at once from a fixed device pool: dense vs the hot set.

Each configuration gets a fresh ``python -m sglang.launch_server`` on torch_cpu with
``importance_torch``, HiCache's host pool (``--enable-hierarchical-cache``) and
``--decode-log-interval 1``, so that every decode step logs its running requests.
**Equal memory**: every server gets the same ``--max-total-tokens`` (``--device-tokens``):
dense all of it for its KV pool, a hot-set server the same pool less the page importance
table (one page at these sizes), its key ranges and codes borrowed from that pool as its
requests need them: every device byte of its own inside it. ``--dtype`` is pinned (float32 by default, the runs on
record; a CPU with bfloat16 would pick that). All configurations see the same prompts, distinct essay slices
of ``--length`` tokens: one alone (batch 1), then, after ``/flush_cache`` (a concurrent
request matching a cached prompt would pin that prefix on the device), ``--requests``
more sent at once, ``--max-new`` greedy tokens each (``ignore_eos``). Short prompts
with thousands of new tokens are the long-generation (reasoning trace) case.

Per configuration (dense; the hot set with the default guard; with the guard off) it
reports the most requests decoding in one step (from the server log), the wall time
for all of them, decode tokens/s (the median of the per-step rates SGLang logs at
batch 1, one request sent alone first, and at the largest batch reached), how many
greedy outputs equal dense's and how many tokens they share with it before the first
difference, the pages released to the host, the KV pool's size and the most KV pages the
hot set borrowed for its rows in one step (``/metrics``), the peak resident memory of the server's
processes, and how admission went: requests admitted by footprint or charged their whole
length for want of host or key-range room (``--hot-set-admission``,
``scheduler/admission.py``) and requests SGLang retracted; and the guard under release: the
pages its selections wanted that were released (misses) against dense's page-reads, the
layer-steps it flagged, the hot sets it had grown that a decode step short of room put back
to their budget, and the promotions that found no device room. ``--stop-after-s`` aborts the
concurrent requests after that long (a long generation's admission is settled in its first
minutes; its outputs are then not compared). Writes RESULTS_capacity.md and capacity.png
into --out and prints the table.

    python -m benchmark.long_context.bench_capacity --out /tmp/bench_capacity
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import requests

from benchmark.long_context.bench_hot_set import PAGE, essay_text
from sgl_importance.client import flush_cache, generate, greedy, metrics_text
from sgl_importance.config import add_cli_args, from_namespace
from sgl_importance.hot_set.table_budget import KVShape, plan_table
from sgl_importance.local_server import LocalServer, metric, model_path
from sgl_importance.platform.torch_cpu import cpu_flags, default_dtype

DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+), .*gen throughput \(token/s\): ([\d.]+)")
TOKENS_LINE = re.compile(r"Decode batch, #running-req: \d+, #token: (\d+),")
SOLO_NEW = 128
RELEASED = "sgl_importance:hot_set_pages_released_total"
KV_LINE = re.compile(r"max_total_num_tokens=(\d+)")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
SGLANG_HICACHE_RATIO = 2.0  # SGLang's --hicache-ratio default
BORROWED = "sgl_importance:hot_set_borrowed_pages"


CONFIG_KEYS = ("dense", "guard", "guard-off", "guard-length", "guard-off-length", "guard-unstreamed")
ADMITTED = "sgl_importance:hot_set_admitted_by_footprint_total"
REFUSED = "sgl_importance:hot_set_footprint_refused_total"
RETRACTED = "sglang:num_retracted_requests_total"
# What the server counted over the whole run: admission, and the guard under release (its
# selections' misses against dense's page-reads, its flags, hot sets put back to budget).
SERIES = (("by_footprint", ADMITTED), ("footprint_refused", REFUSED), ("retracted", RETRACTED)) + tuple(
    (k, f"sgl_importance:hot_set_{k}_total")
    for k in ("pages_missed", "pages_dense", "guard_flagged", "guard_checks", "hot_sets_shrunk", "promotions_refused")
)


def configs(
    budget: float, keys: list[str], device_tokens: int, threshold: int = 512
) -> dict[str, tuple[int, list[str]]]:
    """name -> (``--max-total-tokens``, the other flags): dense (always, the baseline),
    then of ``keys``: the hot set with the server's default guard (``guard``), and with
    the guard off (``guard-off``: reads only the hot set, what the page saving is worth
    in decode speed), each at dense's ``--max-total-tokens`` (its rows borrowed from it);
    ``guard-length`` / ``guard-off-length``: the same, admitted as SGLang charges any request
    (``--hot-set-admission length``: prompt + max_new_tokens) instead of by footprint;
    ``guard-unstreamed``: ``guard`` with its prompts prefilled dense (``--hot-set-prefill dense``)."""
    hot = ["--hot-set-policy", "importance", "--hot-set-budget", str(budget), "--hot-set-threshold", str(threshold)]
    hot += ["--radix-eviction-policy", "importance"]  # the README's line (a grown prompt held on the host)
    tokens = device_tokens
    every = {
        "dense": ("dense", (device_tokens, [])),
        "guard": (f"hot set {budget:.0%}", (tokens, hot)),
        "guard-off": (f"hot set {budget:.0%} guard off", (tokens, hot + ["--hot-set-guard-threshold", "1"])),
    }
    by_length = ["--hot-set-admission", "length"]
    every["guard-length"] = (f"{every['guard'][0]}, admitted by length", (tokens, hot + by_length))
    off = every["guard-off"]
    every["guard-off-length"] = (f"{off[0]}, admitted by length", (tokens, off[1][1] + by_length))
    every["guard-unstreamed"] = (f"{every['guard'][0]}, dense prefill", (tokens, hot + ["--hot-set-prefill", "dense"]))
    return dict(every[k] for k in ["dense"] + [k for k in keys if k != "dense"])


def model_shape(config: dict, dtype: str) -> KVShape:
    """The KV pool's shape of a Hugging Face ``config.json`` at KV dtype ``dtype``."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return KVShape(config["num_hidden_layers"], kv_heads, head_dim, head_dim, DTYPE_BYTES[dtype], PAGE)


def server_dtype(config: dict, dtype: str) -> str:
    """The KV dtype a torch_cpu server started with ``--dtype dtype`` gets: ``auto`` is what
    the platform makes of it on this CPU (float32 without native bfloat16), then the
    checkpoint's. The hot-set arm's KV pool, and so its host pool's ratio, depend on it."""
    if dtype == "auto":
        dtype = default_dtype(cpu_flags())
    return config.get("torch_dtype", "bfloat16") if dtype == "auto" else dtype


def server_kv_tokens(max_total_tokens: int, shape: KVShape, flags: list[str]) -> int:
    """The KV pool a server started with ``--max-total-tokens max_total_tokens`` and the
    plugin ``flags`` makes: a hot-set server's page importance table comes out of it
    (``plan_table``, where the flags as the server parses them keep rows). Equal host memory
    needs it: SGLang sizes the host pool as a ratio of the KV pool."""
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = from_namespace(parser.parse_known_args(flags)[0])
    if config.hot_set_policy in ("off", "dense"):
        return max_total_tokens
    return plan_table(max_total_tokens, shape).kv_tokens


def host_ratio(max_total_tokens: int, shape: KVShape, flags: list[str], host_tokens: float) -> list[str]:
    """``--hicache-ratio`` giving a server with these flags a host pool of ``host_tokens``."""
    return ["--hicache-ratio", f"{host_tokens / server_kv_tokens(max_total_tokens, shape, flags):.4f}"]


def run_config(name: str, tokens: int, extra: list[str], prompts: list[list[int]], a, out: Path) -> dict:
    args = [
        "--page-size", str(PAGE), "--attention-backend", "importance_torch", "--enable-hierarchical-cache",
        "--max-total-tokens", str(tokens), "--decode-log-interval", "1", "--enable-metrics", "--dtype", a.dtype,
        *extra,
    ]  # fmt: skip
    # Every server the same host pool (equal memory): SGLang sizes it as a ratio of the KV
    # pool, which beside a hot set's page importance table is a page smaller.
    args += host_ratio(tokens, a.kv_shape, extra, (a.hicache_ratio or SGLANG_HICACHE_RATIO) * a.device_tokens)
    if a.chunk:
        args += ["--chunked-prefill-size", str(a.chunk)]
    log = out / f"server_{name.replace(' ', '_').replace('%', '')}.log"
    server = LocalServer(model_path(), args, log)
    try:
        server.wait_ready()

        def decode(ids: list[int], new: int = a.max_new, **rid: str) -> dict:
            sampling = greedy(new, ignore_eos=True)
            return generate(server.url, input_ids=ids, sampling_params=sampling, timeout=7200, **rid)

        solo_prompt, prompts = prompts[0], prompts[1:]
        decode(solo_prompt[: a.length // 2], 8)  # warm-up, not measured
        mark = len(server.log())
        # Batch 1, a prompt the concurrent requests do not share (at most SOLO_NEW tokens:
        # a long generation alone would take as long as the rest).
        decode(solo_prompt, min(a.max_new, SOLO_NEW))
        solo = decode_steps(server.log()[mark:])
        # Empty the tree: a concurrent request matching a cached prompt would keep
        # that prefix on the device (shared pages are never released).
        flush_cache(server.url).raise_for_status()
        mark = len(server.log())
        released = metric(metrics_text(server.url), RELEASED)
        start = time.time()
        stopper = None
        if a.stop_after_s:
            # Admission is settled within minutes; the rest of a long generation only
            # decodes. Abort everything then (SGLang's /abort_request, abort_all).
            stopper = threading.Timer(a.stop_after_s, abort_all, (server.url,))
            stopper.start()
        # Fixed rids: the guard's page sample is seeded by the rid (hot_set/plan/sample.py), so
        # runs and configs compare on the same samples.
        rids = [f"capacity-{i}" for i in range(len(prompts))]
        watch = BorrowedWatch(server.url)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda ids, rid: decode_or_stopped(decode, ids, stopper, rid), prompts, rids))
        borrowed = watch.stop()
        if stopper is not None:
            stopper.cancel()
        wall = time.time() - start
        scrape = metrics_text(server.url)
        released = metric(scrape, RELEASED) - released
        admission = {k: metric(scrape, name) for k, name in SERIES}
        lines = decode_steps(server.log()[mark:])
        peak_mb = _peak_rss_mb(server.proc.pid)
        log_text = server.log()
    finally:
        server.stop()
    kv = KV_LINE.search(log_text)
    peak = max((n for n, _ in lines), default=0)
    held = [int(m.group(1)) for m in TOKENS_LINE.finditer(log_text[mark:])]
    at_peak = [rate for n, rate in lines if n == peak]
    return {
        "config": name,
        "peak": peak,
        "wall_s": wall,
        "tokens": sum(len(r["output_ids"]) for r in results),
        "tps_bs1": statistics.median([rate for n, rate in solo if n == 1] or [0.0]),
        "tps_peak": statistics.median(at_peak or [0.0]),
        "outputs": [r["output_ids"] for r in results],
        "peak_rss_mb": peak_mb,
        "pages_released": released,
        **admission,
        "device_tokens_peak": max(held, default=0),
        "kv_tokens": int(kv.group(1)) if kv else 0,
        "borrowed_pages": borrowed,
    }


class BorrowedWatch:
    """The most KV pages the hot set held borrowed for its rows (``/metrics``, every 2 s) while
    the concurrent requests run; ``stop`` returns it."""

    def __init__(self, url: str) -> None:
        self.url, self.most, self._done = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(2.0):
            try:
                self.most = max(self.most, metric(metrics_text(self.url), BORROWED))
            except (requests.RequestException, ValueError):
                pass

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.most


def abort_all(url: str) -> None:
    requests.post(url + "/abort_request", json={"abort_all": True}, timeout=60).raise_for_status()


def decode_or_stopped(decode, ids: list[int], stopper: Optional[threading.Timer], rid: str) -> dict:
    """``decode(ids)`` as request ``rid``; once ``stopper`` fired, an aborted request's answer,
    whatever SGLang returned for it (its tokens, if any, are not compared)."""
    try:
        result = decode(ids, rid=rid)
    except requests.HTTPError:
        if stopper is None or not stopper.finished.is_set():
            raise
        return {"output_ids": [], "stopped": True}
    if stopper is not None and stopper.finished.is_set():
        result = {**result, "stopped": True}
    return result


def _peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) summed over the server's session: launcher,
    scheduler, detokenizer. Linux only; 0 where /proc cannot tell."""
    total_kb = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
            if int(Path(status.parent, "stat").read_text().split()[5]) != pid:  # session id
                continue
        except (OSError, ValueError, IndexError):
            continue
        match = re.search(r"VmHWM:\s+(\d+) kB", text)
        total_kb += int(match.group(1)) if match else 0
    return total_kb / 1024


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "–"


def _first_differences(outputs: list[list[int]], dense: list[list[int]]) -> str:
    """Tokens each greedy output shares with dense's before they first differ: min / median."""
    firsts = sorted(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    for a, b in zip(outputs, dense))  # fmt: skip
    return f"{firsts[0]} / {firsts[len(firsts) // 2]}" if firsts else "–"


def decode_steps(log: str) -> list[tuple[int, float]]:
    """(running requests, gen tokens/s) of every "Decode batch" line."""
    return [(int(m.group(1)), float(m.group(2))) for m in DECODE_LINE.finditer(log)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device-tokens", type=int, default=4096, help="--max-total-tokens of every server")
    p.add_argument("--length", type=int, default=1500, help="prompt tokens")
    p.add_argument("--requests", type=int, default=12, help="sent at once")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument(
        "--stop-after-s",
        type=float,
        default=0,
        help="abort the concurrent requests after this many seconds (0: let them finish); for long "
        "generations, whose admission is settled early: outputs are then not compared",
    )
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--threshold", type=int, default=512, help="the hot-set servers' --hot-set-threshold")
    p.add_argument(
        "--hicache-ratio",
        type=float,
        default=0.0,
        help="every server's host pool over dense's device pool (0: SGLang's 2)",
    )
    p.add_argument(
        "--chunk", type=int, default=0, help="every server's --chunked-prefill-size (0: SGLang's, 2048 here)"
    )
    p.add_argument("--dtype", default="float32", help="every server's --dtype (the runs on record: float32)")
    p.add_argument("--configs", default="guard,guard-off", help=f"beside dense, from {', '.join(CONFIG_KEYS[1:])}")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench_capacity_")))
    a = p.parse_args()
    keys = [k for k in a.configs.split(",") if k]
    if unknown := [k for k in keys if k not in CONFIG_KEYS]:
        p.error(f"unknown configurations {unknown}; known: {', '.join(CONFIG_KEYS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    config = json.loads((Path(model_path()) / "config.json").read_text())
    a.kv_shape = model_shape(config, server_dtype(config, a.dtype))
    filler = tokenizer(essay_text(), add_special_tokens=False)["input_ids"]
    # One prompt for the batch-1 measurement, then the concurrent ones; all distinct.
    stride = (len(filler) - a.length) // (a.requests + 1)
    prompts = [filler[i * stride : i * stride + a.length] for i in range(a.requests + 1)]
    started = time.time()
    rows = [
        run_config(name, tokens, extra, prompts, a, a.out)
        for name, (tokens, extra) in configs(a.budget, keys, a.device_tokens, a.threshold).items()
    ]
    write_results(rows, a, (time.time() - started) / 60, a.out)


def write_results(rows: list[dict], a, minutes: float, out: Path) -> None:
    base = rows[0]
    lines = [
        "| config | most requests decoding at once | vs dense | wall s (all) "
        "| decode tok/s, bs 1 | decode tok/s at that batch | greedy outputs = dense | peak RSS, MB "
        "| tokens before the first difference from dense: min / median | pages released "
        "| device KV tokens in use, most in one step "
        "| KV pool tokens | KV pages borrowed for rows, most | admitted by footprint / refused | retracted "
        "| guard: pages missed / dense's page-reads | layer-steps flagged | hot sets put back to budget "
        "| promotions refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["peak"] / base["peak"] if base["peak"] else float("nan")
        cells = (
            r["config"],
            r["peak"],
            f"{ratio:.2f}x",
            f"{r['wall_s']:.0f}",
            f"{r['tps_bs1']:.1f}",
            f"{r['tps_peak']:.1f}",
            "–" if a.stop_after_s else f"{sum(x == y for x, y in zip(r['outputs'], base['outputs']))}/{a.requests}",
            f"{r.get('peak_rss_mb', 0):.0f}",
            "–" if a.stop_after_s else _first_differences(r["outputs"], base["outputs"]),
            f"{r.get('pages_released', 0):.0f}",
            r.get("device_tokens_peak", 0),
            r.get("kv_tokens", 0),
            f"{r.get('borrowed_pages', 0):.0f}",
            f"{r.get('by_footprint', 0):.0f} / {r.get('footprint_refused', 0):.0f}",
            f"{r.get('retracted', 0):.0f}",
            _share(r.get("pages_missed", 0), r.get("pages_dense", 0)),
            _share(r.get("guard_flagged", 0), r.get("guard_checks", 0)),
            f"{r.get('hot_sets_shrunk', 0):.0f}",
            f"{r.get('promotions_refused', 0):.0f}",
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    table = "\n".join(lines)
    command = "python -m benchmark.long_context.bench_capacity " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    text = (
        "# Capacity: long requests from a fixed device pool (bench_capacity.py)\n\n"
        f"Command (took {minutes:.0f} min):\n\n"
        f"```\n{command}\n```\n\n{a.requests} requests of {a.length} tokens at once, {a.max_new} new tokens each, "
        f"--max-total-tokens {a.device_tokens} for every server ({a.device_tokens // PAGE} pages of {PAGE}): "
        "dense's KV pool; a hot-set server's KV pool less its page importance table, its key ranges and codes "
        f"borrowed from it as used; --dtype {a.dtype}; HiCache host pool on; "
        f"--chunked-prefill-size {a.chunk or 'SGLang default'}.\n\n"
        f"{table}\n"
    )
    (out / "RESULTS_capacity.md").write_text(text)
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    names = [r["config"] for r in rows]
    axes[0].bar(names, [r["peak"] for r in rows])
    axes[0].set_ylabel("requests decoding at once")
    axes[1].bar(names, [r["wall_s"] for r in rows])
    axes[1].set_ylabel(f"wall s, {a.requests} requests")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"device pool {a.device_tokens} tokens, prompts of {a.length}")
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=120)


if __name__ == "__main__":
    main()
