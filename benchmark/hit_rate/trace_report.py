"""Tables and plots of ``bench_trace_replay.py``: offline page-model rows and live server rows."""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

BUILTINS = ("lru", "sglang_slru", "lfu")
FIXED = {"slice", "pool", "requests", "ideal", "prompt_tokens", "belady", *BUILTINS}


def _policies(row: dict) -> list[str]:
    return [k for k in row if k not in FIXED]


def best_builtin(row: dict) -> int:
    """The most cached tokens any of SGLang's built-in policies got on this row."""
    return max(row[b] for b in BUILTINS if b in row)


def belady_share(value: float, lru: float, belady: float) -> float:
    """The share of Belady's gain over LRU that ``value`` takes (NaN without a gain)."""
    return (value - lru) / (belady - lru) if belady > lru else float("nan")


def offline_markdown(rows: list[dict]) -> str:
    """Per slice and pool: every policy's cached tokens; then each policy against the
    best built-in, per pool, over the conversation slices and on the others."""
    if not rows:
        return "no rows\n"
    pols = _policies(rows[0])
    head = ["slice", "pool", "ideal", *BUILTINS, *pols, "belady"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["slice"], f"{r['pool'] // 1024}K", f"{r['ideal']:,}"]
        best = best_builtin(r)
        cells += [f"{r[b]:,}" for b in BUILTINS]
        cells += [f"{r[p]:,} ({r[p] / best:.3f}x)" for p in pols]
        cells.append(f"{r['belady']:,}")
        out.append("| " + " | ".join(map(str, cells)) + " |")
    out += ["", "Against SGLang's best built-in on the same slice and pool (min / mean over the slices), "
            "and the share of Belady's gain over `lru` taken (mean):", ""]  # fmt: skip
    out += ["| policy | pool | conversation slices: vs best built-in min / mean | Belady share | other slices |",
            "|---|---|---|---|---|"]  # fmt: skip
    for p in pols:
        for pool in sorted({r["pool"] for r in rows}):
            conv = [r for r in rows if r["pool"] == pool and r["slice"].startswith("conversation")]
            other = [r for r in rows if r["pool"] == pool and not r["slice"].startswith("conversation")]
            ratio = [r[p] / best_builtin(r) for r in conv]
            share = [belady_share(r[p], r["lru"], r["belady"]) for r in conv]
            others = ", ".join(f"{r['slice']} {r[p] / best_builtin(r):.3f}x" for r in other)
            cell = f"{min(ratio):.3f} / {fmean(ratio):.3f}x" if ratio else "-"
            taken = fmean(share) if share else float("nan")
            out.append(f"| `{p}` | {pool // 1024}K | {cell} | {taken:.2f} | {others} |")
    return "\n".join(out) + "\n"


def live_markdown(rows: list[dict]) -> str:
    """Per pool and arm: what the server reported, the page model beside it, TTFT."""
    head = ["slice", "pool", "arm", "requests", "cached (of ideal)", "device / host / storage", "vs lru",
            "page model", "TTFT mean / p50 / p99 ms", "wall s"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lru = next((x for x in rows if x["pool"] == r["pool"] and x["arm"] == "lru"), None)
        vs = f"{r['cached'] / lru['cached']:.3f}x" if lru and lru["cached"] else "-"
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        cells = [
            r["slice"], f"{r['pool'] // 1024}K", r["arm"], f"{r['requests']}{failed}",
            f"{r['cached']:,} ({r['cached'] / max(r['ideal'], 1):.3f})",
            f"{r['device']:,} / {r['host']:,} / {r['storage']:,}", vs, f"{r['offline']:,}",
            f"{r['ttft_mean_ms']:.0f} / {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}", f"{r['seconds']:.0f}",
        ]  # fmt: skip
        out.append("| " + " | ".join(map(str, cells)) + " |")
    if rows:
        r = rows[0]
        out += ["", f"Same slice offline: ideal {r['ideal']:,}; per pool, lru / Belady: "
                + ", ".join(f"{x['pool'] // 1024}K {x['offline_lru']:,} / {x['belady']:,}"
                            for x in {x["pool"]: x for x in rows}.values())]  # fmt: skip
    return "\n".join(out) + "\n"


def turns_markdown(rows: list[dict]) -> str:
    """``production_trace.turn_statistics`` as a table."""
    out = ["| turn | requests | followed by another turn | median gap to it (s) |", "|---|---|---|---|"]
    last = rows[-1]["turn"] if rows else 0
    for r in rows:
        turn = f"{r['turn']}+" if r["turn"] == last else str(r["turn"])
        out.append(f"| {turn} | {r['requests']:,} | {r['followed']:.2f} | {r['median_gap_s']:.0f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path, live: bool = False) -> None:
    """One panel per pool size: each policy's cached tokens as a share of the ideal
    (offline: mean over the conversation slices, bars; other slices as points; live:
    stacked by tier with TTFT above each bar), Belady as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = sorted({r["pool"] for r in rows})
    if not pools:
        return
    fig, axes = plt.subplots(1, len(pools), figsize=(4.5 * len(pools), 4), squeeze=False)
    for ax, pool in zip(axes[0], pools):
        here = [r for r in rows if r["pool"] == pool]
        if live:
            names = [r["arm"] for r in here]
            bottom = [0.0] * len(here)
            for tier, color in (("device", "tab:blue"), ("host", "tab:orange"), ("storage", "tab:green")):
                vals = [r[tier] / max(r["ideal"], 1) for r in here]
                ax.bar(names, vals, bottom=bottom, color=color, label=tier)
                bottom = [b + v for b, v in zip(bottom, vals)]
            for x, (r, b) in enumerate(zip(here, bottom)):
                ax.text(x, b + 0.01, f"{r['ttft_mean_ms']:.0f} ms", ha="center", fontsize=8)
            ax.axhline(here[0]["belady"] / max(here[0]["ideal"], 1), color="k", ls="--", label="Belady (offline)")
            ax.axhline(here[0]["offline_lru"] / max(here[0]["ideal"], 1), color="gray", ls=":", label="lru (offline)")
        else:
            conv = [r for r in here if r["slice"].startswith("conversation")]
            other = [r for r in here if not r["slice"].startswith("conversation")]
            names = [*BUILTINS, *_policies(here[0])]
            if conv:
                ax.bar(range(len(names)), [fmean(r[n] / r["ideal"] for r in conv) for n in names], color="tab:blue",
                       label=f"conversation ({len(conv)} slices, mean)")  # fmt: skip
                ax.axhline(fmean(r["belady"] / r["ideal"] for r in conv), color="k", ls="--", label="Belady")
            for r, color in zip(other, ("tab:red", "tab:green", "tab:purple")):
                ax.plot(range(len(names)), [r[n] / r["ideal"] for n in names], "o", color=color, label=r["slice"])
            short = [n.replace("shipped:form=credit", "credit").replace(":", "\n") for n in names]
            ax.set_xticks(range(len(names)), short, fontsize=7, rotation=30)
        ax.set_title(f"device pool {pool // 1024}K tokens")
        ax.set_ylabel("cached prompt tokens / ideal")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
