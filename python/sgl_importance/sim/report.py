"""Markdown tables and PNG curves for replays and analyses (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sgl_importance.sim.metrics import ReplayResult, baseline_name, fraction_of, relative_gain

REGIME_TITLES = {"hot": "Intra-request hot set (pages)", "prefix": "Prefix cache across requests (tokens)"}


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _signed(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f}%"


def _speed(r: ReplayResult) -> str:
    if r.seconds <= 0:
        return "n/a"
    if r.regime == "hot":
        return f"{r.counts.accesses / r.seconds:,.0f} pages/s"
    return f"{r.counts.events / r.seconds:,.0f} requests/s"


def results_table(results: Sequence[ReplayResult]) -> str:
    """One markdown table per regime: every (policy, budget) with gains vs LRU and vs Belady."""
    out = []
    for regime in ("hot", "prefix"):
        rs = [r for r in results if r.regime == regime]
        if not rs:
            continue
        names = list(dict.fromkeys(r.policy for r in rs))
        lru = baseline_name(names, "lru")
        bel = baseline_name(names, "belady")
        idx = {(r.policy, r.budget_frac): r for r in rs}
        out.append(f"### {REGIME_TITLES[regime]}\n")
        out.append(
            "| policy | budget | hit rate | mass recall | hit vs LRU | recall vs LRU | hit / Belady | replay speed |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|"
        )
        for frac in sorted({r.budget_frac for r in rs}):
            base = idx.get((lru, frac)) if lru else None
            best = idx.get((bel, frac)) if bel else None
            for name in names:
                r = idx.get((name, frac))
                if r is None:
                    continue
                g_hit = relative_gain(r.hit_rate, base.hit_rate) if base else float("nan")
                g_rec = relative_gain(r.mass_recall, base.mass_recall) if base else float("nan")
                f_bel = fraction_of(r.hit_rate, best.hit_rate) if best else float("nan")
                out.append(
                    f"| {name} | {frac:g} ({r.budget}) | {_pct(r.hit_rate)} | {_pct(r.mass_recall)} | "
                    f"{_signed(g_hit)} | {_signed(g_rec)} | {_pct(f_bel)} | {_speed(r)} |"
                )
        out.append("")
    return "\n".join(out)


def per_layer_table(results: Sequence[ReplayResult]) -> str:
    """Hit rate / mass recall per layer for each (policy, budget), when the trace has layers."""
    rs = [r for r in results if r.per_layer]
    if not rs:
        return ""
    layers = sorted({layer for r in rs for layer in r.per_layer})
    head = "| policy | budget | " + " | ".join(f"L{layer} hit / recall" for layer in layers) + " |"
    sep = "|---|---:|" + "---:|" * len(layers)
    lines = ["### Per layer\n", head, sep]
    for r in rs:
        cells = [
            f"{_pct(r.per_layer[layer].hit_rate)} / {_pct(r.per_layer[layer].mass_recall)}"
            if layer in r.per_layer
            else "-"
            for layer in layers
        ]
        lines.append(f"| {r.policy} | {r.budget_frac:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(results: Sequence[ReplayResult], out_dir: Path, title: str) -> list[Path]:
    """hit-rate-vs-budget and mass-recall-vs-budget PNGs, one pair per regime."""
    plt = _plt()
    files = []
    for regime in ("hot", "prefix"):
        rs = [r for r in results if r.regime == regime]
        if not rs:
            continue
        for metric, label in (("hit_rate", "hit rate"), ("mass_recall", "mass recall")):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for name in dict.fromkeys(r.policy for r in rs):
                pts = sorted((r.budget_frac, getattr(r, metric)) for r in rs if r.policy == name)
                style = "--" if name.startswith("belady") else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=name)
            ax.set_xlabel("budget (fraction of working set)")
            ax.set_ylabel(label)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.set_title(f"{title}: {REGIME_TITLES[regime]}", fontsize=9)
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            f = out_dir / f"{regime}_{metric}.png"
            fig.savefig(f, dpi=110)
            plt.close(fig)
            files.append(f)
    return files


def write_replay_report(
    results: Sequence[ReplayResult], out_dir: str | Path, title: str, notes: Sequence[str] = ()
) -> Path:
    """Write ``report.md``, ``results.json`` and the curves into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot_curves(results, out, title)
    md = [f"# Cache replay: {title}\n", *[f"- {n}" for n in notes], ""]
    md.append(results_table(results))
    plt_md = per_layer_table(results)
    if plt_md:
        md.append(plt_md)
    pre = [r for r in results if r.counts.prefetched]
    if pre:
        md.append("### Prefetch traffic (pages, apart from demand fetches)\n")
        md.append("| policy | budget | demand fetched | prefetched | prefetched then hit |\n|---|---:|---:|---:|---:|")
        for r in pre:
            c = r.counts
            md.append(
                f"| {r.policy} | {r.budget_frac:g} | {c.fetched:,.0f} | {c.prefetched:,.0f} | {c.prefetch_used:,.0f} |"
            )
        md.append("")
    md += [f"![{p.stem}]({p.name})" for p in pngs]
    (out / "report.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps([r.to_json() for r in results], indent=1))
    return out / "report.md"


def write_analysis_report(res: dict[str, Any], out_dir: str | Path, title: str) -> Path:
    """Write ``analysis.md``, ``analysis.json`` and plots of an :func:`analyses.analyze` result."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rd = res.get("_reuse_cdf")
    data = {k: v for k, v in res.items() if not k.startswith("_")}
    (out / "analysis.json").write_text(json.dumps(data, indent=1))
    if rd is not None and rd.total:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        hi = max(2, int(rd.distances.max()) + 2) if rd.distances.shape[0] else 2
        xs = np.unique(np.geomspace(1, hi, 200).astype(np.int64))
        ax.step(xs, rd.cdf(xs), where="post")
        ax.set_xscale("log")
        ax.set_xlabel("LRU stack distance (distinct pages)")
        ax.set_ylabel("share of accesses with smaller distance")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{title}: reuse distance CDF ({rd.cold} cold of {rd.total})", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "reuse_cdf.png", dpi=110)
        plt.close(fig)
    segs = [
        ("recency_recall", "recency recall@k"),
        ("jaccard_ema", "Jaccard EMA vs per-step top-10%"),
        ("jaccard_accumulated", "Jaccard accumulated vs per-step top-10%"),
    ]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label in segs:
        ps = res[key]["per_segment"]
        ax.plot(range(1, len(ps) + 1), ps, marker="o", label=label)
    ax.set_xlabel("decode segment (early -> late)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{title}: per decode segment", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "segments.png", dpi=110)
    plt.close(fig)
    hsd = res["head_stability"]["per_layer_head"]
    if hsd:
        fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(hsd) + 2), 3.6))
        ax.bar(range(len(hsd)), list(hsd.values()))
        ax.set_xticks(range(len(hsd)), list(hsd.keys()), rotation=90, fontsize=7)
        ax.set_ylabel(f"top-{res['head_stability']['k']} overlap of consecutive steps")
        ax.set_xlabel("layer/kv_head (-1 = reduced)")
        ax.set_ylim(0, 1.02)
        fig.tight_layout()
        fig.savefig(out / "head_stability.png", dpi=110)
        plt.close(fig)
    r = data
    lines = [
        f"# Trace analysis: {title}\n",
        f"- streams {r['streams']}, events {r['events']}, demanded accesses {r['accesses']} (demand `{r['demand']}`)",
        f"- reuse distance: median {r['reuse']['median']:g} distinct pages, "
        f"{r['reuse']['cold']} cold accesses of {r['reuse']['accesses']}",
        f"- top 20% of pages ({r['top20']['top_pages']:.0f} of {r['top20']['pages']:.0f}) take "
        f"{_pct(r['top20']['access_share'])} of accesses and {_pct(r['top20']['mass_share'])} of attention mass",
        f"- recency recall@{r['recency_recall']['k']}: {_pct(r['recency_recall']['overall'])} overall",
        f"- per-head stability (top-{r['head_stability']['k']} overlap of consecutive steps): "
        f"{_pct(r['head_stability']['overall'])}",
        f"- Jaccard aggregate vs per-step top-10%: EMA {_pct(r['jaccard_ema']['overall'])}, "
        f"accumulated {_pct(r['jaccard_accumulated']['overall'])}",
        "",
        "| LRU pages | " + " | ".join(str(x) for x in r["reuse"]["cdf"]) + " |",
        "|---|" + "---:|" * len(r["reuse"]["cdf"]),
        "| share with smaller stack distance | " + " | ".join(_pct(v) for v in r["reuse"]["cdf"].values()) + " |",
        "",
        "| decode segment | " + " | ".join(str(i + 1) for i in range(len(r["recency_recall"]["per_segment"]))) + " |",
        "|---|" + "---:|" * len(r["recency_recall"]["per_segment"]),
    ]
    for key, label in segs:
        lines.append(f"| {label} | " + " | ".join(_pct(v) for v in r[key]["per_segment"]) + " |")
    lines += ["", "![reuse](reuse_cdf.png)", "![segments](segments.png)"]
    if hsd:
        lines.append("![heads](head_stability.png)")
    (out / "analysis.md").write_text("\n".join(lines) + "\n")
    return out / "analysis.md"
