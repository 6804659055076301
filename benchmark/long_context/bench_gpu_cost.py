"""What the hot set would cost on a GPU: arithmetic, not measured.

For a Llama-3.1-8B shape (32 layers, 8 KV heads, D 128, page 16, bf16) at 32K and 128K
tokens of context on an H100 (80 GB, 3.35 TB/s HBM; 16 GB of weights; 10 % of the
memory kept in reserve), per configuration — dense, the hot set at 20 % with the guard
off, and with the guard on —:

- device bytes per token of context: the KV; each tracked page's key range (a token slot of a
  KV page borrowed for it: 1/16 of a page) and, with the guard, its key codes (``key_codes``:
  one code row of 7 in a borrowed bf16 page); the page importance table
  (``TABLE_BYTES_PER_PAGE`` per KV pool page, the one thing set aside at start-up,
  ``table_budget.plan_table`` as the server calls it). Every byte is inside SGLang's budget:
  the rows are KV pages;
- concurrent requests that fit in ``80 GB - weights - reserve``: with every page on the
  device (a request holds its KV and its rows), and with pages outside the hot set released
  to a host pool (HiCache; the device holds each request's hot set and its rows, plus one
  prefill chunk of headroom: a prompt streams, so the newest request holds a chunk and its
  rows so far while it prefills);
- bytes a decode step reads per request: dense all KV; guard off the hot set's pages and
  the key min/max of every page (unread pages are ranked by their key bound each layer,
  ``sgl_kernel_ext.page_tally``); guard on the planned and sampled pages exactly and the key
  codes and key min/max of every other page (``estimate.estimate_outside``), plus what
  its selection reads exactly (top-p on the codes, at most the read cap);
- the decode step's time floor: bytes / bandwidth, per request, and for a full batch
  (the weights once plus every request's reads).

The per-step page counts come from the shipped decoder itself: one synthetic request of
the given length (one layer, random keys, values around a shared mean, float32 on the
CPU) goes through ``HotSetDecoder`` for its warm-up step and one guarded step, and the
guarded step's counters (``pages_dense``, ``pages_attended``, ``pages_sampled``,
``pages_estimated``, ``pages_guard_read``) give part 1's pages and what the selection read;
the sample's inclusion probability and the budget's reserve for it are
``sample.inclusion`` / ``sample.reserve``. The guard on appears three times: part 1 and the
expected sample alone (``pi * rest``: its best case), the synthetic step as the decoder ran it,
and a layer at its read cap (``--hot-set-read-cap`` of the pages). Since issue 46 no step reads
a released page inside a layer (a miss is promoted between steps), so the host column is 0.

    python -m benchmark.long_context.bench_gpu_cost --out /tmp/gpu_cost
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import torch

from sgl_importance.hot_set import HotSetDecoder, HotSetParams, KeyRanges
from sgl_importance.hot_set.guard.key_codes import bytes_per_token, kv_bytes_per_token
from sgl_importance.hot_set.guard.key_ranges import range_bytes_per_page
from sgl_importance.hot_set.pages.footprint import footprint
from sgl_importance.hot_set.plan.sample import inclusion, reserve
from sgl_importance.hot_set.plan.selection import fixed_mask
from sgl_importance.hot_set.table_budget import KVShape, plan_table
from sgl_importance.importance.page_importance import TABLE_BYTES_PER_PAGE

torch.set_grad_enabled(False)

LAYERS, KV_HEADS, Q_HEADS, DIM, PAGE, ELEMENT = 32, 8, 32, 128, 16, 2  # Llama-3.1-8B, bf16
HBM, BANDWIDTH, WEIGHTS, RESERVE = 80e9, 3.35e12, 16e9, 0.10  # H100 SXM
BUDGET = 0.2
THRESHOLD = 2048  # --hot-set-threshold's default
LAYER_HEADS = LAYERS * KV_HEADS

# Per layer and KV head.
KV_PAGE = PAGE * kv_bytes_per_token(DIM, ELEMENT)  # a page's K and V
SUMMARY_PAGE = range_bytes_per_page(DIM, ELEMENT)  # a page's key min and max, as stored
SHAPE = KVShape(LAYERS, KV_HEADS, DIM, DIM, ELEMENT, PAGE)
CODES_PAGE = PAGE * bytes_per_token(DIM, PAGE)  # a page's key codes and value norm


def decoder_counts(tokens: int, budget: float) -> dict:
    """The guarded step's counters of a synthetic request of ``tokens`` through the
    shipped decoder (one layer; counts per layer)."""
    g = torch.Generator().manual_seed(0)
    pages = -(-tokens // PAGE)
    pool_pages = pages + 2
    k_buf = torch.zeros(pool_pages * PAGE, KV_HEADS, DIM)
    v_buf = torch.zeros_like(k_buf)
    slots = torch.arange(PAGE, PAGE + tokens + 1)
    k_buf[slots] = torch.randn(slots.numel(), KV_HEADS, DIM, generator=g)
    # Values share a mean direction per head, as a model's do: zero-mean random values would
    # average to an output of norm ~1/sqrt(tokens), against which any estimate's relative
    # error is large and the guard falls back.
    mean = torch.randn(KV_HEADS, DIM, generator=g)
    v_buf[slots] = mean + torch.randn(slots.numel(), KV_HEADS, DIM, generator=g)
    ranges = KeyRanges(1, KV_HEADS, DIM, capacity_pages=pool_pages)
    params = HotSetParams(policy="importance", budget=budget)
    decoder = HotSetDecoder(params, ranges, pool_pages=pool_pages, page_size=PAGE, threshold=0)
    counts = None
    for step in range(2):
        n = tokens + step
        decoder.begin_step(["r"], [slots[:n]])
        q = torch.randn(1, Q_HEADS, DIM, generator=g)
        decoder.attend(0, q, k_buf, v_buf, sm_scale=DIM**-0.5)
        counts = decoder.end_step().counts
    keys = ("pages_dense", "pages_attended", "pages_sampled", "pages_estimated", "pages_guard_read", "guard_flagged")
    return {k: getattr(counts, k) for k in keys}


def expected_sample(tokens: int, budget: float) -> dict:
    """The plan's sizes from the formulas the decoder uses (``TrackedRequest.plan_pages``)."""
    pages = -(-(tokens + 1) // PAGE)
    full = tokens // PAGE
    params = HotSetParams(policy="importance", budget=budget)
    budget_pages = params.budget_pages(pages)
    room = budget_pages - int(fixed_mask(pages, params.sinks, params.window).sum())
    pi = inclusion(full, room)
    kept = reserve(pi, pages, budget_pages)
    return {"pages": pages, "budget": budget_pages, "pi": pi, "reserve": kept, "planned": budget_pages - kept}


CHUNK = 8192  # the prefill chunk a streamed prompt holds (the headroom of the newest request)


def fits(tokens: int, hot_pages: int, *, ranges: bool, guard: bool) -> tuple[int, int]:
    """Requests of ``tokens`` that fit: every page on the device; and pages outside the hot
    set of ``hot_pages`` released, one prefill chunk of headroom kept. A tracked request also
    holds the KV pages borrowed for its rows (``KVShape.row_pages``)."""
    usable = HBM - WEIGHTS - RESERVE * HBM
    alone = int(usable // SHAPE.kv_bytes_per_page) * PAGE
    pool = plan_table(alone, SHAPE).kv_tokens if ranges else alone
    pages = -(-tokens // PAGE)
    rows = SHAPE.row_pages(pages - 1, guarded=guard) if ranges else 0
    resident = pool // ((pages + rows) * PAGE)
    if not ranges:
        return resident, resident
    released = max(pool - CHUNK, 0) // ((hot_pages + 1 + rows) * PAGE)
    return resident, released


def rows_for(tokens: int, counts: dict, plan: dict) -> list[dict]:
    """Per configuration: device bytes per token, requests that fit, bytes read per step."""
    kv_token = kv_bytes_per_token(DIM, ELEMENT) * LAYER_HEADS
    range_token = SUMMARY_PAGE / PAGE * LAYER_HEADS  # what a range and the codes need, by themselves
    codes_token = bytes_per_token(DIM, PAGE) * LAYER_HEADS
    table_token = TABLE_BYTES_PER_PAGE / PAGE
    pages = counts["pages_dense"]
    rest = counts["pages_estimated"] + counts["pages_guard_read"]  # every full page not planned
    planned = pages - rest
    sample = round(plan["pi"] * rest)  # expected sampled pages among the rest
    # Pages read exactly: (KV pages, of which possibly released, i.e. from the host copy).
    reads = {
        "dense": (pages, 0),
        "guard off": (plan["budget"], 0),
        "certified": (planned + sample, 0),
        "synthetic": (counts["pages_attended"], 0),
        # A layer at its cap: part 1, the sample and the selection, --hot-set-read-cap of the pages.
        "cap": (max(planned + sample, math.ceil(HotSetParams().read_cap * pages)), 0),
    }
    outside = rest * (CODES_PAGE + SUMMARY_PAGE)  # every rest page's codes and key range
    # (name, reads key, hot set (pools reserved), guard on, bytes read outside the pages read)
    configs = [
        ("dense", "dense", False, False, 0),
        ("hot set 20 %, guard off", "guard off", True, False, pages * SUMMARY_PAGE),
        ("hot set 20 %, guard on: part 1 and the sample, nothing selected", "certified", True, True, outside),
        ("hot set 20 %, guard on: the synthetic step as the decoder ran it", "synthetic", True, True, outside),
        ("hot set 20 %, guard on: a layer at its read cap (20 %)", "cap", True, True, outside),
    ]
    dense_read = pages * KV_PAGE * LAYER_HEADS
    rows = []
    for name, key, hot, guard, extra in configs:
        read_pages, from_host = reads[key]
        read = (read_pages * KV_PAGE + extra) * LAYER_HEADS
        per_token = kv_token + (range_token + table_token if hot else 0.0) + (codes_token if guard else 0.0)
        if hot:  # the rows as the KV pages borrowed for them
            per_token = kv_token * (1 + 1 / SHAPE.ranges_per_page + (1 / SHAPE.codes_per_page if guard else 0.0))
            per_token += table_token
        fit, fit_released = fits(tokens, plan["budget"], ranges=hot, guard=guard)
        batch = max(fit_released, 1)
        step = (WEIGHTS + batch * read) / BANDWIDTH
        rows.append(
            {
                "tokens": tokens,
                "config": name,
                "bytes_per_token": per_token,
                "share_of_kv": per_token / kv_token,
                "fit_resident": fit,
                "fit_released": fit_released,
                "pages_read": read_pages,
                "read_bytes": read,
                "host_bytes": from_host * KV_PAGE * LAYER_HEADS,
                "read_share": read / dense_read,
                "floor_ms": read / BANDWIDTH * 1e3,
                "batch_step_ms": step * 1e3,
                "batch_tokens_s": batch / step,
            }
        )
    return rows


def budget_table() -> str:
    """What the hot set sets aside on the card at start-up (``plan_table``, as the server calls it):
    the page importance table only; its rows are borrowed KV pages, paid as requests use them."""
    usable = HBM - WEIGHTS - RESERVE * HBM
    alone = int(usable // SHAPE.kv_bytes_per_page) * PAGE
    got = plan_table(alone, SHAPE)
    return (
        "| KV pool tokens: alone → beside the table | page importance table | set aside for rows |\n|---|---|---|\n"
        f"| {alone:,} → {got.kv_tokens:,} | {got.table_bytes / 2**20:.2f} MiB | 0 |"
    )


def admission_table(prompt: int = 1024, generated: tuple[int, ...] = (3072, 8192, 31744)) -> str:
    """Long generations admitted at once on the card, guard off, with a host tier: charged their
    prompt and ``min(max_new, 4096)`` (SGLang's charge under ``ignore_eos``;
    ``--hot-set-admission length``) against their prompt and their growth to their peak
    footprint, its rows' pages included (``hot_set/footprint.footprint``, the default
    threshold), as ``scheduler/admission.py`` charges; and how many the device holds once all
    are at their final length (the hot set and its rows kept), which SGLang's 4,096-token cap
    ignores."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS as CLIP_NEW_TOKENS  # what admission reads

    usable = HBM - WEIGHTS - RESERVE * HBM
    alone = int(usable // SHAPE.kv_bytes_per_page) * PAGE
    pool = plan_table(alone, SHAPE).kv_tokens
    params = HotSetParams(policy="importance", budget=BUDGET, guard_threshold=1.0)
    per_page = (SHAPE.ranges_per_page, SHAPE.codes_per_page)
    lines = [
        "| prompt + generated | by length: tokens charged, requests at once | by footprint: tokens charged "
        "(its peak, rows included), requests at once | ratio | kept once released, rows included | "
        "held at the final length |",
        "|" + "---|" * 6,
    ]
    for new in generated:
        f = footprint(prompt, prompt + new, params, threshold=THRESHOLD, page_size=PAGE, rows_per_page=per_page)
        by_length = prompt + min(new, CLIP_NEW_TOKENS) + PAGE
        by_footprint = prompt + min(new, CLIP_NEW_TOKENS, f.peak - prompt) + PAGE
        n_length = pool // by_length
        n_footprint = pool // by_footprint
        held = pool // f.kept
        lines.append(
            f"| {prompt:,} + {new:,} | {by_length:,}, {n_length} | {by_footprint:,} ({f.peak:,}), {n_footprint} | "
            f"{n_footprint / max(n_length, 1):.2f}x | {f.kept:,} | {held} |"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = (
        "| context | configuration | device bytes / token | vs KV | requests that fit: all pages on device / "
        "released to host | pages read / step (of dense) | "
        "bytes read / step / request | vs dense | "
        "of which released pages (host copies, if released) | time floor / request | "
        "full batch (released): step floor, tokens/s |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['tokens'] // 1024}K | {r['config']} | {r['bytes_per_token'] / 1024:,.1f} KiB | "
            f"{r['share_of_kv']:.3f}× | {r['fit_resident']} / {r['fit_released']} | "
            f"{r['pages_read']:,} | "
            f"{r['read_bytes'] / 1e9:.3f} GB | {r['read_share']:.1%} | {r['host_bytes'] / 1e9:.3f} GB | "
            f"{r['floor_ms']:.3f} ms | "
            f"{r['batch_step_ms']:.1f} ms, {r['batch_tokens_s']:,.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["tokens"] for r in rows})
    names = [r["config"] for r in rows if r["tokens"] == contexts[0]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        got = [next(r for r in rows if r["tokens"] == t and r["config"] == name) for t in contexts]
        x = [j + i * width for j in range(len(contexts))]
        left.bar(x, [r["read_bytes"] / 1e9 for r in got], width, label=name)
        right.bar(x, [r["fit_released"] for r in got], width, label=name)
    for ax in (left, right):
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(contexts))])
        ax.set_xticklabels([f"{t // 1024}K tokens" for t in contexts])
    left.set_ylabel("GB read per decode step per request")
    left.set_yscale("log")
    right.set_ylabel("concurrent requests (unplanned pages released)")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle("Llama-3.1-8B shape on an H100: arithmetic, not measured", fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32768,131072", help="tokens of context")
    p.add_argument("--out", type=Path, default=Path("/tmp/gpu_cost"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows, plans = [], []
    for tokens in (int(x) for x in a.contexts.split(",")):
        counts = decoder_counts(tokens, BUDGET)
        plan = expected_sample(tokens, BUDGET)
        plans.append({"tokens": tokens, **plan, **counts})
        rows += rows_for(tokens, counts, plan)
    command = "python -m benchmark.long_context.bench_gpu_cost " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    plan_lines = [
        "| context | pages | budget pages | sample π | reserve | planned | decoder: pages read (of dense) | "
        "sampled | estimated | read by the guard |",
        "|" + "---|" * 10,
    ]
    for q in plans:
        plan_lines.append(
            f"| {q['tokens'] // 1024}K | {q['pages']:,} | {q['budget']:,} | {q['pi']:.4f} | {q['reserve']} | "
            f"{q['planned']:,} | {q['pages_attended']:,} ({q['pages_dense']:,}) | {q['pages_sampled']} | "
            f"{q['pages_estimated']:,} | {q['pages_guard_read']} |"
        )
    usable = HBM - WEIGHTS - RESERVE * HBM
    text = (
        f"Command (arithmetic, not measured; the page counts from the shipped decoder on the CPU):\n\n"
        f"```\n{command.strip()}\n```\n\n"
        f"Llama-3.1-8B shape ({LAYERS} layers, {KV_HEADS} KV heads, D {DIM}, page {PAGE}, bf16) on an H100: "
        f"{HBM / 1e9:.0f} GB, {BANDWIDTH / 1e12:.2f} TB/s, {WEIGHTS / 1e9:.0f} GB of weights, "
        f"{RESERVE:.0%} reserve: {usable / 1e9:.0f} GB for the KV and the hot set's state.\n\n"
        "The guarded step's plan (one synthetic request, random keys; per layer):\n\n"
        + "\n".join(plan_lines)
        + "\n\nArithmetic, not measured:\n\n"
        + table(rows)
        + "\n\nWhat the hot set sets aside at start-up (``plan_table``, as the server calls it; its rows "
        + "are KV pages borrowed as requests use them):\n\n"
        + budget_table()
        + "\n\nLong generations admitted at once (guard off, host tier; admission by footprint, "
        + "``scheduler/admission.py``; arithmetic):\n\n"
        + admission_table()
        + "\n"
    )
    (a.out / "RESULTS_gpu_cost.md").write_text(text)
    (a.out / "gpu_cost.json").write_text(json.dumps({"plans": plans, "rows": rows}, indent=1))
    print(text)
    plot(rows, a.out / "gpu_cost.png")


if __name__ == "__main__":
    main()
