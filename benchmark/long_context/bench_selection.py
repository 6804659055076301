"""Issue 46's decision table: per-head top-p on the key codes and five ways to estimate and bound
the unread rest, against the request plan the hot set reads today, at equal pages read.

Offline, on the embedded model (transformers, float32, CPU): prompts of ``bench_hot_set.py``
(needle, key-value, adversarial) prefill, then decode greedily while ``bench_bound.Capture`` keeps
every layer's post-RoPE queries, keys and values. Each decode step after the first (the dense
warm-up) and each layer is then put through ``tail_estimators.evaluate`` for every cap (pages read,
sinks and window included, as a share of the context's pages) and ``--seeds`` sample seeds per
request: pages read, the exact relative error over all query heads and the worst head's, the
bound each candidate reports, whether it certifies (bound <= tau) and whether the error exceeded
the bound. The plan ranks pages by an importance EMA (decay 0.98) of each page's largest exact
share over layers and heads in the steps before: kinder to it than the hot set, which only sees
the pages it read. Beside it, per layer-step and KV head, the oracle top-p page counts (exact
masses) at p in {0.9, 0.95, 0.98} and the same counts from the codes.

Bytes per layer-step, as a share of dense's K+V bytes in bf16 (the ratios hold for any head dim):
pages read, plus for code-scored candidates 12.5 % (4-bit codes) + 6.25 % (bf16 per-page key
min/step) of each scored rest page, plus 3.1 % (a bf16 value mean) of each tail page for the
page-mean candidates.

    python -m benchmark.long_context.bench_selection --out /tmp/bench_selection
    python -m benchmark.long_context.bench_selection --lengths 2048 --tasks needle --n 1 --steps 3 \
        --seeds 20 --out /tmp/bs  # smoke
    python -m benchmark.long_context.bench_selection --report --out /tmp/bench_selection

Writes ``rows.pt`` (every layer-step's numbers), ``RESULTS_selection.md``, ``selection.json``,
``run.json`` (the command and its minutes) and ``selection.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmark.long_context.bench_bound import load_captured_model
from benchmark.long_context.bench_hot_set import PAGE, make_trials
from benchmark.long_context.tail_estimators import CANDIDATES, SAMPLING, Setup, evaluate, layer_step, topp_pages

torch.set_grad_enabled(False)

DECAY = 0.98
ORACLE_P = (0.9, 0.95, 0.98)
CODES, SUMMARIES, VALUE_MEAN = 0.125, 0.0625, 0.03125  # of a page's bf16 K+V bytes


def page_bytes(name: str, read: float, rest: float, tail: float, pages: int) -> float:
    """A candidate's bytes per layer-step and KV head as a share of dense's (see the module doc)."""
    tax = 0.0 if name == "plan" else (CODES + SUMMARIES) * rest
    if name in ("topp+mean", "topp+diff"):
        tax += VALUE_MEAN * tail
    return (read + tax) / pages


def run_prompt(capture, model, trial: dict, steps: int, caps: list[float], setup: Setup, seeds: torch.Tensor,
               scale: float) -> list[dict]:  # fmt: skip
    """Every layer-step of one prompt: a row per (step, layer, cap) with every candidate's numbers."""
    queries, keys, values = capture.decode(model, trial["ids"], steps)
    prompt_len = len(trial["ids"])
    ema: torch.Tensor | None = None
    observed = 0
    rows = []
    for s, q in enumerate(queries):
        n = prompt_len + s + 1
        shares = []
        for layer in range(q.shape[0]):
            step = layer_step(q[layer], keys[layer, :, :n], values[layer, :, :n], scale, setup)
            shares.append((step.d_page / step.d_page.sum(-1, keepdim=True)).amax(0))
            if ema is None:
                continue  # the first step is dense: it seeds the plan
            importance = ema / (1.0 - DECAY**observed)
            importance = torch.nn.functional.pad(importance, (0, step.always.numel() - importance.numel()))
            row = {"step": s, "layer": layer, "pages": step.always.numel()}
            for p in ORACLE_P:
                oracle = topp_pages(step, p, -1, mass=step.d_page).sum(-1) + step.always.sum()
                coded = topp_pages(step, p, -1).sum(-1) + step.always.sum()
                row[f"oracle_{p}"] = (oracle.double() / row["pages"]).tolist()
                row[f"codes_{p}"] = (coded.double() / row["pages"]).tolist()
            for cap in caps:
                got = evaluate(step, Setup(**{**setup.__dict__, "cap": cap}), importance, seeds)
                row[cap] = {name: {k: (v.float() if torch.is_tensor(v) else v) for k, v in r.items()}
                            for name, r in got.items()}  # fmt: skip
            rows.append(row)
        share = torch.stack(shares).amax(0)
        if ema is None:
            ema = torch.zeros_like(share)
        ema = torch.nn.functional.pad(ema, (0, share.numel() - ema.numel()))
        ema = DECAY * ema + (1 - DECAY) * share
        observed += 1
    return rows


def quantile(x: torch.Tensor, q: float) -> float:
    x = x[torch.isfinite(x)].double()
    return float("nan") if x.numel() == 0 else torch.quantile(x, q).item()


def summarise(results: dict, setup: Setup) -> dict:
    """Per length and cap, each candidate's pages, bytes, error, certification and exceedance;
    per length, the oracle and code top-p page counts."""
    table = {}
    for length, prompts in results.items():
        rows = [r for rows in prompts.values() for r in rows]
        entry = {"layer_steps": len(rows), "prompts": len(prompts), "topp": {}}
        for p in ORACLE_P:
            oracle = torch.tensor([x for r in rows for x in r[f"oracle_{p}"]])
            coded = torch.tensor([x for r in rows for x in r[f"codes_{p}"]])
            entry["topp"][p] = {"oracle_median": quantile(oracle, 0.5), "oracle_p90": quantile(oracle, 0.9),
                                "codes_median": quantile(coded, 0.5), "codes_p90": quantile(coded, 0.9)}  # fmt: skip
        caps = [k for k in rows[0] if isinstance(k, float)] if rows else []
        for cap in caps:
            by = {}
            for name in CANDIDATES:
                cells = [r[cap][name] for r in rows]
                err = torch.cat([c["error"] for c in cells])
                head = torch.cat([c["head_error"] for c in cells])
                bound = torch.cat([c["bound"] for c in cells])
                read = torch.cat([c["read"] for c in cells]) / torch.cat(
                    [torch.full_like(c["read"], c["pages"]) for c in cells]
                )
                nbytes = [page_bytes(name, c["read"].mean().item(), c["rest"], c["tail"], c["pages"]) for c in cells]
                certified = bound <= setup.tau
                over = (err > bound + 1e-9) & certified
                # Per seed (a request's draw): its exceedance rate among its certified layer-steps.
                per_seed = torch.stack([((c["error"] > c["bound"] + 1e-9) & (c["bound"] <= setup.tau)).double()
                                        for c in cells]).mean(0)  # fmt: skip
                finite = torch.isfinite(bound) & (bound > 0)
                ratio = err[finite] / bound[finite]
                by[name] = {
                    "read": read.mean().item(), "bytes": sum(nbytes) / len(nbytes),
                    "error_median": quantile(err, 0.5), "error_p90": quantile(err, 0.9),
                    "error_p99": quantile(err, 0.99),
                    "head_error_p90": quantile(head, 0.9),
                    "certified": certified.double().mean().item(),
                    "exceeded": over.double().sum().item() / max(1, certified.sum().item()),
                    "exceeded_ci": 1.96 * per_seed.std().item() / math.sqrt(max(1, per_seed.numel())),
                    "violations_any": int(((err > bound + 1e-9)).sum()),
                    "ratio_median": quantile(ratio, 0.5), "ratio_p95": quantile(ratio, 0.95),
                    "sampling": name in SAMPLING,
                }  # fmt: skip
            entry[cap] = by
        table[length] = entry
    return table


def report(table: dict, setup: Setup, out: Path, meta: dict) -> str:
    lines = [f"# Selection and tail estimators at equal pages read ({meta.get('when', '')})", "",
             f"`{meta.get('command', '')}` ({meta.get('minutes', '?')} min). p = {setup.p}, tau = {setup.tau}, "
             f"delta = {setup.delta}, sample: 2 pages per {setup.stratum}-page stratum, {meta.get('seeds')} seeds "
             "per request. Error: relative L2 over all query heads against attention over every token (float64); "
             "head: the worst query head's. Bytes: of dense's bf16 K+V per layer-step (codes and summaries "
             "counted). Certified: bound <= tau; exceeded: certified layer-steps whose error is over the bound "
             "(+- 95 % CI over seeds).", ""]  # fmt: skip
    for length, entry in table.items():
        lines += [f"## {length} tokens: {entry['prompts']} prompts, {entry['layer_steps']} layer-steps", "",
                  "Oracle top-p (exact page masses) and top-p on the codes: pages needed per KV head, as a share "
                  "of the context's pages (sinks and window included).", "",
                  "| p | oracle median | oracle p90 | codes median | codes p90 |", "|---|---|---|---|---|"]  # fmt: skip
        for p, t in entry["topp"].items():
            lines.append(f"| {p} | {t['oracle_median']:.3f} | {t['oracle_p90']:.3f} | {t['codes_median']:.3f} | "
                         f"{t['codes_p90']:.3f} |")  # fmt: skip
        lines.append("")
        for cap, by in ((k, v) for k, v in entry.items() if isinstance(k, float)):
            lines += [f"Cap {cap:.0%} of the pages:", "",
                      "| candidate | pages read | bytes | error median | p90 | p99 | worst head p90 | certified | "
                      "exceeded | error/bound median | p95 |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
            for name, c in by.items():
                exceeded = "—" if name == "plan" else f"{c['exceeded']:.4f} ± {c['exceeded_ci']:.4f}"
                lines.append(
                    f"| {name} | {c['read']:.3f} | {c['bytes']:.3f} | {c['error_median']:.4f} | {c['error_p90']:.4f} | "
                    f"{c['error_p99']:.4f} | {c['head_error_p90']:.4f} | {c['certified']:.3f} | {exceeded} | "
                    f"{c['ratio_median']:.3f} | {c['ratio_p95']:.3f} |"
                )
            lines.append("")
    text = "\n".join(lines)
    (out / "RESULTS_selection.md").write_text(text)
    (out / "selection.json").write_text(json.dumps({str(k): v for k, v in table.items()}, indent=1, default=str))
    plot(table, out / "selection.png")
    return text


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(5 * len(table), 4), squeeze=False)
    for ax, (length, entry) in zip(axes[0], table.items()):
        for name in CANDIDATES:
            points = [(v[name]["bytes"], v[name]["error_median"]) for k, v in entry.items() if isinstance(k, float)]
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=name)
        ax.set(title=f"{length} tokens", xlabel="bytes per layer-step / dense", ylabel="median relative error",
               yscale="log")  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--tasks", default="needle,kv,adversarial")
    ap.add_argument("--n", type=int, default=2, help="prompts per task and length")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per prompt (the first is the dense warm-up)")
    ap.add_argument("--caps", default="0.1,0.2,0.3", help="pages read, as a share of the context's pages")
    ap.add_argument("--p", type=float, default=0.95, help="top-p of the codes' estimated mass")
    ap.add_argument("--stratum", type=int, default=32, help="pages per stratum; two are sampled in each")
    ap.add_argument("--seeds", type=int, default=200, help="sample seeds per request")
    ap.add_argument("--report", action="store_true", help="only the tables and plot again, from rows.pt")
    a = ap.parse_args()
    for name, value, low, high in (("--p", a.p, 0.0, 1.0),):
        if not low < value <= high:
            ap.error(f"{name} {value} is outside ({low}, {high}]")
    caps = [float(c) for c in a.caps.split(",")]
    if any(not 0 < c <= 1 for c in caps) or a.stratum < 2 or a.seeds < 2:
        ap.error("--caps in (0, 1], --stratum >= 2, --seeds >= 2")
    setup = Setup(page=PAGE, p=a.p, stratum=a.stratum)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.report:
        saved = torch.load(a.out / "rows.pt")
        print(report(summarise(saved["results"], setup), setup, a.out, saved["meta"]))
        return
    tokenizer, model, capture, scale = load_captured_model()
    started = time.time()
    results: dict[int, dict[str, list]] = {}
    count = 0
    for length in (int(x) for x in a.lengths.split(",")):
        for task in a.tasks.split(","):
            for trial in make_trials(tokenizer, task, [length], a.n, 0):
                seeds = torch.arange(a.seeds) + 1_000_003 * count  # each request its own seeds
                count += 1
                t0 = time.time()
                rows = run_prompt(capture, model, trial, a.steps, caps, setup, seeds, scale)
                results.setdefault(length, {})[f"{task}-{trial['trial']}"] = rows
                print(f"{task} {length} #{trial['trial']}: {len(rows)} layer-steps in {time.time() - t0:.0f}s",
                      flush=True)  # fmt: skip
    meta = {"command": shlex.join(["python", "-m", "benchmark.long_context.bench_selection", *sys.argv[1:]]),
            "minutes": round((time.time() - started) / 60, 1), "seeds": a.seeds,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    torch.save({"results": results, "meta": meta}, a.out / "rows.pt")
    (a.out / "run.json").write_text(json.dumps(meta, indent=1))
    print(report(summarise(results, setup), setup, a.out, meta))


if __name__ == "__main__":
    main()
