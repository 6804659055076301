"""The guard's bound, measured through the shipped decoder: how often it certifies a
layer, how often it reads more, and how often the exact error exceeds its bound.

Offline, on the embedded model (transformers, float32, CPU), for prompts of
``bench_hot_set.py`` (needle, key-value, adversarial): the model prefills, then decodes
greedily while forward hooks on every attention layer keep its post-RoPE queries, keys
and values (``Capture``). Each decode step is then replayed through the shipped
``hot_set.HotSetDecoder`` (policy ``importance``, page 16, every request long), as an
attention backend drives it: per-layer KV buffers in SGLang's pool layout
``[slots, kv_heads, D]`` (page 0 is padding; the request's tokens from slot 16 on), the
keys written (the prompt at once, then one token per step), ``begin_step``, ``attend``
for every layer, ``end_step``. The first step is the dense warm-up and is not counted;
from the second on the guard runs on the key ranges and codes the decoder wrote at the
end of the step before.

After each guarded ``attend``, the decoder's output is compared with float64 attention
over all tokens, and ``decoder.last_guard`` says what the guard did: its bound (the
``relative`` it certified), whether it read heavy pages, whether it fell back (read the
whole rest: the output is then exact) and how many pages it left to the estimate. The
guard is also called a second time, with no threshold, through a wrapper around
``guard.guard_layer`` (``GuardProbe``; the decoder's own call and output are
untouched): that gives, for every guarded layer-step, the sampled estimate before any
fallback or rest left out, its bound and its exact error. A replay with the guard off
gives the error of the planned pages alone.

Per length, budget and threshold it reports: the share of layer-steps certified with
nothing more read, with heavy pages read, with the rest left out as negligible, and
fallbacks; the exact error where certified and the bound; **violations** (certified
layer-steps whose exact error exceeds the bound, against ``estimate.DELTA``), and the
same for the sampled estimate before fallback, also by the number of pages sampled (a
request draws its sample once: every layer and step of it shares its luck); pages read exactly (planned, sampled,
heavy, fallback) as a share of dense, from the decoder's counters; and the guard's
state per token (``key_codes.bytes_per_token``) against the KV.

    python -m benchmark.long_context.bench_bound --out /tmp/bench_bound
    python -m benchmark.long_context.bench_bound --n 1 --lengths 2048 --steps 3 --budgets 0.2 --out /tmp/bb  # smoke
    python -m benchmark.long_context.bench_bound --report --out /tmp/bench_bound  # the tables again, from the journal
    python -m benchmark.long_context.bench_bound --resume --out /tmp/bench_bound  # after a kill: the prompts not done

Every guarded layer-step goes to ``--out``/layer_steps.jsonl (a ``{"done": rid}`` line after
each finished prompt); RESULTS_bound.md, bound.json, run.json (the command and its minutes) and
bound_sampled.png beside it. An 8K prompt's prefill through transformers peaks near 8 GB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

import sgl_importance.hot_set.decode as decode_module
from benchmark.long_context.bench_hot_set import GUARD_DEFAULT, PAGE, make_trials
from sgl_importance.hot_set import HotSetDecoder, HotSetParams, KeyRanges
from sgl_importance.hot_set.estimate import DELTA
from sgl_importance.hot_set.key_codes import bytes_per_token, kv_bytes_per_token
from sgl_importance.local_server import model_path

torch.set_grad_enabled(False)

# An exact error within this much of the bound is float32 rounding, not a violation
# (a fallback or fully read layer has bound 0 and an error of ~1e-7).
SLACK = 1e-5


class Capture:
    """Forward hooks that keep each layer's post-RoPE queries, keys and values."""

    def __init__(self, model) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb
        self.q: list[torch.Tensor] = []
        self.k: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
        self.v: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_hook(self._hook(i), with_kwargs=True)

    def _hook(self, index: int):
        def hook(attn, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            shape = (*hidden.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(hidden).view(shape).transpose(1, 2)
            k = attn.k_proj(hidden).view(shape).transpose(1, 2)
            v = attn.v_proj(hidden).view(shape).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            if index == 0:
                self.q = []
            self.q.append(q[0])
            self.k[index].append(k[0])
            self.v[index].append(v[0])

        return hook

    def decode(self, model, ids: list[int], steps: int):
        """Greedy decode; each step's queries ``[L, q_heads, D]``, all keys and values ``[L, kvh, T, D]``."""
        self.k = [[] for _ in self.k]
        self.v = [[] for _ in self.v]
        queries = []
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)  # not 8K x 49K logits
        past, token = out.past_key_values, out.logits[0, -1].argmax()
        for _ in range(steps):
            out = model(token.view(1, 1), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[0, -1].argmax()
            queries.append(torch.stack([q[:, -1] for q in self.q]))
        keys = torch.stack([torch.cat(c, dim=1) for c in self.k])
        values = torch.stack([torch.cat(c, dim=1) for c in self.v])
        return queries, keys, values


def load_captured_model() -> tuple[Any, Any, Capture, float]:
    """The embedded model in float32 with a ``Capture`` on it: (tokenizer, model, capture,
    the attention's softmax scale)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tokenizer, model, Capture(model), 1.0 / math.sqrt(model.config.head_dim)


def exact_outputs(queries, keys, values, prompt_len: int, scale: float) -> list[torch.Tensor]:
    """float64 attention over every token: per step ``[L, q_heads, D]`` (a layer at a time:
    the whole model's keys in float64 at 8K tokens were 1.5 GB more of the peak)."""
    outs = []
    kvh = keys.shape[1]
    for s, q in enumerate(queries):
        n = prompt_len + s + 1
        out = torch.empty(q.shape, dtype=torch.float64)
        for layer in range(q.shape[0]):
            k, v = keys[layer, :, :n].double(), values[layer, :, :n].double()  # [kvh, n, D]
            qg = q[layer].double().view(kvh, -1, q.shape[-1])  # [kvh, g, D]
            weights = torch.softmax(torch.einsum("hgd,hnd->hgn", qg, k) * scale, dim=-1)
            out[layer] = torch.einsum("hgn,hnd->hgd", weights, v).reshape(q.shape[1:])
        outs.append(out)
    return outs


def relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error over every query head."""
    return ((x.double().flatten() - ref.flatten()).norm() / ref.norm()).item()


class GuardProbe:
    """Wraps the decoder's ``guard_layer``: the shipped call decides and is returned as
    is; a second call with no threshold (no fallback, no rest left out) keeps the
    sampled estimate the bound was computed for, and the exact part it started from.

    Both calls are the shipped function; the second only reads pages (heavy ones again).
    """

    def __init__(self) -> None:
        self.original = decode_module.guard_layer
        self.last: dict | None = None

    def __enter__(self) -> "GuardProbe":
        decode_module.guard_layer = self._wrapped
        return self

    def __exit__(self, *exc) -> None:
        decode_module.guard_layer = self.original

    def _wrapped(self, lse, out, outside, sampled, valid, in_sample, inclusion, thresholds, read_exactly):
        unlimited = torch.full_like(thresholds, float("inf"))
        free = self.original(lse, out, outside, sampled, valid, in_sample, inclusion, unlimited, read_exactly)
        outcome = self.original(lse, out, outside, sampled, valid, in_sample, inclusion, thresholds, read_exactly)
        self.last = {"part1": out.clone(), "free": free, "in_sample": in_sample, "valid": valid}
        return outcome


COUNTERS = ("pages_attended", "pages_dense", "pages_sampled", "pages_guard_read", "pages_estimated",
            "guard_checks", "guard_reads", "guard_full_reads")  # fmt: skip


def replay(prompt: dict, budget: float, tau: float, scale: float, probe: GuardProbe) -> tuple[list[dict], dict]:
    """One prompt's decode steps through a fresh decoder: a row per guarded layer-step
    (or, guard off, per layer-step), and the decoder's counters over the hot-set steps."""
    queries, keys, values, exact = prompt["queries"], prompt["keys"], prompt["values"], prompt["exact"]
    num_layers, kvh, total, dim = keys.shape
    prompt_len = prompt["prompt_len"]
    pool_pages = 1 + -(-total // PAGE)
    k_buf = torch.zeros(num_layers, pool_pages * PAGE, kvh, dim)
    v_buf = torch.zeros_like(k_buf)
    ranges = KeyRanges(num_layers, kvh, dim, capacity_pages=pool_pages)
    params = HotSetParams(policy="importance", budget=budget, guard_threshold=tau)
    decoder = HotSetDecoder(params, ranges, pool_pages=pool_pages, page_size=PAGE, threshold=0)

    def write(first: int, last: int) -> None:  # tokens [first, last) at slots PAGE + t
        slots = torch.arange(PAGE + first, PAGE + last)
        for layer in range(num_layers):
            k = keys[layer, :, first:last].transpose(0, 1)  # [n, kvh, D]
            k_buf[layer, slots] = k
            v_buf[layer, slots] = values[layer, :, first:last].transpose(0, 1)

    write(0, prompt_len)
    rows: list[dict] = []
    counts = dict.fromkeys(COUNTERS, 0)
    for s, q in enumerate(queries):
        length = prompt_len + s + 1
        write(length - 1, length)
        num_pages = -(-length // PAGE)
        decoder.begin_step([prompt["rid"]], [torch.arange(PAGE, PAGE + length)])
        for layer in range(num_layers):
            decoder.last_guard, probe.last = None, None
            result = decoder.attend(layer, q[layer][None], k_buf[layer], v_buf[layer], sm_scale=scale)
            error = relative(result.output[0], exact[s][layer])
            if tau >= 1.0:
                if s > 0:
                    rows.append({"step": s, "layer": layer, "error": error})
                continue
            outcome = decoder.last_guard
            if outcome is None:
                continue
            free = probe.last["free"]
            in_sample = probe.last["in_sample"][0]
            rest = int(probe.last["valid"][0].sum())
            heavy = int(free.read[0].sum())
            fallback = bool(outcome.fallback[0])
            bound = float(outcome.combined.relative[0])
            free_bound = float(free.combined.relative[0])
            read = int(outcome.read[0].sum())
            sampled = int((outcome.estimated[0] & in_sample).sum())
            estimated = int(outcome.estimated[0].sum())
            rows.append(
                {
                    "step": s,
                    "layer": layer,
                    "pages": num_pages,
                    "rest": rest,
                    "sample": int((in_sample & probe.last["valid"][0]).sum()),
                    "estimated": estimated,
                    "heavy": heavy,
                    "fallback": fallback,
                    # The rest left out under the deterministic bound (its upper mass is negligible).
                    "light": bool(outcome.negligible[0]),
                    "bound": bound,
                    "error": error,
                    "free_bound": free_bound,
                    "free_error": relative(free.combined.output[0], exact[s][layer]),
                    "part1_error": relative(probe.last["part1"][0], exact[s][layer]),
                    "read_pages": num_pages - rest + read + sampled,
                }
            )
        step = decoder.end_step().counts
        if s > 0:
            for name in COUNTERS:
                counts[name] += getattr(step, name)
    return rows, counts


def read_of(row: dict) -> int:
    """Rest pages the guard read exactly in a layer-step (every rest page not estimated)."""
    return row["rest"] - row["estimated"]


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return float(torch.tensor(xs, dtype=torch.float64).quantile(q))


def summarise(rows: list[dict], counts: dict | None, alone: list[dict]) -> dict:
    """One (length, budget, threshold) cell."""
    n = len(rows)
    certified = [r for r in rows if not r["fallback"]]
    fallbacks = [r for r in rows if r["fallback"]]
    finite = [r for r in rows if math.isfinite(r["free_bound"])]
    violations = [r for r in certified if r["error"] > r["bound"] + SLACK]
    # Certified on the sample's statistical bound (not the deterministic one, not read whole).
    by_sample = [r for r in certified if not r["light"] and r["estimated"] > 0]
    free_violations = [r for r in finite if r["free_error"] > r["free_bound"] + SLACK]
    share = lambda part: len(part) / n if n else float("nan")  # noqa: E731
    return {
        "layer_steps": n,
        # Rest pages the guard read: heavy ones, the heaviest quarters of its rounds, a fallback's.
        "clean": share([r for r in certified if read_of(r) == 0 and not r["light"]]),
        "heavy": share([r for r in rows if r["heavy"] > 0]),
        "rounds": share([r for r in certified if read_of(r) > r["heavy"] and not r["light"]]),
        "light": share([r for r in certified if r["light"]]),
        "fallback": share(fallbacks),
        "error_median": quantile([r["error"] for r in certified], 0.5),
        "error_max": max([r["error"] for r in certified], default=float("nan")),
        "bound_median": quantile([r["bound"] for r in certified], 0.5),
        "bound_p90": quantile([r["bound"] for r in certified], 0.9),
        "violations": len(violations),
        "violation_rate": len(violations) / len(certified) if certified else float("nan"),
        "violation_tasks": sorted({r["task"] for r in violations}),
        "by_sample": len(by_sample),
        "by_sample_violations": sum(r["error"] > r["bound"] + SLACK for r in by_sample),
        "sample_median": quantile([r["sample"] for r in rows], 0.5),
        "rest_median": quantile([r["rest"] for r in rows], 0.5),
        "free_checks": len(finite),
        "free_violations": len(free_violations),
        "free_error_median": quantile([r["free_error"] for r in rows], 0.5),
        "fallback_free_error_median": quantile([r["free_error"] for r in fallbacks], 0.5),
        "fallback_free_bound_median": quantile([r["free_bound"] for r in fallbacks], 0.5),
        "fallback_uncovered": sum(not math.isfinite(r["free_bound"]) for r in fallbacks),
        "part1_error_median": quantile([r["part1_error"] for r in rows], 0.5),
        "alone_error_median": quantile([r["error"] for r in alone], 0.5),
        # Pages read exactly (planned, sampled, heavy, fallback) over dense's, from the rows; the
        # decoder's own counters (pages_attended / pages_dense) where the run kept them.
        "read_share": sum(r["read_pages"] for r in rows) / max(1, sum(r["pages"] for r in rows)),
        "read_share_counters": counts["pages_attended"] / counts["pages_dense"] if counts else None,
        "counts": counts,
        "fallback_by_task": {
            t: sum(r["fallback"] for r in rows if r["task"] == t) / max(1, sum(r["task"] == t for r in rows))
            for t in sorted({r["task"] for r in rows})
        },
    }


def state_table() -> str:
    """The guard's device state per token, layer and KV head, against the KV."""
    lines = [
        "| shape | guard bytes / token / layer / KV head | KV fp32 | share | KV bf16 | share |",
        "|---|---|---|---|---|---|",
    ]
    for name, dim in (("SmolLM2-135M (D 64, page 16)", 64), ("Llama-3.1-8B (D 128, page 16)", 128)):
        g = bytes_per_token(dim, PAGE)
        f32, bf16 = kv_bytes_per_token(dim, 4), kv_bytes_per_token(dim, 2)
        lines.append(f"| {name} | {g:g} | {f32} | {g / f32:.1%} | {bf16} | {g / bf16:.1%} |")
    return "\n".join(lines)


def pct(x: float) -> str:
    return f"{x:.1%}" if math.isfinite(x) else "–"


def num(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "–"


def main_table(cells: list[dict], tau: float) -> str:
    head = (
        "| length | budget | layer-steps | certified, nothing more read | heavy pages read | certified after "
        "reading the heaviest quarter(s) | rest left out (negligible) | fallback | error where certified "
        "(median / max) | bound where certified (median / p90) | violations (certified) | pages read / dense "
        "| error, guard off (median) |"
    )
    lines = [head, "|" + "---|" * 13]
    for c in cells:
        if c["tau"] != tau:
            continue
        lines.append(
            f"| {c['length']} | {c['budget']:.0%} | {c['layer_steps']} | {pct(c['clean'])} | {pct(c['heavy'])} | "
            f"{pct(c['rounds'])} | {pct(c['light'])} | {pct(c['fallback'])} | "
            f"{num(c['error_median'])} / {num(c['error_max'])} | "
            f"{num(c['bound_median'], 3)} / {num(c['bound_p90'], 3)} | "
            f"{c['violations']} ({pct(c['violation_rate'])}) | {pct(c['read_share'])} | "
            f"{num(c['alone_error_median'], 3)} |"
        )
    return "\n".join(lines)


def fallback_table(cells: list[dict], tau: float) -> str:
    """The sampled estimate before any fallback: its error and bound, its violations."""
    head = (
        "| length | budget | sampled / rest pages (median) | sampled estimates with a finite bound | its violations "
        "| its error (median) | fallbacks: estimate's error / bound (median) | fallbacks where the sample could "
        "not vouch (too few pages) | planned pages alone, guarded plan (median error) |"
    )
    lines = [head, "|" + "---|" * 9]
    for c in cells:
        if c["tau"] != tau:
            continue
        rate = c["free_violations"] / c["free_checks"] if c["free_checks"] else float("nan")
        lines.append(
            f"| {c['length']} | {c['budget']:.0%} | {c['sample_median']:.0f} / {c['rest_median']:.0f} | "
            f"{c['free_checks']} | {c['free_violations']} ({pct(rate)}) | {num(c['free_error_median'])} | "
            f"{num(c['fallback_free_error_median'])} / {num(c['fallback_free_bound_median'], 3)} | "
            f"{c['fallback_uncovered']} | {num(c['part1_error_median'], 3)} |"
        )
    return "\n".join(lines)


def how_certified(row: dict) -> str:
    """Which look of the guard certified a layer-step (fallbacks are not certified)."""
    if row["light"]:
        return "rest left out as negligible (deterministic bound)"
    if read_of(row) > row["heavy"]:
        return "after reading the heaviest quarter(s) of the rest"
    return "heavy pages read, then the sample" if row["heavy"] else "nothing read: the sample at once"


def certified_table(rows: list[dict]) -> str:
    """Violations by the look that certified (the guard tests its bound up to four times)."""
    lines = ["| certified | layer-steps | violations | exact error / bound (median) |", "|---|---|---|---|"]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if not r["fallback"]:
            groups.setdefault(how_certified(r), []).append(r)
    for name, got in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        bad = sum(r["error"] > r["bound"] + SLACK for r in got)
        ratio = [r["error"] / r["bound"] if r["bound"] > 0 else float("inf") for r in got]
        lines.append(f"| {name} | {len(got)} | {bad} ({bad / len(got):.1%}) | {quantile(ratio, 0.5):.2f} |")
    return "\n".join(lines)


SAMPLE_BINS = ((0, 2), (3, 3), (4, 7), (8, 15), (16, 10**9))


def sample_table(rows: list[dict]) -> str:
    """The sampled estimate's bound against its exact error, by how many rest pages were
    sampled, and how the violations gather in requests (a request's draw serves every
    layer and step)."""
    finite = [r for r in rows if math.isfinite(r["free_bound"])]
    lines = [
        "| sampled rest pages | layer-steps | violations | exact error / bound (median) | requests | "
        "requests violating in > half their layer-steps |",
        "|---|---|---|---|---|---|",
    ]
    for lo, hi in SAMPLE_BINS:
        got = [r for r in finite if lo <= r["sample"] <= hi]
        if not got:
            continue
        bad = [r["free_error"] > r["free_bound"] + SLACK for r in got]
        ratio = [r["free_error"] / r["free_bound"] if r["free_bound"] > 0 else float("inf") for r in got]
        per_request: dict[tuple, list[bool]] = {}
        for r, b in zip(got, bad):
            per_request.setdefault((r["task"], r["trial"], r["length"], r["budget"]), []).append(b)
        worst = sum(sum(v) > len(v) / 2 for v in per_request.values())
        label = (f"{lo}-{hi}" if hi > lo else str(lo)) if hi < 10**9 else f"≥ {lo}"
        lines.append(
            f"| {label} | {len(got)} | {sum(bad)} ({sum(bad) / len(got):.1%}) | {quantile(ratio, 0.5):.2f} | "
            f"{len(per_request)} | {worst} |"
        )
    return "\n".join(lines)


def threshold_table(cells: list[dict], thresholds: list[float]) -> str:
    head = "| length | budget | " + " | ".join(
        f"τ = {t:g}: certified clean / heavy / fallback / violations / read" for t in thresholds
    )
    lines = [head + " |", "|" + "---|" * (2 + len(thresholds))]
    keys = sorted({(c["length"], c["budget"]) for c in cells})
    by = {(c["length"], c["budget"], c["tau"]): c for c in cells}
    for length, budget in keys:
        parts = []
        for t in thresholds:
            c = by.get((length, budget, t))
            parts.append(
                "–"
                if c is None
                else f"{pct(c['clean'])} / {pct(c['heavy'])} / {pct(c['fallback'])} / {c['violations']} / "
                f"{pct(c['read_share'])}"
            )
        lines.append(f"| {length} | {budget:.0%} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8000")
    p.add_argument("--budgets", default="0.1,0.2,0.3")
    p.add_argument("--tasks", default="needle,kv,adversarial")
    p.add_argument("--n", type=int, default=2, help="prompts per task and length")
    p.add_argument("--steps", type=int, default=6, help="decode steps per prompt (the first is dense)")
    p.add_argument("--thresholds", default="0.05,0.1,0.2")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_bound"))
    p.add_argument("--report", action="store_true", help="rewrite the report from --out's layer_steps.jsonl")
    p.add_argument("--resume", action="store_true", help="keep the journal's finished prompts, run the others")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    thresholds = [float(t) for t in a.thresholds.split(",")]
    journal_path, run_path = a.out / "layer_steps.jsonl", a.out / "run.json"
    run = json.loads(run_path.read_text()) if run_path.exists() and (a.report or a.resume) else {}
    if a.report:
        rows, _ = load_journal(journal_path)
        argv = run.get("argv", sys.argv[1:])
        described = p.parse_args(argv)  # the run's prompts and steps, for the text
        described.out = a.out
        report(rows, {}, thresholds, described, run.get("minutes", float("nan")), argv)
        return
    tokenizer, model, capture, scale = load_captured_model()
    budgets = [float(b) for b in a.budgets.split(",")]
    started = time.time()
    rows, done = load_journal(journal_path) if a.resume and journal_path.exists() else ({}, set())
    counts: dict[tuple, dict] = {}
    # A resumed journal keeps its finished prompts only, rewritten beside it and renamed
    # over it whole (a kill mid-rewrite must not cut what the earlier runs found).
    fresh = journal_path.with_suffix(".tmp")
    with fresh.open("w") as out:
        for got in rows.values():
            for r in got:
                out.write(json.dumps(r) + "\n")
        for rid in sorted(done):
            out.write(json.dumps({"done": rid}) + "\n")
    os.replace(fresh, journal_path)
    journal = journal_path.open("a")
    with GuardProbe() as probe:
        for length in (int(x) for x in a.lengths.split(",")):
            for task in a.tasks.split(","):
                for trial in make_trials(tokenizer, task, [length], a.n, 0):
                    if f"{task}-{length}-{trial['trial']}" in done:
                        continue
                    t0 = time.time()
                    queries, keys, values = capture.decode(model, trial["ids"], a.steps)
                    prompt_len = len(trial["ids"])
                    prompt = {
                        "rid": f"{task}-{length}-{trial['trial']}",
                        "prompt_len": prompt_len,
                        "queries": queries,
                        "keys": keys,
                        "values": values,
                        "exact": exact_outputs(queries, keys, values, prompt_len, scale),
                    }
                    t1 = time.time()
                    for budget in budgets:
                        for tau in thresholds + [1.0]:
                            got, c = replay(prompt, budget, tau, scale, probe)
                            key = (length, budget, tau)
                            for r in got:
                                r.update(task=task, trial=trial["trial"], length=length, budget=budget, tau=tau)
                                journal.write(json.dumps(r) + "\n")
                            rows.setdefault(key, []).extend(got)
                            acc = counts.setdefault(key, dict.fromkeys(COUNTERS, 0))
                            for name in COUNTERS:
                                acc[name] += c[name]
                    journal.write(json.dumps({"done": prompt["rid"]}) + "\n")  # the prompt's rows are whole
                    journal.flush()
                    took = f"capture {t1 - t0:.0f} s, replays {time.time() - t1:.0f} s"
                    print(f"{prompt['rid']}: {prompt_len} tokens, {took}", flush=True)
                    del prompt, queries, keys, values  # not beside the next prompt's prefill
    journal.close()
    # A resumed run's time adds to the time its journal took before.
    minutes = run.get("minutes", 0.0) + (time.time() - started) / 60
    argv = [x for x in sys.argv[1:] if x != "--resume"]
    run_path.write_text(json.dumps({"minutes": minutes, "argv": argv}))
    report(rows, {} if done else counts, thresholds, a, minutes, argv)


def load_journal(path: Path) -> tuple[dict, set]:
    """The journal's rows by (length, budget, threshold), and its finished prompts. Where
    it marks finished prompts, rows of an unfinished one (a run killed mid-prompt) are
    left out."""
    rows: dict[tuple, list[dict]] = {}
    done: set[str] = set()
    records = [json.loads(line) for line in path.open()]
    done = {r["done"] for r in records if "done" in r}
    for r in records:
        if "done" in r or (done and f"{r['task']}-{r['length']}-{r['trial']}" not in done):
            continue
        rows.setdefault((r["length"], r["budget"], r["tau"]), []).append(r)
    return rows, done


def report(rows: dict, counts: dict, thresholds: list[float], a, minutes: float, argv: list[str]) -> None:
    cells = []
    for (length, budget, tau), got in sorted(rows.items()):
        if tau >= 1.0:
            continue
        cell = summarise(got, counts.get((length, budget, tau)), rows.get((length, budget, 1.0), []))
        cell.update(length=length, budget=budget, tau=tau)
        cells.append(cell)
    write(cells, thresholds, a, minutes, rows, argv)


def write(cells: list[dict], thresholds: list[float], a, minutes: float, rows: dict, argv: list[str]) -> None:
    tau = GUARD_DEFAULT if GUARD_DEFAULT in thresholds else thresholds[len(thresholds) // 2]
    main_cells = [c for c in cells if c["tau"] == tau]
    total = sum(c["layer_steps"] for c in main_cells)
    certified = sum(c["layer_steps"] * (1 - c["fallback"]) for c in main_cells)
    violations = sum(c["violations"] for c in main_cells)
    by_sample = sum(c["by_sample"] for c in main_cells)
    by_sample_violations = sum(c["by_sample_violations"] for c in main_cells)
    command = "OMP_NUM_THREADS=1 python -m benchmark.long_context.bench_bound " + " ".join(shlex.quote(x) for x in argv)
    summary = (
        f"At τ = {tau:g}: {total} guarded layer-steps, {certified:.0f} certified, {violations} violations "
        f"({violations / max(1, certified):.2%} of certified; DELTA = {DELTA:g}); of those certified on the "
        f"sample's bound (not read whole, not left out as negligible) {by_sample_violations} of {by_sample} "
        f"({by_sample_violations / max(1, by_sample):.2%}). A violation: exact error > bound + {SLACK:g}."
    )
    text = (
        f"Command (took {minutes:.0f} min, one OpenMP thread, 2-core dev VM, no GPU; the model in float32 "
        "through transformers, offline):\n\n"
        f"```\n{command.strip()}\n```\n\n"
        f"{a.n} prompts of each of {a.tasks} per length, {a.steps} greedy decode steps each (the first the "
        "dense warm-up, not counted), replayed through the shipped `HotSetDecoder` (policy importance, page 16); "
        "one check per guarded layer of each hot-set step. Errors: relative L2 error of the layer's attention "
        f"output over all query heads against float64 attention over every token. τ = {tau:g} (the default):\n\n"
        + main_table(cells, tau)
        + "\n\n"
        + summary
        + f"\n\nViolations by the look that certified (τ = {tau:g}, every length and budget):\n\n"
        + certified_table(rows_at(rows, tau))
        + "\n\nThe sampled estimate before any fallback or rest left out (the guard called again with no "
        "threshold), over every guarded layer-step:\n\n"
        + fallback_table(cells, tau)
        + "\n\nThe sampled estimate's bound by the number of rest pages sampled (every guarded layer-step at "
        f"τ = {tau:g}; each request draws its sample once, so a draw serves all its layers and steps):\n\n"
        + sample_table(rows_at(rows, tau))
        + "\n\nEvery threshold (certified with nothing more read / heavy pages read / fallback / violations / "
        "pages read as a share of dense):\n\n"
        + threshold_table(cells, thresholds)
        + "\n\nThe guard's device state (`key_codes.bytes_per_token`) against the KV:\n\n"
        + state_table()
        + "\n"
    )
    (a.out / "RESULTS_bound.md").write_text(text)
    (a.out / "bound.json").write_text(json.dumps(cells, indent=1))
    print(text)
    plot(rows, cells, tau, a.out / "bound_sampled.png")


def rows_at(rows: dict, tau: float) -> list[dict]:
    return [r for (_, _, t), got in sorted(rows.items()) if t == tau for r in got]


def plot(rows: dict, cells: list[dict], tau: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    floor = 1e-6
    colours = {}
    first = min((k[0], k[1]) for k in rows if k[2] == tau)
    for (length, budget, t), got in sorted(rows.items()):
        if t != tau:
            continue
        colour = colours.setdefault(length, f"C{len(colours)}")
        cert = [r for r in got if not r["fallback"] and r["bound"] > 0]
        left.scatter(
            [r["bound"] for r in cert], [max(r["error"], floor) for r in cert], s=4, alpha=0.35, color=colour,
            label=f"{length} tokens" if budget == min(b for (_, b, tt) in rows if tt == tau) else None,
        )  # fmt: skip
        fb = [r for r in got if r["fallback"] and math.isfinite(r["free_bound"])]
        left.scatter(
            [r["free_bound"] for r in fb], [max(r["free_error"], floor) for r in fb], s=4, alpha=0.35, color="0.6",
            marker="x", label="fallback: the estimate it refused" if (length, budget) == first else None,
        )  # fmt: skip
    line = [1e-4, 10.0]  # refused estimates' bounds run to 1e3; the axes stop at 10
    left.plot(line, line, color="k", lw=1, label="error = bound")
    left.set_xlim(*line)
    left.set_ylim(floor, 10.0)
    left.axvline(tau, color="r", lw=0.8, ls="--", label=f"τ = {tau:g}")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("bound (relative L2)")
    left.set_ylabel("exact relative L2 error")
    left.set_title("each guarded layer-step")
    left.legend(fontsize=7, markerscale=3)
    for length in sorted({c["length"] for c in cells}):
        pts = sorted(
            (c["budget"], c["fallback"], c["clean"]) for c in cells if c["length"] == length and c["tau"] == tau
        )
        colour = colours.get(length, None)
        right.plot([x[0] for x in pts], [x[1] for x in pts], marker="o", color=colour, label=f"{length}: fallback")
        right.plot([x[0] for x in pts], [x[2] for x in pts], marker="s", ls="--", color=colour,
                   label=f"{length}: certified, nothing more read")  # fmt: skip
    right.set_xlabel("hot-set budget (share of pages)")
    right.set_ylabel(f"share of guarded layer-steps (τ = {tau:g})")
    right.set_ylim(0, 1.02)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
