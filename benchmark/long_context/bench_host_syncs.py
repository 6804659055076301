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
from support.counted_world import END, START, counted_decode  # noqa: E402
from support.host_syncs import ALLOC, LAUNCH, SYNC_KINDS, UPLOAD, HostSyncCounter  # noqa: E402
from support.hot_set_world import PAGE, parents_metadata  # noqa: E402

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
    params = HotSetParams(
        policy="importance", budget=a.budget, window=1, sinks=1, guard_threshold=a.guard if config["guard"] else 1.0
    )
    counter, world = counted_decode(
        config["backend"], params, release=config["release"], lengths=[int(x) for x in a.lengths.split(",")],
        layers=a.layers, steps=a.steps, warmup=a.warmup,
    )  # fmt: skip
    totals = world.backend.hot_set.decoder.totals.as_dict()
    return summarise(config, counter, a, totals)


def summarise(config: dict, counter: HostSyncCounter, a: argparse.Namespace, totals: dict) -> dict:
    steps = a.steps
    layers = [str(i) for i in range(a.layers)]

    def view(device_only: bool) -> dict:
        def per_step(**match) -> float:
            return counter.total(device_only=device_only, **match) / steps

        return {
            "per_step": per_step(),
            "before_layers": per_step(where=START),
            "per_layer": sum(per_step(where=w) for w in layers) / len(layers),
            "max_layer": max(per_step(where=w) for w in layers),
            "end_step": per_step(where=END),
            "by_kind": {k: n / steps for k, n in sorted(counter.by("kind", device_only=device_only).items())},
            "top_sites": [
                {"site": s, "function": counter.functions.get(s, ""), "per_step": n / steps}
                for s, n in counter.by("site", device_only=device_only).most_common(a.top)
            ],
        }

    return {
        **config,
        "steps_counted": steps,
        "every_tensor": view(False),
        "device": view(True),
        "uploads_per_step": counter.total(kinds=[UPLOAD]) / steps,
        "allocs_per_step": counter.total(kinds=[ALLOC], device_only=True) / steps,
        "allocs_per_layer": sum(counter.total(kinds=[ALLOC], device_only=True, where=w) for w in layers)
        / steps
        / len(layers),
        "launches": {
            "per_step": counter.total(kinds=[LAUNCH], device_only=True) / steps,
            "start": counter.total(kinds=[LAUNCH], device_only=True, where=START) / steps,
            "per_layer": sum(counter.total(kinds=[LAUNCH], device_only=True, where=w) for w in layers[:-1])
            / steps
            / max(len(layers) - 1, 1),
            "end": counter.total(kinds=[LAUNCH], device_only=True, where=END) / steps,
            "top_sites_layer_0": [
                {"site": s, "function": counter.functions.get(s, ""), "per_step": n / steps}
                for s, n in counter.by("site", kinds=[LAUNCH], device_only=True, where=0).most_common(a.top)
            ],
        },
        "kept_apart": {f"{where}/{kind}": n for (where, kind), n in sorted(counter.kept_apart().items())},
        "decoder_totals": totals,
    }


def name(r: dict) -> str:
    return f"{r['backend']}, guard {'on' if r['guard'] else 'off'}, release {'on' if r['release'] else 'off'}"


def table(rows: list[dict], a: argparse.Namespace, command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"{a.layers} layers, requests of {a.lengths} tokens (page {PAGE}), budget {a.budget}, "
        f"guard threshold {a.guard} when on; {a.steps} steps counted after {a.warmup} warm-up; "
        "means per decode step. 'start': before the first layer (the plan); 'per layer' / 'max layer': "
        "a layer's forward (KV write, summaries, attend), mean and largest; 'end': the step's bookkeeping "
        "and the next step's plan. 'every tensor' counts calls on any tensor (an upper bound); 'device' "
        "only those on tensors that would live on the GPU in the server. Device allocations: new tensors on the "
        "device (not views), per step and per layer. Launches: device kernels issued (torch ops computing "
        "into a device tensor, Triton kernels), per step and per layer (the layers but the last, which also "
        "ends the step): on a GPU an eager step's host time grows with them.",
        "",
        "| backend | guard | release | view | round trips / step | start | per layer | max layer | end "
        "| uploads / step | device allocations / step (per layer) | launches / step (start, per layer, end) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for view in ("every_tensor", "device"):
            v = r[view]
            cells = [
                r["backend"] + (" (interpreter)" if r["backend"] == "triton" else ""),
                "on" if r["guard"] else "off",
                "on" if r["release"] else "off",
                view.replace("_", " "),
                f"{v['per_step']:g}",
                f"{v['before_layers']:g}",
                f"{v['per_layer']:g}",
                f"{v['max_layer']:g}",
                f"{v['end_step']:g}",
                f"{r['uploads_per_step']:g}",
                f"{r['allocs_per_step']:g} ({r['allocs_per_layer']:g})",
                "{per_step:g} ({start:g}, {per_layer:g}, {end:g})".format(**r["launches"]) if view == "device" else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        t = r["decoder_totals"]
        lines += ["", f"Top sites, {name(r)}, device view (round trips per step):", ""]
        if r["guard"]:
            # Which of the guard's paths the counts walked (random keys: flat attention).
            lines += [
                f"(decoder, warm-up included: {t['guard_checks']} guard checks, {t['guard_flagged']} flagged, "
                f"{t['pages_missed']} misses)",
                "",
            ]
        lines += [f"- {s['per_step']:g}  {s['site']} ({s['function']})" for s in r["device"]["top_sites"]]
        lines += ["", f"Top launch sites, {name(r)}, layer 0 (launches per step):", ""]
        lines += [f"- {s['per_step']:g}  {s['site']} ({s['function']})" for s in r["launches"]["top_sites_layer_0"]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in SYNC_KINDS if any(k in r["device"]["by_kind"] for r in rows)]
    labels = [name(r).replace(", ", "\n") for r in rows]
    fig, ax = plt.subplots(figsize=(11, 5))
    bottom = [0.0] * len(rows)
    for kind in kinds:
        values = [r["device"]["by_kind"].get(kind, 0.0) for r in rows]
        ax.bar(labels, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("host round trips per decode step (device view)")
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
            print(f"{name(rows[-1])}: {rows[-1]['device']['per_step']:g} per step (device view)", flush=True)
    command = "python -m benchmark.long_context.bench_host_syncs " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    text = table(rows, a, command.strip())
    print(text)
    (a.out / "host_syncs.md").write_text(text)
    (a.out / "host_syncs.json").write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=1))
    plot(rows, a.out / "host_syncs.png")
    print(f"wrote {a.out}/host_syncs.md, .json, .png")


if __name__ == "__main__":
    main()
