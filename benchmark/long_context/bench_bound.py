"""The selection's bound, measured through the shipped decoder over many request seeds.

Offline, on the embedded model (transformers, float32, CPU), for prompts of
``bench_hot_set.py`` (needle, key-value, adversarial): the model prefills, then decodes
greedily while forward hooks on every attention layer keep its post-RoPE queries, keys
and values (``Capture``). Each decode step is then replayed through the shipped
``hot_set.HotSetDecoder`` (policy ``importance``, page 16, every request long, every page
on the device), as an attention backend drives it: per-layer KV buffers in SGLang's pool
layout, ``begin_step``, ``attend`` for every layer, ``end_step``. The first step is the
dense warm-up and is not counted.

A prompt is replayed once per *request seed* (``--seeds``: rids ``<prompt>#<seed>``, whose
hash seeds the page sample, ``sample.request_seed``), so the statistical bound's failure
rate is measured over seeds, as the contract states it. After each guarded ``attend``,
``decoder.last_guard`` holds what the layer did (``guard.GuardOutcome``): the pages its
top-p selection read (at most its cap), the read pages alone with the deterministic bound,
the sampled estimate with the statistical bound, and the output it kept (the smaller
bound). Each is compared with float64 attention over every token.

Per length and read cap it reports: layer-steps, flagged (bound over ``--threshold``); for
each bound (deterministic, statistical, the one the layer kept) its violations **of the
layer-steps where it was finite** (an infinite bound cannot be exceeded; the finite share is
printed beside every count, and the share at most ``--threshold``, the layer-steps it
certified); **deterministic violations** must be 0; the statistical bound's exceedance with a
95 % interval over seeds (a seed's layer-steps share its draw); error / bound quantiles (a
bound 4x loose reads too much); the output's error quantiles; pages read exactly per
layer-step (part 1, the selection, the sample) and the bytes per step as a share of dense's
KV bytes, bf16 (part 1 + selection + sample pages + every rest page's key codes), with the
Llama-3.1-8B arithmetic beside it.

    python -m benchmark.long_context.bench_bound --out /tmp/bench_bound
    python -m benchmark.long_context.bench_bound --n 1 --lengths 2048 --steps 3 --seeds 4 --out /tmp/bb  # smoke

layer_steps.jsonl (one row per guarded layer-step and seed), RESULTS_bound.md, bound.json and
bound.png go to ``--out``; ``--report [DIR ...]`` writes them from runs' journals instead (a run
killed part way reports the prompts it finished). An 8K prompt's prefill through transformers
peaks near 8 GB.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmark.long_context.bench_hot_set import GUARD_DEFAULT, PAGE, make_trials
from sgl_importance.hot_set import HotSetDecoder, HotSetParams, KeyRanges
from sgl_importance.hot_set.guard.estimate import DELTA
from sgl_importance.hot_set.guard.key_codes import bytes_per_token, kv_bytes_per_token
from sgl_importance.local_server import model_path

torch.set_grad_enabled(False)

# An exact error within this much of the bound is float32 rounding, not a violation.
SLACK = 1e-5
LLAMA_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128}


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


def replay(prompt: dict, seed: int, cap: float, top_p: float, tau: float, scale: float) -> list[dict]:
    """One prompt's decode steps through a fresh decoder under request seed ``seed``: a row
    per guarded layer-step."""
    queries, keys, values, exact = prompt["queries"], prompt["keys"], prompt["values"], prompt["exact"]
    num_layers, kvh, total, dim = keys.shape
    prompt_len = prompt["prompt_len"]
    pool_pages = 1 + -(-total // PAGE)
    k_buf = torch.zeros(num_layers, pool_pages * PAGE, kvh, dim)
    v_buf = torch.zeros_like(k_buf)
    slots_all = torch.arange(PAGE, PAGE + total)
    k_buf[:, slots_all] = keys.transpose(1, 2)  # every token's K and V at once: a step reads only its prefix
    v_buf[:, slots_all] = values.transpose(1, 2)
    ranges = KeyRanges(num_layers, kvh, dim, capacity_pages=pool_pages)
    params = HotSetParams(policy="importance", budget=cap, guard_threshold=tau, read_cap=cap, top_p=top_p)
    decoder = HotSetDecoder(params, ranges, pool_pages=pool_pages, page_size=PAGE, threshold=0)
    rid = f"{prompt['rid']}#{seed}"
    rows: list[dict] = []
    for s, q in enumerate(queries):
        length = prompt_len + s + 1
        num_pages = -(-length // PAGE)
        decoder.begin_step([rid], [slots_all[:length]])
        for layer in range(num_layers):
            decoder.last_guard = None
            result = decoder.attend(layer, q[layer][None], k_buf[layer], v_buf[layer], sm_scale=scale)
            outcome = decoder.last_guard
            if outcome is None:
                continue
            truth = exact[s][layer]
            det, stat = outcome.deterministic, outcome.statistical
            rest = int(outcome.estimated[0].sum() + outcome.read[0].sum())
            rows.append({
                "seed": seed, "step": s, "layer": layer, "pages": num_pages, "rest": rest,
                "read": int(outcome.read[0].sum()), "wanted": int(outcome.wanted[0].sum()),
                # Sampled pages are read each on its own, every layer.
                "sampled": int(prompt_sampled(decoder).sum()),
                "flagged": bool(outcome.flagged[0]),
                "error": relative(result.output[0], truth), "bound": float(outcome.combined.relative[0]),
                "det_error": relative(det.output[0], truth), "det_bound": float(det.relative[0]),
                "stat_error": relative(stat.output[0], truth), "stat_bound": float(stat.relative[0]),
            })  # fmt: skip
        decoder.end_step()
    return rows


def prompt_sampled(decoder: HotSetDecoder) -> torch.Tensor:
    """The step's one guarded request's sampled rest columns (``[P]`` bool)."""
    lists = decoder._guard_lists
    return lists.outside.sampled[0] & lists.outside.valid[0]


def quantile(xs: list[float], q: float) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return float(torch.tensor(xs, dtype=torch.float64).quantile(q)) if xs else float("nan")


def bytes_share(read_pages: float, rest_pages: float, pages: float, head_dim: int, element: int) -> float:
    """Bytes a layer-step reads over dense's: the pages read exactly plus every rest page's key
    codes and its 16-bit key min/max (the codes' range)."""
    codes = (bytes_per_token(head_dim, PAGE) + 2 * head_dim * 2 / PAGE) / kv_bytes_per_token(head_dim, element)
    return (read_pages + codes * rest_pages) / pages


def summarise(rows: list[dict], threshold: float) -> dict:
    """One (length, cap) cell over its prompts, layer-steps and seeds. A bound that is infinite
    cannot be exceeded, so every violation count is stated beside how many bounds were finite
    (the denominator that could fail) and how many were at most ``threshold`` (certified)."""
    n = len(rows)
    stat = [r for r in rows if math.isfinite(r["stat_bound"])]
    over = [r["stat_error"] > r["stat_bound"] + SLACK for r in stat]
    by_seed: dict[int, list[bool]] = {}
    for r, o in zip(stat, over):
        by_seed.setdefault(r["seed"], []).append(o)
    rates = torch.tensor([sum(v) / len(v) for v in by_seed.values()], dtype=torch.float64)
    half = 1.96 * float(rates.std()) / math.sqrt(len(rates)) if len(rates) > 1 else float("nan")
    mean = float(rates.mean()) if len(rates) else float("nan")
    read = sum(r["read"] + r["sampled"] + (r["pages"] - r["rest"]) for r in rows) / max(1, n)
    rest = sum(r["rest"] for r in rows) / max(1, n)
    pages = sum(r["pages"] for r in rows) / max(1, n)
    ratio = [r["error"] / r["bound"] for r in rows if r["bound"] > 0 and math.isfinite(r["bound"])]
    det = [r for r in rows if math.isfinite(r["det_bound"])]
    kept = [r for r in rows if math.isfinite(r["bound"])]
    return {
        "layer_steps": n, "seeds": len(by_seed),
        "flagged": sum(r["flagged"] for r in rows) / max(1, n),
        "det_violations": sum(r["det_error"] > r["det_bound"] + SLACK for r in det),
        "det_finite": len(det), "det_certified": sum(r["det_bound"] <= threshold for r in det),
        "stat_checks": len(stat), "stat_over": sum(over), "stat_rate": mean, "stat_ci": half,
        "stat_certified": sum(r["stat_bound"] <= threshold for r in stat),
        "kept_finite": len(kept), "kept_over": sum(r["error"] > r["bound"] + SLACK for r in kept),
        "certified": sum(r["bound"] <= threshold for r in kept),
        # Where both bounds are infinite the kept one "equals" B_det: not counted as kept.
        "kept_det": sum(r["bound"] == r["det_bound"] for r in det) / max(1, n),
        "error_p50": quantile([r["error"] for r in rows], 0.5), "error_p99": quantile([r["error"] for r in rows], 0.99),
        "ratio_p50": quantile(ratio, 0.5), "ratio_p90": quantile(ratio, 0.9),
        "bound_p50": quantile([r["bound"] for r in rows], 0.5),
        "read_share": read / max(1.0, pages),
        "wanted_share": sum(r["wanted"] for r in rows) / max(1, n) / max(1.0, pages),
        "bytes_bf16": bytes_share(read, rest, pages, 64, 2), "bytes_f32": bytes_share(read, rest, pages, 64, 4),
        "llama_bytes_bf16": bytes_share(read, rest, pages, LLAMA_8B["head_dim"], 2),
    }  # fmt: skip


def pct(x: float) -> str:
    return f"{x:.1%}" if math.isfinite(x) else "–"


def num(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "–"


def _checked(over: int, finite: int, certified: int, n: int) -> str:
    """A violation count with the denominator that could fail: ``over of finite (share of n);
    certified (share of n) at most the threshold``."""
    return f"{over:,} of {finite:,} finite ({pct(finite / max(1, n))}); {pct(certified / max(1, n))} ≤ τ"


def table(cells: dict) -> str:
    head = (
        "| length | read cap | layer-steps × seeds | flagged | deterministic bound: violations of finite; "
        "certified | statistical bound: exceedances of finite; certified | statistical exceedance (mean over "
        "seeds ± 95 %) | kept bound: violations of finite; certified | output error p50 / p99 | error / bound "
        "p50 / p90 | kept the deterministic bound | pages read / dense | bytes / dense, bf16 (f32) | "
        "Llama-3.1-8B bytes / dense, bf16 |"
    )
    lines = [head, "|" + "---|" * 14]
    for (length, cap), c in sorted(cells.items()):
        n = c["layer_steps"]
        lines.append(
            f"| {length} | {cap:.0%} | {n:,} ({c['seeds']} seeds) | {pct(c['flagged'])} | "
            f"{_checked(c['det_violations'], c['det_finite'], c['det_certified'], n)} | "
            f"{_checked(c['stat_over'], c['stat_checks'], c['stat_certified'], n)} | "
            f"{pct(c['stat_rate'])} ± {pct(c['stat_ci'])} | "
            f"{_checked(c['kept_over'], c['kept_finite'], c['certified'], n)} | "
            f"{num(c['error_p50'])} / {num(c['error_p99'])} | "
            f"{num(c['ratio_p50'], 2)} / {num(c['ratio_p90'], 2)} | {pct(c['kept_det'])} | {pct(c['read_share'])} | "
            f"{num(c['bytes_bf16'])} ({num(c['bytes_f32'])}) | {num(c['llama_bytes_bf16'])} |"
        )
    return "\n".join(lines)


def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for cap in sorted({k[1] for k in cells}):
        got = sorted((k[0], c) for k, c in cells.items() if k[1] == cap)
        ax.plot([g[0] for g in got], [g[1]["flagged"] for g in got], marker="o", label=f"flagged, cap {cap:.0%}")
        ax.plot([g[0] for g in got], [g[1]["bytes_bf16"] for g in got], marker="s", ls="--",
                label=f"bytes / dense (bf16), cap {cap:.0%}")  # fmt: skip
    ax.set_xlabel("prompt tokens")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8000")
    p.add_argument("--caps", default="0.2", help="read caps (--hot-set-read-cap) to replay")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--threshold", type=float, default=GUARD_DEFAULT)
    p.add_argument("--tasks", default="needle,kv,adversarial")
    p.add_argument("--n", type=int, default=1, help="prompts per task and length")
    p.add_argument("--steps", type=int, default=3, help="decode steps per prompt (the first is dense)")
    p.add_argument("--seeds", type=int, default=200, help="request seeds each prompt is replayed under")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_bound"))
    p.add_argument("--report", nargs="*", type=Path, metavar="DIR",
                   help="no run: the tables from these runs' journals (default --out), prompts finished")  # fmt: skip
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.report is not None:
        report(a, a.report or [a.out])
        return
    tokenizer, model, capture, scale = load_captured_model()
    caps = [float(c) for c in a.caps.split(",")]
    started = time.time()
    cells_rows: dict[tuple, list[dict]] = {}
    with (a.out / "layer_steps.jsonl").open("w") as journal:
        for length in (int(x) for x in a.lengths.split(",")):
            for task in a.tasks.split(","):
                for trial in make_trials(tokenizer, task, [length], a.n, 0):
                    t0 = time.time()
                    queries, keys, values = capture.decode(model, trial["ids"], a.steps)
                    prompt_len = len(trial["ids"])
                    prompt = {"rid": f"{task}-{length}-{trial['trial']}", "prompt_len": prompt_len,
                              "queries": queries, "keys": keys, "values": values,
                              "exact": exact_outputs(queries, keys, values, prompt_len, scale)}  # fmt: skip
                    for cap in caps:
                        for seed in range(a.seeds):
                            for r in replay(prompt, seed, cap, a.top_p, a.threshold, scale):
                                r.update(task=task, length=length, cap=cap)
                                journal.write(json.dumps(r) + "\n")
                                cells_rows.setdefault((length, cap), []).append(r)
                    journal.flush()
                    print(f"{prompt['rid']}: {prompt_len} tokens, {time.time() - t0:.0f} s", flush=True)
                    del prompt, queries, keys, values
    write_tables(a, cells_rows, f"{(time.time() - started) / 60:.1f} min")


def report(a: argparse.Namespace, runs: list[Path]) -> None:
    """The tables from runs' journals (a run killed part way: the prompts it finished)."""
    cells_rows: dict[tuple, list[dict]] = {}
    for run in runs:
        prompts: dict[tuple, list[dict]] = {}
        for line in (run / "layer_steps.jsonl").read_text().splitlines():
            r = json.loads(line)
            prompts.setdefault((r["task"], r["length"], r["cap"]), []).append(r)
        seeds = {key: len({r["seed"] for r in rows}) for key, rows in prompts.items()}
        for (task, length, cap), rows in prompts.items():
            done = seeds[task, length, cap] == max(seeds.values())  # the one a killed run was on: left out
            left = "" if done else ", left out"
            print(f"{run}: {task}-{length} at cap {cap}: {seeds[task, length, cap]} seeds{left}")
            if done:
                cells_rows.setdefault((length, cap), []).extend(rows)
    write_tables(a, cells_rows, "from the journals of " + ", ".join(map(str, runs)))


def write_tables(a: argparse.Namespace, cells_rows: dict[tuple, list[dict]], took: str) -> None:
    cells = {key: summarise(rows, a.threshold) for key, rows in cells_rows.items()}
    (a.out / "bound.json").write_text(json.dumps({f"{k[0]}@{k[1]}": c for k, c in cells.items()}, indent=1))
    plot(cells, a.out / "bound.png")
    text = (
        f"# The selection's bound (bench_bound.py)\n\nCommand: `python -m benchmark.long_context.bench_bound "
        f"{' '.join(sys.argv[1:])}` ({took}). Top-p {a.top_p}, threshold {a.threshold}, delta {DELTA}, "
        f"tasks {a.tasks}, {a.n} prompt(s) each, {a.steps} steps (the first dense).\n\n" + table(cells) + "\n"
    )
    (a.out / "RESULTS_bound.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
