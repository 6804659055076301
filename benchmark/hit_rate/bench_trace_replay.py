"""Production traffic through the cache: the Mooncake traces replayed offline and live.

    # offline page model: every slice x pool x policy (seconds per point, no server)
    python -m benchmark.hit_rate.bench_trace_replay offline --out /tmp/trace_offline
    # live: one slice against fresh servers, one per arm and pool
    python -m benchmark.hit_rate.bench_trace_replay live --seed 1 --max-requests 340 \\
        --pools 16384 --arms lru,slru,importance,credit --out /tmp/trace_live
    # the same with HiCache (host pool 2x, the file tier)
    python -m benchmark.hit_rate.bench_trace_replay live ... --hicache

Slices (``production_trace.py``): whole conversations, 1 in ``--every``, by ``--seed``
(seed 0 of the conversation trace is kept for review: tune on 1-7), each 512-token
block scaled to 16 token ids; ``synthetic`` is the whole synthetic trace. Traces are
read from ``--trace`` (default: ``../shared/traces/`` beside the repository).

Offline rows: cached prompt tokens of the page model (``page_model.py``) for SGLang's
built-ins (``lru``, ``sglang_slru``, ``lfu``), the shipped priority under a config,
Belady, and the infinite-cache ideal; the share of Belady's gain over LRU a policy
takes. Live rows: what each server reported (device / host / storage tokens, TTFT)
beside the page model's figure for the same arm, slice and pool.

Writes ``results.json``, ``results.md`` and ``results.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from benchmark.hit_rate import page_model
from benchmark.hit_rate.live_replay import Arm, Loop, run_arm
from benchmark.hit_rate.production_trace import (
    CONVERSATION_TRACE,
    SYNTHETIC_TRACE,
    load_slice,
    read_trace,
    shared_trace,
    slice_label,
    turn_statistics,
)
from benchmark.hit_rate.trace_report import live_markdown, offline_markdown, plot, turns_markdown
from sgl_importance.sim.shipped import Shipped

POOLS = "8192,16384,32768"
BUILTINS = ("lru", "sglang_slru", "lfu")
# The importance policy's arms: SGLang's default config, and the credit form.
CREDIT = {"form": "credit", "reuse_credit": 1.0}
ARMS = {
    "lru": Arm("lru", "lru"),
    "slru": Arm("slru", "slru"),
    "lfu": Arm("lfu", "lfu"),
    "importance": Arm("importance", "importance"),
    "credit": Arm("credit", "importance", CREDIT),
}


def sim_policy(arm: Arm):
    """The page model's policy for a live arm (SGLang's slru is ``sglang_slru``)."""
    if arm.policy == "importance":
        return Shipped(config=arm.config or {})
    return {"slru": "sglang_slru"}.get(arm.policy, arm.policy)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def slices(spec: str, every: int, trace_dir: Optional[Path]) -> list[tuple[str, Path, int, int]]:
    """``conversation:1-7,synthetic`` -> (label, path, every, seed) per slice."""
    out = []
    for part in spec.split(","):
        name, _, seeds = part.strip().partition(":")
        file = {"conversation": CONVERSATION_TRACE, "synthetic": SYNTHETIC_TRACE}.get(name)
        path = (trace_dir / file if trace_dir else shared_trace(file)) if file else Path(name)
        lo, _, hi = seeds.partition("-")
        for seed in range(int(lo), int(hi or lo) + 1) if seeds else [0]:
            n = every if seeds else 1
            out.append((slice_label(path, n, seed, None), path, n, seed))
    return out


def offline(a: argparse.Namespace) -> list[dict]:
    rows = []
    policies = [p for p in a.policies.split(",") if p.strip()]
    for label, path, every, seed in slices(a.slices, a.every, a.trace_dir):
        t0 = time.perf_counter()
        model = page_model.build(load_slice(path, every, seed, a.max_requests), a.new_tokens)
        ideal = int(page_model.ideal(model).sum())
        for pool in _ints(a.pools):
            row = {"slice": label, "pool": pool, "requests": model.n_requests, "ideal": ideal}
            row["prompt_tokens"] = int(model.prompt_tokens.sum())
            for p in [*BUILTINS, *policies, "belady"]:
                row[p] = int(page_model.cached_tokens(model, p, pool).sum())
            rows.append(row)
        print(f"{label}: {model.n_requests} requests, {time.perf_counter() - t0:.0f}s", flush=True)
    return rows


def live(a: argparse.Namespace) -> list[dict]:
    path = a.trace or shared_trace(CONVERSATION_TRACE)
    slice_ = load_slice(path, a.every, a.seed, a.max_requests)
    label = slice_label(path, a.every, a.seed, a.max_requests)
    model = page_model.build(slice_, a.new_tokens)
    ideal = int(page_model.ideal(model).sum())
    loop = Loop(open=a.open_loop, time_scale=a.time_scale, concurrency=a.concurrency, new_tokens=a.new_tokens)
    arms = [ARMS[x] if x in ARMS else Arm.parse(x) for x in a.arms.split(",") if x.strip()]
    from sgl_importance.local_server import model_path

    model_dir = model_path()
    rows = []
    for pool in _ints(a.pools):
        offline_lru = int(page_model.cached_tokens(model, "lru", pool).sum())
        belady = int(page_model.cached_tokens(model, "belady", pool).sum())
        for arm in arms:
            print(f"[{arm.name} @ {pool}] {len(slice_)} requests of {label}", flush=True)
            run_dir = a.out / f"{arm.name}-{pool}"
            result = run_arm(model_dir, arm, pool, slice_, loop, run_dir, a.hicache, a.hicache_ratio)
            row = result.summary()
            row.update(slice=label, ideal=ideal, offline_lru=offline_lru, belady=belady)
            row["offline"] = int(page_model.cached_tokens(model, sim_policy(arm), pool).sum())
            rows.append(row)
            print(f"  cached {row['cached']} (offline {row['offline']}), {row['seconds']:.0f}s", flush=True)
            (a.out / "results.json").write_text(json.dumps(rows, indent=1))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("offline", "live"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, default=Path("benchmark/hit_rate/out") / f"trace_{name}")
        p.add_argument("--pools", default=POOLS)
        p.add_argument("--every", type=int, default=8, help="keep 1 conversation in EVERY")
        p.add_argument("--max-requests", type=int, default=None)
        p.add_argument("--new-tokens", type=int, default=4)
    o = sub.choices["offline"]
    o.add_argument("--slices", default="conversation:1-7,synthetic")
    o.add_argument("--trace-dir", type=Path, default=None)
    o.add_argument(
        "--policies",
        default="shipped,shipped:recency_horizon=512,shipped:reuse_weight=0.25,"
        "shipped:form=credit,shipped:form=credit:reuse_credit=2,reread_oracle",
    )
    v = sub.choices["live"]
    v.add_argument("--trace", type=Path, default=None)
    v.add_argument("--seed", type=int, default=1)
    v.add_argument("--arms", default="lru,slru,importance,credit")
    v.add_argument("--open-loop", action="store_true", help="send on the trace's clock x --time-scale")
    v.add_argument("--time-scale", type=float, default=0.05)
    v.add_argument("--concurrency", type=int, default=1, help="closed loop: requests in flight")
    v.add_argument("--hicache", action="store_true", help="host pool (--hicache-ratio) and the file tier")
    v.add_argument("--hicache-ratio", type=float, default=2.0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = offline(a) if a.cmd == "offline" else live(a)
    (a.out / "results.json").write_text(json.dumps(rows, indent=1))
    text = offline_markdown(rows) if a.cmd == "offline" else live_markdown(rows)
    if a.cmd == "offline":
        # What re-reads can predict: each trace's turns and whether another follows.
        for path in dict.fromkeys(s[1] for s in slices(a.slices, a.every, a.trace_dir)):
            turns = turn_statistics(read_trace(path)[0])
            text += f"\n{Path(path).name}, every conversation:\n\n" + turns_markdown(turns)
    (a.out / "results.md").write_text(text)
    plot(rows, a.out / "results.png", live=a.cmd == "live")
    print(text)
    print(f"wrote {a.out}/results.json, results.md, results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
