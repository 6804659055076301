"""CPU an idle server burns, with and without SGLang's ``--sleep-on-idle``.

Starts the embedded model's server twice, one after the other, lets each sit idle
and reads the CPU time of its whole process group from /proc. Prints a table and
saves a bar plot beside it.

    .venv/bin/python -m benchmark.serving.bench_idle_cpu [--idle-s 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from sgl_importance.local_server import LocalServer, model_path, start_with_retry

REPO = Path(__file__).resolve().parents[2]


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu(model: str, sleep_on_idle: bool, idle_s: float, log: Path) -> float:
    server = start_with_retry(lambda: LocalServer(model, ["--page-size", "16"], log, sleep_on_idle=sleep_on_idle))
    try:
        time.sleep(3)  # let the warm-up request and start-up work finish
        before = group_cpu_seconds(server.proc.pid)
        time.sleep(idle_s)
        return (group_cpu_seconds(server.proc.pid) - before) / idle_s
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmark" / "serving" / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_path()
    rows = []
    for flag in (False, True):
        rows.append((flag, idle_cpu(model, flag, args.idle_s, args.out / f"idle-{int(flag)}.log")))
    print(f"machine: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; idle {args.idle_s:.0f} s each")
    print(f"{'--sleep-on-idle':>16} | CPU-s per s idle")
    for flag, cpu in rows:
        print(f"{'on' if flag else 'off':>16} | {cpu:.2f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(["off", "on"], [cpu for _, cpu in rows], color=["tab:red", "tab:green"])
    ax.set_xlabel("--sleep-on-idle")
    ax.set_ylabel("CPU seconds per second, idle")
    fig.tight_layout()
    fig.savefig(args.out / "idle_cpu.png", dpi=120)
    print(f"plot: {args.out / 'idle_cpu.png'}")


if __name__ == "__main__":
    main()
