"""Why the guard falls back: true attention outside the hot set vs what the bound can certify.

Offline, on the embedded model (transformers, float32, CPU), for needle prompts of
``bench_hot_set.py``: the model prefills, then decodes greedily while forward hooks
on every attention layer keep its post-RoPE queries and keys. Each decode step is
replayed through the shipped selection (``hot_set.RequestHotSet``, policy
``importance``, fed the masses the decoder would return: the first step dense, later
steps over the plan only) and, for every layer and query head of every hot-set step,
three numbers about the attention mass outside the plan are compared with the guard's
threshold:

- ``true``: the exact outside mass (what the guard would ideally test);
- ``box``: the guard's bound from the key min/max page summaries (``guard.outside_mass_bound``
  over ``summaries.key_bound``), what the server uses;
- ``oracle``: the same bound with each page's exact largest logit in place of its
  summary bound: the best any per-page logit bound can do.

It prints and writes (``--out``) a table: per length and budget the share of
(layer, head) checks at or under each ``--thresholds`` value for each of the three,
the median true outside mass, and the mean gap (nats) between a page's box bound
and its largest logit; plus bound_cdf.png (distribution of the three at 20 %).

    python benchmark/long_context/bench_bound.py --out /tmp/bench_bound
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hot_set import PAGE, make_trials, model_path  # noqa: E402

from sgl_importance.hot_set import HotSetParams, RequestHotSet, key_bound, outside_mass_bound  # noqa: E402


class Capture:
    """Forward hooks that keep each layer's post-RoPE queries and keys."""

    def __init__(self, model) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb
        self.q: list[torch.Tensor] = []  # per layer: the latest call's queries [heads, T, D]
        self.k: list[list[torch.Tensor]] = [[] for _ in model.model.layers]  # per layer: key chunks
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_hook(self._hook(i), with_kwargs=True)

    def _hook(self, index: int):
        def hook(attn, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            shape = (*hidden.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(hidden).view(shape).transpose(1, 2)
            k = attn.k_proj(hidden).view(shape).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            if index == 0:
                self.q = []
            self.q.append(q[0].detach())
            self.k[index].append(k[0].detach())

        return hook

    def keys(self) -> torch.Tensor:
        return torch.stack([torch.cat(chunks, dim=1) for chunks in self.k])  # [L, kvh, T, D]


def decode_and_capture(model, capture: Capture, ids: list[int], steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Greedy decode; returns each decode step's queries [L, q_heads, D] and all keys."""
    queries = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        past, token = out.past_key_values, out.logits[0, -1].argmax()
        for _ in range(steps):
            out = model(token.view(1, 1), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[0, -1].argmax()
            queries.append(torch.stack([q[:, -1] for q in capture.q]))
    return queries, capture.keys()


def page_view(keys: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, kvh, P, PAGE, D] keys of the first ``length`` tokens (padded) and the page mask."""
    num_layers, kvh, _, dim = keys.shape
    pages = -(-length // PAGE)
    padded = torch.zeros(num_layers, kvh, pages * PAGE, dim, dtype=keys.dtype)
    padded[:, :, :length] = keys[:, :, :length]
    valid = (torch.arange(pages * PAGE) < length).view(pages, PAGE)
    return padded.view(num_layers, kvh, pages, PAGE, dim), valid


def study_step(q, keys, length, state: RequestHotSet, first: bool, scale: float):
    """One decode step: plan, exact masses, the three outside-mass numbers per (layer, head)."""
    num_layers, q_heads, dim = q.shape
    kp, valid = page_view(keys, length)
    kvh = kp.shape[1]
    pages = valid.shape[0]
    qg = q.double().view(num_layers, kvh, q_heads // kvh, dim)
    logits = torch.einsum("lhgd,lhptd->lhgpt", qg, kp.double()) * scale
    logits = logits.masked_fill(~valid, float("-inf"))
    page_lse = torch.logsumexp(logits, dim=-1)  # [L, kvh, g, P]
    page_max = logits.amax(dim=-1)
    plan, _ = state.plan(pages)
    attended = torch.zeros(pages, dtype=torch.bool)
    attended[plan] = True
    lse_all = torch.logsumexp(page_lse, dim=-1)
    lse_in = torch.logsumexp(page_lse[..., attended], dim=-1)
    tokens = valid.sum(1)
    kmin = torch.where(valid[None, None, :, :, None], kp, torch.tensor(float("inf"))).amin(3)
    kmax = torch.where(valid[None, None, :, :, None], kp, torch.tensor(float("-inf"))).amax(3)
    box = torch.stack([key_bound(q[layer], kmin[layer].transpose(0, 1), kmax[layer].transpose(0, 1),
                                 sm_scale=scale, compute_dtype=torch.float64)
                       for layer in range(num_layers)])  # fmt: skip  # [L, P, q_heads]
    out = ~attended
    flat = (num_layers, q_heads)
    result = None
    if not first and bool(out.any()):
        lse_in_h = lse_in.reshape(flat)
        true = 1.0 - torch.exp(lse_in - lse_all).reshape(flat)
        box_bound = torch.stack([outside_mass_bound(box[i][out], tokens[out], lse_in_h[i]) for i in range(num_layers)])
        oracle_b = page_max.reshape(num_layers, q_heads, pages).transpose(1, 2)
        oracle = torch.stack(
            [outside_mass_bound(oracle_b[i][out], tokens[out], lse_in_h[i]) for i in range(num_layers)]
        )
        gap = (box - oracle_b)[:, out].mean().item()
        result = (true.flatten(), box_bound.flatten(), oracle.flatten(), gap)
    # What the decoder returns: masses over the attended pages, reduced over heads and layers.
    lse_ref = lse_all if first else lse_in
    mass = torch.exp(page_lse - lse_ref[..., None]).mean(dim=(1, 2)).mean(0)  # [P]
    mass[~attended] = 0.0
    bound_mass = torch.exp(box + tokens.double().log()[None, :, None] - lse_ref.reshape(flat)[:, None, :])
    state.observe(attended, mass, bound_mass.amax(dim=(0, 2)).clamp(max=1.0))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8000")
    p.add_argument("--budgets", default="0.1,0.2,0.3")
    p.add_argument("--n", type=int, default=4, help="prompts per length")
    p.add_argument("--steps", type=int, default=8, help="decode steps per prompt")
    p.add_argument("--thresholds", default="0.1,0.3,0.5")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_bound"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    capture = Capture(model)
    scale = 1.0 / math.sqrt(model.config.head_dim)
    thresholds = [float(t) for t in a.thresholds.split(",")]
    budgets = [float(b) for b in a.budgets.split(",")]
    started = time.time()
    rows, samples = [], {}
    for length in (int(x) for x in a.lengths.split(",")):
        trials = make_trials(tokenizer, "needle", [length], a.n, 0)
        captured = []
        for trial in trials:
            capture.k = [[] for _ in capture.k]
            queries, keys = decode_and_capture(model, capture, trial["ids"], a.steps)
            captured.append((len(trial["ids"]), queries, keys))
        for budget in budgets:
            true, box, oracle, gaps = [], [], [], []
            for prompt_len, queries, keys in captured:
                state = RequestHotSet(HotSetParams(policy="importance", budget=budget, guard_threshold=1.0))
                for s, q in enumerate(queries):
                    r = study_step(q, keys, prompt_len + s + 1, state, s == 0, scale)
                    if r is not None:
                        true.append(r[0])
                        box.append(r[1])
                        oracle.append(r[2])
                        gaps.append(r[3])
            t, b, o = torch.cat(true), torch.cat(box), torch.cat(oracle)
            samples[(length, budget)] = (t, b, o)
            row = {"length": length, "budget": budget, "checks": t.numel(), "median_true": t.median().item(),
                   "gap": sum(gaps) / len(gaps)}  # fmt: skip
            for th in thresholds:
                row[th] = tuple((x <= th).double().mean().item() for x in (t, b, o))
            rows.append(row)
            print(row, flush=True)
    write(rows, thresholds, samples, a, (time.time() - started) / 60)


def write(rows, thresholds, samples, a, minutes: float) -> None:
    head = "| length | budget | checks | median true outside mass | box gap (nats) | " + " | ".join(
        f"≤ {t:g}: true / box / oracle" for t in thresholds
    )
    lines = [head + " |", "|" + "---|" * (5 + len(thresholds))]
    for r in rows:
        cells = [r["length"], f"{r['budget']:.0%}", r["checks"], f"{r['median_true']:.3f}", f"{r['gap']:.1f}"]
        cells += [" / ".join(f"{x:.0%}" for x in r[t]) for t in thresholds]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    table = "\n".join(lines)
    command = "python benchmark/long_context/bench_bound.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    text = (
        "# Guard: outside mass, its bound, and the best per-page bound (bench_bound.py)\n\n"
        f"Command (took {minutes:.0f} min):\n\n```\n{command.strip()}\n```\n\n"
        f"{a.n} needle prompts per length, {a.steps} greedy decode steps each (the first is the dense "
        "warm-up and is not counted), importance hot set, one check per layer and query head of "
        "each hot-set step. A cell gives the share of checks whose outside mass is at most the "
        "threshold: exactly (true), as the guard bounds it (box), and as the tightest per-page "
        "logit bound would (oracle).\n\n" + table + "\n"
    )
    (a.out / "RESULTS_bound.md").write_text(text)
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in samples if abs(k[1] - 0.2) < 1e-9] or list(samples)[:3]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for label, x in zip(("true", "box bound", "oracle bound"), samples[key]):
            xs = torch.sort(x).values
            ax.plot(xs.numpy(), torch.linspace(0, 1, xs.numel()).numpy(), label=label)
        ax.axvline(0.1, color="k", ls="--", lw=1)
        ax.set_title(f"{key[0]} tokens, budget {key[1]:.0%}")
        ax.set_xlabel("attention mass outside the hot set")
    axes[0][0].set_ylabel("share of (layer, head) checks")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out / "bound_cdf.png", dpi=120)


if __name__ == "__main__":
    main()
