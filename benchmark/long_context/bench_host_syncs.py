"""Host round trips of a hot-set decode step: the calls that would make a GPU wait, counted on a CPU.

Issue 34: a hot-set step that reads device data back to the host once per layer runs
at the host's pace on a GPU. This drives the plugin's real attention backends —
``importance_torch`` and ``importance_triton`` (its kernels under Triton's
interpreter) — through ``init_forward_metadata`` and every layer's
``forward_decode`` over fake SGLang pools (``test/support/hot_set_world.py``: a short
request beside two long ones), with the guard off and on and with pages released to a
host pool or not, under ``HostSyncCounter`` (``test/support/host_syncs.py``), and
reports per decode step and per layer:

- host round trips by kind (``item``, ``tolist``, ``bool``, ``cpu``, ``nonzero``,
  ``data_shape``, ``compare``): every such call on any tensor made with a plugin frame
  on the stack — an upper bound on a GPU's synchronisations, since on the CPU a tensor
  on the host by design cannot be told from one on the device;
- ``upload``: tensors built from host data (not a wait, but a plan built in Python);
- the top call sites (plugin file:line and function), per step.

"step" is what runs before the first layer (``init_forward_metadata``); the last layer
also ends the step (the hot set's bookkeeping), so it is shown apart from the others.
Warm-up steps (the requests' first, when the hot set starts tracking them) are run and
not counted.

    python -m benchmark.long_context.bench_host_syncs --out /tmp/host_syncs

(``PYTHONPATH=python:sgl-kernel-ext`` on a machine where nothing is installed; ~5 min
on 2 CPU cores, most of it the Triton interpreter.)
"""

from __future__ import annotations

import os

# Read when triton is imported: the Triton backend's kernels run on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))  # the test worlds, importable as ``support``

from sgl_importance.hot_set import HotSetParams  # noqa: E402
from support.host_syncs import STEP, SYNC_KINDS, UPLOAD, HostSyncCounter  # noqa: E402
from support.hot_set_world import DIM, KV_HEADS, PAGE, Q_HEADS, World, parents_metadata  # noqa: E402

torch.set_grad_enabled(False)


def configs() -> list[dict]:
    return [
        dict(backend=backend, guard=guard, release=release)
        for backend in ("torch", "triton")
        for guard in (False, True)
        for release in (False, True)
    ]


def run(config: dict, a: argparse.Namespace) -> dict:
    """One configuration's counted steps, summarised."""
    lengths = [int(x) for x in a.lengths.split(",")]
    params = HotSetParams(
        policy="importance", budget=a.budget, window=1, sinks=1, guard_threshold=a.guard if config["guard"] else 1.0
    )
    pages = sum(-(-(n + a.warmup + a.steps) // PAGE) for n in lengths) + 4
    pools = dict(device_pages=pages, host_pages=pages if config["release"] else 0)
    world = World(config["backend"], params, release=config["release"], device="cpu", layers=a.layers, **pools)
    counter = HostSyncCounter()
    decode = world.backend.forward_decode

    def forward_decode(q, k, v, layer, batch, **kwargs):
        with counter.where(layer.layer_id):  # each layer's calls filed under its index
            return decode(q, k, v, layer, batch, **kwargs)

    world.backend.forward_decode = forward_decode
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(lengths):
        world.place(f"r{i}", *(torch.randn(a.layers, n, KV_HEADS, DIM, generator=g) for _ in range(2)))
    bs = len(lengths)
    for step in range(a.warmup + a.steps):
        kv = [torch.randn(a.layers, bs, KV_HEADS, DIM, generator=g) for _ in range(2)]
        q = torch.randn(a.layers, bs, Q_HEADS, DIM, generator=g) * 2
        if step < a.warmup:
            world.step(*kv, q)
            continue
        with counter:
            counter.begin_step()
            world.step(*kv, q)
    totals = world.backend.hot_set.decoder.totals.as_dict()
    return summarise(config, counter, a, totals)


def summarise(config: dict, counter: HostSyncCounter, a: argparse.Namespace, totals: dict) -> dict:
    steps, last = a.steps, str(a.layers - 1)
    middle = [str(i) for i in range(a.layers - 1)]

    def per_step(**match) -> float:
        return counter.total(**match) / steps

    by_kind = {k: n / steps for k, n in sorted(counter.by("kind").items())}
    uploads = counter.total(kinds=[UPLOAD]) / steps
    sites = counter.by("site").most_common(a.top)
    return {
        **config,
        "steps_counted": steps,
        "per_step": per_step(),
        "before_layers": per_step(where=STEP),
        "per_layer": sum(counter.total(where=w) for w in middle) / steps / max(1, len(middle)),
        "last_layer": per_step(where=last),
        "per_layer_by_kind": {
            k: sum(counter.total(where=w, kinds=[k]) for w in middle) / steps / max(1, len(middle))
            for k in SYNC_KINDS
            if any(counter.total(where=w, kinds=[k]) for w in middle)
        },
        "by_kind": by_kind,
        "uploads_per_step": uploads,
        "top_sites": [{"site": s, "function": counter.functions.get(s, ""), "per_step": n / steps} for s, n in sites],
        "kept_apart": {f"{where}/{kind}": n for (where, kind), n in sorted(counter.kept_apart().items())},
        "decoder_totals": totals,
    }


def name(r: dict) -> str:
    return f"{r['backend']}, guard {'on' if r['guard'] else 'off'}, release {'on' if r['release'] else 'off'}"


def table(rows: list[dict], a: argparse.Namespace, command: str) -> str:
    kinds = [k for k in SYNC_KINDS if any(k in r["by_kind"] for r in rows)]
    lines = [
        f"Command: `{command}`",
        "",
        f"{a.layers} layers, requests of {a.lengths} tokens (page {PAGE}), budget {a.budget}, "
        f"guard threshold {a.guard} when on; {a.steps} steps counted after {a.warmup} warm-up; "
        "means per decode step. 'per layer': each layer but the last; the last layer also ends the step.",
        "",
        "| backend | guard | release | round trips / step | before layers | per layer | last layer | "
        + " | ".join(kinds)
        + " | uploads / step |",
        "|" + "---|" * (8 + len(kinds)),
    ]
    for r in rows:
        cells = [
            r["backend"] + (" (interpreter)" if r["backend"] == "triton" else ""),
            "on" if r["guard"] else "off",
            "on" if r["release"] else "off",
            f"{r['per_step']:g}",
            f"{r['before_layers']:g}",
            f"{r['per_layer']:g}",
            f"{r['last_layer']:g}",
            *(f"{r['by_kind'].get(k, 0):g}" for k in kinds),
            f"{r['uploads_per_step']:g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        t = r["decoder_totals"]
        lines += ["", f"Top sites, {name(r)} (round trips per step):", ""]
        if r["guard"]:
            # Which of the guard's paths the counts walked (random keys: flat attention).
            lines += [
                f"(decoder, warm-up included: {t['guard_checks']} guard checks, {t['guard_full_reads']} full reads, "
                f"{t['guard_fallbacks']} fallbacks)",
                "",
            ]
        lines += [f"- {s['per_step']:g}  {s['site']} ({s['function']})" for s in r["top_sites"]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in SYNC_KINDS if any(k in r["by_kind"] for r in rows)]
    labels = [name(r).replace(", ", "\n") for r in rows]
    fig, ax = plt.subplots(figsize=(11, 5))
    bottom = [0.0] * len(rows)
    for kind in kinds:
        values = [r["by_kind"].get(kind, 0.0) for r in rows]
        ax.bar(labels, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("host round trips per decode step (upper bound)")
    ax.set_title(f"Hot-set decode step, {rows[0]['steps_counted']} steps counted on the CPU")
    ax.legend()
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/host_syncs"))
    p.add_argument("--lengths", default="5,120,180", help="prompt tokens per request (the world's rows hold 256)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget", type=float, default=0.2, help="the hot set's fraction of each request's pages")
    p.add_argument("--guard", type=float, default=0.1, help="the guard's threshold when on (the shipped default)")
    p.add_argument("--steps", type=int, default=3, help="decode steps counted")
    p.add_argument("--warmup", type=int, default=2, help="decode steps run first and not counted")
    p.add_argument("--top", type=int, default=10, help="call sites listed per configuration")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with parents_metadata():
        for config in configs():
            rows.append(run(config, a))
            print(f"{name(rows[-1])}: {rows[-1]['per_step']:g} per step", flush=True)
    command = "python -m benchmark.long_context.bench_host_syncs " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    text = table(rows, a, command.strip())
    print(text)
    (a.out / "host_syncs.md").write_text(text)
    (a.out / "host_syncs.json").write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=1))
    plot(rows, a.out / "host_syncs.png")
    print(f"wrote {a.out}/host_syncs.md, .json, .png")


if __name__ == "__main__":
    main()
