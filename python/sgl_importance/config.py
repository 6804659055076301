"""ImportanceConfig: the plugin's flags, their defaults and their validation.

The flags are added to SGLang's own parser (``python -m sglang.launch_server
--help`` lists them under "sgl-importance"). ``plugin.py`` copies the parsed
values into ``server_args._importance``; underscore attributes survive the
pickling of ``ServerArgs`` into the scheduler process, so every process reads
the same validated object through ``config_of(server_args)``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Optional

REDUCTIONS = ("mean", "max")
SWITCH = ("on", "off")
MAX_RETRY_S = 86400.0
MAX_TRACE_ROWS = 10_000_000_000


@dataclass(frozen=True)
class ImportanceConfig:
    """Validated plugin settings; an invalid value fails at start-up."""

    # How a page's per-layer importance is combined across layers.
    reduce: str = "mean"
    # Record importance on every N-th decode step (1 = every step).
    sample_interval: int = 1
    # Opt-in trace of per-step page importance (trace/recorder.py); None = off.
    trace_dir: Optional[str] = None
    # Bound on the access rows one trace keeps; later rows are dropped and counted.
    trace_max_rows: int = 5_000_000
    # Seal and verify every storage-tier page (cache/integrity.py); "off" = SGLang's raw pages.
    storage_integrity: str = "on"
    # Seconds storage-tier writes stay paused after repeated failures before a retry.
    storage_retry_s: float = 30.0

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(
                f"--importance-reduce {self.reduce!r} is invalid; "
                f"allowed: {', '.join(REDUCTIONS)}"
            )
        if not isinstance(self.sample_interval, int) or not (
            1 <= self.sample_interval <= 1_000_000
        ):
            raise ValueError(
                f"--importance-sample-interval {self.sample_interval!r} is invalid; "
                "allowed: an integer in [1, 1000000]"
            )

        if self.trace_dir is not None and (not isinstance(self.trace_dir, str) or not self.trace_dir):
            raise ValueError(
                f"--importance-trace-dir {self.trace_dir!r} is invalid; allowed: a directory path"
            )
        if (
            not isinstance(self.trace_max_rows, int)
            or isinstance(self.trace_max_rows, bool)
            or not (1 <= self.trace_max_rows <= MAX_TRACE_ROWS)
        ):
            raise ValueError(
                f"--importance-trace-max-rows {self.trace_max_rows!r} is invalid; "
                f"allowed: an integer in [1, {MAX_TRACE_ROWS}]"
            )
        if self.storage_integrity not in SWITCH:
            raise ValueError(
                f"--importance-storage-integrity {self.storage_integrity!r} is invalid; "
                f"allowed: {', '.join(SWITCH)}"
            )
        if (
            not isinstance(self.storage_retry_s, (int, float))
            or isinstance(self.storage_retry_s, bool)
            or not (0.0 < self.storage_retry_s <= MAX_RETRY_S)
        ):
            raise ValueError(
                f"--importance-storage-retry-s {self.storage_retry_s!r} is invalid; "
                f"allowed: a number of seconds in (0, {MAX_RETRY_S:.0f}]"
            )


# Flag name -> field name. One table so parser, namespace and docs agree.
FLAGS = {f"--importance-{f.name.replace('_', '-')}": f.name for f in fields(ImportanceConfig)}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's flags to SGLang's argument parser."""
    defaults = ImportanceConfig()
    group = parser.add_argument_group("sgl-importance")
    group.add_argument(
        "--importance-reduce",
        choices=REDUCTIONS,
        default=defaults.reduce,
        help="How per-layer page importance is combined across layers.",
    )
    group.add_argument(
        "--importance-sample-interval",
        type=int,
        default=defaults.sample_interval,
        help="Record page importance on every N-th decode step (1 = every step).",
    )
    group.add_argument(
        "--importance-trace-dir",
        default=defaults.trace_dir,
        help="Record each recorded decode step's per-request page importance as a "
        "Parquet trace in this directory (off by default; see sgl_importance.trace).",
    )
    group.add_argument(
        "--importance-trace-max-rows",
        type=int,
        default=defaults.trace_max_rows,
        help="Keep at most this many access rows in the trace; later rows are dropped.",
    )
    group.add_argument(
        "--importance-storage-integrity",
        choices=SWITCH,
        default=defaults.storage_integrity,
        help="Seal each storage-tier page with a checksum and layout fingerprint and "
        "verify it on read; a damaged page is a miss and is recomputed.",
    )
    group.add_argument(
        "--importance-storage-retry-s",
        type=float,
        default=defaults.storage_retry_s,
        help="Seconds storage-tier writes stay paused after repeated failures.",
    )


def from_namespace(args: argparse.Namespace) -> ImportanceConfig:
    """Build the config from parsed arguments; absent flags keep defaults."""
    values = {}
    for flag, name in FLAGS.items():
        dest = flag[2:].replace("-", "_")
        if hasattr(args, dest):
            values[name] = getattr(args, dest)
    return ImportanceConfig(**values)


def config_of(server_args: Any) -> ImportanceConfig:
    """The config a process was started with (defaults when built without the CLI)."""
    config = getattr(server_args, "_importance", None)
    return config if isinstance(config, ImportanceConfig) else ImportanceConfig()
