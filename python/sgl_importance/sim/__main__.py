"""Command line of the simulator.

python -m sgl_importance.sim replay  --trace DIR --policies lru,shipped,decayed_mass,belady --budgets 0.05,0.1 --out DIR
                                     [--policy-config '{"decay": 0.95}']
python -m sgl_importance.sim analyze --trace DIR --out DIR
python -m sgl_importance.sim synth   --kind multi_turn|rag|agent|cot|loop --out DIR
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from sgl_importance.sim.policies import POLICIES, make_policy
from sgl_importance.sim.shipped import Shipped

DEFAULT_POLICIES = "lru,lru_mass,lfu,slru,tlru,h2o,shipped,decayed_mass,blend,prefetch,belady"
DEFAULT_BUDGETS = "0.05,0.1,0.2,0.3,0.5"


def _floats(text: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    for v in vals:
        if not 0.0 < v <= 1.0:
            raise SystemExit(f"{flag}: {v} out of range (0, 1]")
    return vals


def _cmd_synth(a: argparse.Namespace) -> int:
    from sgl_importance.sim.synthetic import synthesize
    from sgl_importance.trace.table_io import write_accesses, write_requests

    t0 = time.perf_counter()
    ts = synthesize(a.kind, seed=a.seed, scale=a.scale, page_size=a.page_size, layers=a.layers, kv_heads=a.kv_heads)
    write_accesses(a.out, ts.accesses, ts.meta)
    write_requests(a.out, ts.requests)
    print(
        f"wrote {a.out}: {len(ts.accesses):,} access rows, {len(ts.requests)} requests "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    return 0


def _cmd_replay(a: argparse.Namespace) -> int:
    from sgl_importance.sim.prefix import prepare_prefix, replay_prefix_all
    from sgl_importance.sim.replay import prepare_hot, replay_hot
    from sgl_importance.sim.report import results_table, write_replay_report
    from sgl_importance.trace.table_io import read_all

    specs = [s for s in a.policies.split(",") if s.strip()]
    try:
        pols = [make_policy(s) for s in specs]
    except ValueError as e:
        raise SystemExit(f"--policies: {e}") from None
    if a.policy_config is not None:
        try:
            # The server's flag, parsed by the server's code (importance/priority.py).
            pols = [Shipped(config=a.policy_config) if p.name == "shipped" else p for p in pols]
        except ValueError as e:
            raise SystemExit(f"--policy-config: {e}") from None
    budgets = _floats(a.budgets, "--budgets")
    ts = read_all(a.trace)
    regimes = {"auto": ("hot", "prefix"), "both": ("hot", "prefix"), "hot": ("hot",), "prefix": ("prefix",)}[a.regime]
    results, notes = [], []
    workload = ts.meta.workload or Path(a.trace).name
    if "hot" in regimes and ts.accesses is not None:
        t0 = time.perf_counter()
        hs = prepare_hot(ts.accesses, a.demand, a.scope)
        notes.append(
            f"hot set: demand `{a.demand}`, scope `{a.scope}`, {hs.n_streams} streams, {hs.n_events:,} events, "
            f"{hs.n_demanded:,} demanded of {hs.n_rows:,} rows (prepared in {time.perf_counter() - t0:.1f}s)"
        )
        results += replay_hot(hs, [p for p in pols if "hot" in p.regimes], budgets, seed=a.seed, progress=not a.quiet)
    elif a.regime == "hot":
        raise SystemExit(f"--regime hot: {a.trace} has no accesses table")
    if "prefix" in regimes and ts.requests is not None:
        pd = prepare_prefix(ts.requests, ts.accesses)
        notes.append(
            f"prefix: {pd.n_requests} requests, {pd.n_nodes} nodes, {pd.unique_tokens:,} unique tokens; "
            "node importance "
            + ("from the accesses table" if pd.has_importance else "= token share (no accesses table)")
        )
        req = ts.requests
        if len(req) and (req.cached_tokens >= 0).all():
            # The server's own prefix hits, in the simulator's unit (tokens of the recorded paths).
            matched, path_tokens = int(req.cached_tokens.sum()), int(req.node_tokens.sum())
            notes.append(
                f"prefix: the server itself matched {matched:,} tokens in its prefix cache "
                f"({matched / max(path_tokens, 1):.1%} of the {path_tokens:,} path tokens; "
                f"prompts {int(req.prompt_tokens.sum()):,}, outputs {int(req.output_tokens.sum()):,} tokens)"
            )
        pp = [p for p in pols if "prefix" in p.regimes]
        results += replay_prefix_all(pd, pp, budgets, seed=a.seed, progress=not a.quiet)
    elif a.regime == "prefix":
        raise SystemExit(f"--regime prefix: {a.trace} has no requests table")
    if not results:
        raise SystemExit(f"{a.trace}: nothing to replay (no accesses or requests table)")
    path = write_replay_report(results, a.out, workload, notes)
    print(results_table(results))
    print(f"report: {path}")
    return 0


def _cmd_analyze(a: argparse.Namespace) -> int:
    from sgl_importance.sim.analyses import analyze
    from sgl_importance.sim.replay import prepare_hot
    from sgl_importance.sim.report import write_analysis_report
    from sgl_importance.trace.table_io import read_accesses

    tr = read_accesses(a.trace)
    hs = prepare_hot(tr, a.demand, a.scope)
    res = analyze(hs, k=a.k, n_segments=a.segments, max_accesses=a.max_accesses)
    path = write_analysis_report(res, a.out, tr.meta.workload or Path(a.trace).name)
    print(path.read_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_importance.sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--trace", required=True, help="trace directory (trace/schema.py)")
        sp.add_argument("--out", required=True, help="output directory")
        sp.add_argument(
            "--demand", default="mass:0.9", help="pages demanded per step: topk:K, mass:P or all (default mass:0.9)"
        )
        sp.add_argument(
            "--scope",
            default="request",
            choices=("request", "global"),
            help="one cache per (request, layer, kv_head) or per (layer, kv_head)",
        )

    r = sub.add_parser("replay", help="replay a trace under policies x budgets")
    common(r)
    r.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma list of name[:param=value...]; known: {', '.join(sorted(POLICIES))}",
    )
    r.add_argument(
        "--policy-config",
        default=None,
        help="JSON object for 'shipped', as the server's --radix-eviction-policy-config",
    )
    r.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma list of fractions of the working set")
    r.add_argument("--regime", default="auto", choices=("auto", "both", "hot", "prefix"))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=_cmd_replay)

    an = sub.add_parser("analyze", help="reuse distance, top-20%% share, recency recall, head stability, Jaccard")
    common(an)
    an.add_argument("--k", type=int, default=16, help="k of recall@k and of top-k stability")
    an.add_argument("--segments", type=int, default=4, help="decode segments per stream")
    an.add_argument("--max-accesses", type=int, default=1_000_000, help="cap for the reuse-distance computation")
    an.set_defaults(func=_cmd_analyze)

    s = sub.add_parser("synth", help="write a synthetic trace")
    s.add_argument("--kind", required=True, choices=("multi_turn", "rag", "agent", "cot", "loop"))
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--scale", type=float, default=1.0)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--layers", type=int, default=1)
    s.add_argument("--kv-heads", type=int, default=1)
    s.set_defaults(func=_cmd_synth)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
