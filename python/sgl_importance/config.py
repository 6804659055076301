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
from typing import Any, Callable, Optional, Union

REDUCTIONS = ("mean", "max")
SWITCH = ("on", "off")
MAX_RETRY_S = 86400.0
MAX_TRACE_ROWS = 10_000_000_000
# Kept in step with hot_set.selection.POLICIES (config imports no torch module).
HOT_SET_POLICIES = ("off", "dense", "window", "quest", "lru", "importance")
HOT_SET_BACKENDS = ("importance_torch", "importance_triton")
MAX_HOT_SET_PAGES = 1 << 20
MAX_HOT_SET_SINKS = 64
MAX_HOT_SET_THRESHOLD = 1 << 30
BUDGET_RANGE = "an integer number of pages >= 1, or a fraction in (0, 1] written with a '.'"
MAX_REQUEST_SEQUENCES = 1 << 20
MAX_REQUEST_LOGPROBS = 1 << 20
# --importance-storage-precision: off, importance-graded, and the uniform baselines.
STORAGE_PRECISIONS = ("off", "graded", "uniform8", "uniform4")
# --importance-storage-precision-config keys and defaults: fraction of a node's pages
# kept at the model's dtype (sinks included), fraction at 4 bits, leading pages of a
# sequence that are attention sinks (always kept), and how pages are ranked
# ("importance", or "blind": the same fractions by a hash of the key, a control).
# The defaults store ~1/4 of float32's bytes (5 % full, 35 % int8, 60 % int4).
STORAGE_PRECISION_DEFAULTS = {"keep": 0.05, "cold": 0.6, "sink_pages": 1, "order": "importance"}
STORAGE_PRECISION_ORDERS = ("importance", "blind")


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
    # Seal and verify every storage-tier page (storage/wrapper.py); "off" = SGLang's raw pages.
    storage_integrity: str = "on"
    # Seconds storage-tier writes stay paused after repeated failures before a retry.
    storage_retry_s: float = 30.0
    # Encoding of storage-tier pages (storage/encoding.py); "off" = the model's dtype.
    storage_precision: str = "off"
    # JSON of the graded thresholds (STORAGE_PRECISION_DEFAULTS); None = the defaults.
    storage_precision_config: Optional[str] = None
    # Per-request hot set for long requests (hot_set/); "off" = every page attended.
    hot_set_policy: str = "off"
    # Pages per request (int >= 1) or fraction of the request's pages (float).
    hot_set_budget: Union[int, float] = 0.2
    # Recent pages always attended (the last one holds the decoded token).
    hot_set_window: int = 4
    # Leading pages always attended (attention sinks).
    hot_set_sinks: int = 1
    # Requests longer than this many tokens use the hot set.
    hot_set_threshold: int = 2048
    # Allowed bound of each layer's relative attention output error (L2); 1 = no guard.
    hot_set_guard_threshold: float = 0.1
    # How the importance policy reduces a step's page masses over layers and KV heads.
    hot_set_reduce: str = "max"
    # Sequences one request may ask for: prompts x n (request_check.py).
    request_max_sequences: int = 256
    # Top log probabilities per position, and token_ids_logprob ids, one request may ask for.
    request_max_logprobs: int = 64

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"--importance-reduce {self.reduce!r} is invalid; allowed: {', '.join(REDUCTIONS)}")
        if not isinstance(self.sample_interval, int) or not (1 <= self.sample_interval <= 1_000_000):
            raise ValueError(
                f"--importance-sample-interval {self.sample_interval!r} is invalid; allowed: an integer in [1, 1000000]"
            )

        if self.trace_dir is not None and (not isinstance(self.trace_dir, str) or not self.trace_dir):
            raise ValueError(f"--importance-trace-dir {self.trace_dir!r} is invalid; allowed: a directory path")
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
                f"--importance-storage-integrity {self.storage_integrity!r} is invalid; allowed: {', '.join(SWITCH)}"
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
        if self.storage_precision not in STORAGE_PRECISIONS:
            raise ValueError(
                f"--importance-storage-precision {self.storage_precision!r} is invalid; "
                f"allowed: {', '.join(STORAGE_PRECISIONS)}"
            )
        if self.storage_precision != "off" and self.storage_integrity == "off":
            raise ValueError(
                f"--importance-storage-precision {self.storage_precision} needs --importance-storage-integrity on "
                "(the page's class lives in the integrity trailer)"
            )
        self.storage_precision_thresholds()
        self._check_hot_set()
        for name, low, high in (
            ("request_max_sequences", 1, MAX_REQUEST_SEQUENCES),
            ("request_max_logprobs", 0, MAX_REQUEST_LOGPROBS),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
                raise ValueError(f"{_flag(name)} {value!r} is invalid; allowed: an integer in [{low}, {high}]")

    def storage_precision_thresholds(self) -> dict[str, Any]:
        """The graded thresholds: ``STORAGE_PRECISION_DEFAULTS`` overridden by the JSON flag.

        Raises:
            ValueError: naming ``--importance-storage-precision-config``, the key and what is allowed.
        """
        flag = "--importance-storage-precision-config"
        values = dict(STORAGE_PRECISION_DEFAULTS)
        if self.storage_precision_config is None:
            return values
        import json

        try:
            given = json.loads(self.storage_precision_config)
        except (TypeError, ValueError):
            given = None
        if not isinstance(given, dict):
            raise ValueError(f"{flag} {self.storage_precision_config!r} is invalid; allowed: a JSON object")
        unknown = sorted(set(given) - set(values))
        if unknown:
            raise ValueError(f"{flag} has unknown keys {unknown}; allowed: {', '.join(values)}")
        values.update(given)
        for key in ("keep", "cold"):
            v = values[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= v <= 1.0):
                raise ValueError(f"{flag} {key}={v!r} is invalid; allowed: a fraction in [0, 1]")
        if values["keep"] + values["cold"] > 1.0:
            raise ValueError(f"{flag} keep + cold = {values['keep'] + values['cold']:g} is invalid; allowed: <= 1")
        sinks = values["sink_pages"]
        if isinstance(sinks, bool) or not isinstance(sinks, int) or not (0 <= sinks <= MAX_HOT_SET_SINKS):
            raise ValueError(f"{flag} sink_pages={sinks!r} is invalid; allowed: an integer in [0, {MAX_HOT_SET_SINKS}]")
        if values["order"] not in STORAGE_PRECISION_ORDERS:
            raise ValueError(
                f"{flag} order={values['order']!r} is invalid; allowed: {', '.join(STORAGE_PRECISION_ORDERS)}"
            )
        return values

    def _check_hot_set(self) -> None:
        check_hot_set(
            {name: getattr(self, name) for name in HOT_SET_FIELDS},
            _flag,
            policies=HOT_SET_POLICIES,
        )

    def hot_set_params(self) -> Any:
        """The hot set's parameters, or None when ``--hot-set-policy off``."""
        if self.hot_set_policy == "off":
            return None
        from sgl_importance.hot_set.selection import HotSetParams

        return HotSetParams(
            policy=self.hot_set_policy,
            budget=self.hot_set_budget,
            window=self.hot_set_window,
            sinks=self.hot_set_sinks,
            guard_threshold=float(self.hot_set_guard_threshold),
            reduce=self.hot_set_reduce,
        )

    def request_hot_set_params(self, value: Any) -> Any:
        """A request's own hot-set parameters (``custom_params.hot_set``) over the server's.

        Args:
            value: the request's ``custom_params["hot_set"]``: a dict with any of
                ``REQUEST_HOT_SET_KEYS``; the others keep the server's flags.

        Raises:
            ValueError: naming ``custom_params.hot_set.<key>``, the value and what is
                allowed; also when the server runs without a hot set.
        """
        if self.hot_set_policy == "off":
            raise ValueError(
                f"{REQUEST_HOT_SET_FIELD} needs a server started with --hot-set-policy (this one has it off)"
            )
        if not isinstance(value, dict):
            raise ValueError(f"{REQUEST_HOT_SET_FIELD} {value!r} is invalid; allowed: an object with keys "
                             f"{', '.join(REQUEST_HOT_SET_KEYS)}")  # fmt: skip
        unknown = sorted(set(value) - set(REQUEST_HOT_SET_KEYS))
        if unknown:
            raise ValueError(
                f"{REQUEST_HOT_SET_FIELD} has unknown keys {unknown}; allowed: {', '.join(REQUEST_HOT_SET_KEYS)}"
            )
        values = {name: getattr(self, name) for name in HOT_SET_FIELDS}
        values.update({f"hot_set_{key}": v for key, v in value.items()})
        check_hot_set(values, _request_key, policies=HOT_SET_POLICIES[1:])
        from sgl_importance.hot_set.selection import HotSetParams

        return HotSetParams(
            policy=values["hot_set_policy"],
            budget=values["hot_set_budget"],
            window=values["hot_set_window"],
            sinks=values["hot_set_sinks"],
            guard_threshold=float(values["hot_set_guard_threshold"]),
            reduce=values["hot_set_reduce"],
        )


# The hot set's fields, checked together by check_hot_set.
HOT_SET_FIELDS = (
    "hot_set_policy",
    "hot_set_budget",
    "hot_set_window",
    "hot_set_sinks",
    "hot_set_threshold",
    "hot_set_guard_threshold",
    "hot_set_reduce",
)
# What one request may set for itself in ``custom_params["hot_set"]`` (the threshold
# stays the server's: it decides, at admission, whether the prompt's pages may leave).
REQUEST_HOT_SET_KEY = "hot_set"
REQUEST_HOT_SET_FIELD = f"custom_params.{REQUEST_HOT_SET_KEY}"
REQUEST_HOT_SET_KEYS = ("policy", "budget", "window", "sinks", "guard_threshold", "reduce")


def _request_key(name: str) -> str:
    return f"{REQUEST_HOT_SET_FIELD}.{name.removeprefix('hot_set_')}"


def check_hot_set(values: dict[str, Any], name: Any, *, policies: tuple[str, ...]) -> None:
    """Raise ValueError, naming the setting by ``name(field)``, unless the hot-set values are valid."""
    policy = values["hot_set_policy"]
    if policy not in policies:
        raise ValueError(f"{name('hot_set_policy')} {policy!r} is invalid; allowed: {', '.join(policies)}")
    budget = values["hot_set_budget"]
    if isinstance(budget, bool) or not (
        (isinstance(budget, int) and budget >= 1) or (isinstance(budget, float) and 0.0 < budget <= 1.0)
    ):
        raise ValueError(f"{name('hot_set_budget')} {budget!r} is invalid; allowed: {BUDGET_RANGE}")
    for field, low, high in (
        ("hot_set_window", 1, MAX_HOT_SET_PAGES),
        ("hot_set_sinks", 0, MAX_HOT_SET_SINKS),
        ("hot_set_threshold", 0, MAX_HOT_SET_THRESHOLD),
    ):
        value = values[field]
        if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
            raise ValueError(f"{name(field)} {value!r} is invalid; allowed: an integer in [{low}, {high}]")
    guard = values["hot_set_guard_threshold"]
    if isinstance(guard, bool) or not isinstance(guard, (int, float)) or not (0.0 < guard <= 1.0):
        raise ValueError(
            f"{name('hot_set_guard_threshold')} {guard!r} is invalid; allowed: a number in (0, 1] (1 = no guard)"
        )
    reduce = values["hot_set_reduce"]
    if reduce not in REDUCTIONS:
        raise ValueError(f"{name('hot_set_reduce')} {reduce!r} is invalid; allowed: {', '.join(REDUCTIONS)}")


def _flag(name: str) -> str:
    dashed = name.replace("_", "-")
    return f"--{dashed}" if name.startswith(("hot_set_", "request_")) else f"--importance-{dashed}"


# Flag name -> field name. One table so parser, namespace and docs agree.
FLAGS = {_flag(f.name): f.name for f in fields(ImportanceConfig)}


def parse_budget(text: str) -> Union[int, float]:
    """``--hot-set-budget``: ``"40"`` is 40 pages, ``"0.2"`` (or ``"1.0"``) a fraction."""
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hot-set-budget {text!r} is invalid; allowed: {BUDGET_RANGE}") from None


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
    group.add_argument(
        "--importance-storage-precision",
        choices=STORAGE_PRECISIONS,
        default=defaults.storage_precision,
        help="Encoding of storage-tier pages. graded: attention-sink pages and the most "
        "important at the model's dtype, the coldest at 4 bits, the rest at 8 bits (keys "
        "quantised per channel, values per token; thresholds in "
        "--importance-storage-precision-config); uniform8 / uniform4: every page at 8 / 4 "
        "bits (baselines); off: the model's dtype. Needs --importance-storage-integrity on.",
    )
    group.add_argument(
        "--importance-storage-precision-config",
        default=defaults.storage_precision_config,
        help='JSON thresholds for --importance-storage-precision graded, e.g. {"keep": 0.05, '
        '"cold": 0.6, "sink_pages": 1, "order": "importance"} (the defaults): fractions of '
        "each written node's pages kept at the model's dtype and put at 4 bits, leading "
        "sink pages always kept, and the ranking (importance, or blind: by key hash, a control).",
    )
    group.add_argument(
        "--hot-set-policy",
        choices=HOT_SET_POLICIES,
        default=defaults.hot_set_policy,
        help="Per-request hot set for long requests: decode attends only over sink pages, "
        "a recent window and the pages the policy keeps (off = every page). Needs "
        "--attention-backend importance_torch or importance_triton (the latter without CUDA "
        "graphs: --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled).",
    )
    group.add_argument(
        "--hot-set-budget",
        type=parse_budget,
        default=defaults.hot_set_budget,
        help="Hot-set size per request: pages (an integer >= 1) or a fraction of the "
        "request's pages (a number in (0, 1] with a '.', e.g. 0.2 or 1.0).",
    )
    group.add_argument(
        "--hot-set-window",
        type=int,
        default=defaults.hot_set_window,
        help="Most recent pages always in the hot set (>= 1).",
    )
    group.add_argument(
        "--hot-set-sinks",
        type=int,
        default=defaults.hot_set_sinks,
        help="Leading pages (attention sinks) always in the hot set.",
    )
    group.add_argument(
        "--hot-set-threshold",
        type=int,
        default=defaults.hot_set_threshold,
        help="Requests longer than this many tokens use the hot set.",
    )
    group.add_argument(
        "--hot-set-guard-threshold",
        type=float,
        default=defaults.hot_set_guard_threshold,
        help="Pages outside the hot set are estimated from an 8-bit copy and the relative L2 "
        "error of each layer's attention output is bounded; where the bound exceeds this, the "
        "step reads the most suspect pages exactly until it holds (counted). 1 = no guard: "
        "nothing estimated or bounded.",
    )
    group.add_argument(
        "--hot-set-reduce",
        choices=REDUCTIONS,
        default=defaults.hot_set_reduce,
        help="How the importance policy ranks a page from one step: its largest mass in any "
        "layer and KV head (max: a page one retrieval head needs stays), or the mean over them.",
    )
    group.add_argument(
        "--request-max-sequences",
        type=int,
        default=defaults.request_max_sequences,
        help="Most sequences one generate request may ask for (prompts in a batch x n); more is a 400.",
    )
    group.add_argument(
        "--request-max-logprobs",
        type=int,
        default=defaults.request_max_logprobs,
        help="Most top log probabilities per position (top_logprobs_num, OpenAI logprobs / "
        "top_logprobs) and token_ids_logprob ids one request may ask for; more is a 400.",
    )


def from_namespace(args: argparse.Namespace) -> ImportanceConfig:
    """Build the config from parsed arguments; absent flags keep defaults."""
    values = {}
    for flag, name in FLAGS.items():
        dest = flag[2:].replace("-", "_")
        if hasattr(args, dest):
            values[name] = getattr(args, dest)
    config = ImportanceConfig(**values)
    # Only the plugin's flags (a parser without SGLang's, as in tests): no backend to check.
    if config.hot_set_policy != "off" and hasattr(args, "attention_backend"):
        backend = args.decode_attention_backend or args.attention_backend
        if backend not in HOT_SET_BACKENDS:
            raise ValueError(
                f"--hot-set-policy {config.hot_set_policy} needs the decode attention backend "
                f"{' or '.join(HOT_SET_BACKENDS)} (--attention-backend or "
                f"--decode-attention-backend); got {backend!r}"
            )
    return config


def config_of(server_args: Any) -> ImportanceConfig:
    """The config a process was started with (defaults when built without the CLI)."""
    # Absent where ServerArgs was built without from_cli_args (the Engine API, tests).
    config = getattr(server_args, "_importance", None)
    return config if isinstance(config, ImportanceConfig) else ImportanceConfig()


def from_cli_args(original: Callable[..., Any], cls: Any, args: argparse.Namespace) -> Any:
    """Around ``ServerArgs.from_cli_args``: validate the flags before SGLang builds
    anything (a bad value stops start-up naming the flag, not later in a child
    process), then keep the config on the server args (``config_of``)."""
    config = from_namespace(args)
    server_args = original(cls, args)
    server_args._importance = config
    return server_args
