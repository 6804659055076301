"""ImportanceConfig: the plugin's flags, their defaults and their validation.

Each field declares its flag once (``flags.py``: type, choices or range, help);
the argparse arguments and the start-up validation are generated from those
declarations. A leaf: it imports only the stdlib, ``flags`` and ``choices``
(``hot_set/params.py`` builds the hot set's parameters from it).

The flags are added to SGLang's own parser (``python -m sglang.launch_server
--help`` lists them under "sgl-importance"). ``plugin.py`` copies the parsed
values into ``server_args._importance``; underscore attributes survive the
pickling of ``ServerArgs`` into the scheduler process, so every process builds its
runtime (``runtime.py``) from the same validated object, and everything else reads
it from the runtime.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from sgl_importance.choices import (
    ADMISSIONS,
    FIRST_STEPS,
    HOT_SET_POLICIES,
    PREFILLS,
    PREFIX_RESIDENCES,
    REDUCTIONS,
)
from sgl_importance.flags import Flag, add_arguments, check_fields, choice, flag, integer, number, specs
from sgl_importance.validate import int_in, invalid, is_int, number_in

SWITCH = ("on", "off")
MAX_RETRY_S = 86400.0
MAX_TRACE_ROWS = 10_000_000_000
HOT_SET_BACKENDS = ("importance_torch", "importance_triton")
MAX_HOT_SET_PAGES = 1 << 20
MAX_HOT_SET_SINKS = 64
MAX_HOT_SET_THRESHOLD = 1 << 30
MAX_HOT_SET_GRAPH_ROWS = 4096
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


def parse_budget(text: str) -> Union[int, float]:
    """``--hot-set-budget``: ``"40"`` is 40 pages, ``"0.2"`` (or ``"1.0"``) a fraction."""
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hot-set-budget {text!r} is invalid; allowed: {BUDGET_RANGE}") from None


def _is_budget(budget: Any) -> bool:
    # Pages (an int), or a fraction (a float; 1.0 is every page, 1 is one page).
    return (is_int(budget) and budget >= 1) or (isinstance(budget, float) and 0.0 < budget <= 1.0)


def _share(help: str) -> Flag:
    """A flag holding a share in (0, 1]."""
    return number(lambda x: 0.0 < x <= 1.0, "a number in (0, 1]", help)


def _precision_needs_integrity(config: ImportanceConfig) -> None:
    if config.storage_precision != "off" and config.storage_integrity == "off":
        raise ValueError(
            f"--importance-storage-precision {config.storage_precision} needs --importance-storage-integrity on "
            "(the page's class lives in the integrity trailer)"
        )


@dataclass(frozen=True)
class ImportanceConfig:
    """Validated plugin settings, one declaration per flag; an invalid value fails at start-up."""

    reduce: str = flag("mean", choice(REDUCTIONS, "How per-layer page importance is combined across layers."))
    sample_interval: int = flag(
        1, integer(1, 1_000_000, "Record page importance on every N-th decode step (1 = every step).")
    )
    # Opt-in trace (trace/recorder.py); None = off.
    trace_dir: Optional[str] = flag(
        None,
        Flag(
            "Record each recorded decode step's per-request page importance as a "
            "Parquet trace in this directory (off by default; see sgl_importance.trace).",
            valid=lambda value: value is None or (isinstance(value, str) and bool(value)),
            allowed="a directory path",
        ),
    )
    trace_max_rows: int = flag(
        5_000_000,
        integer(1, MAX_TRACE_ROWS, "Keep at most this many access rows in the trace; later rows are dropped."),
    )
    # storage/wrapper.py; "off" = SGLang's raw pages.
    storage_integrity: str = flag(
        "on",
        choice(
            SWITCH,
            "Seal each storage-tier page with a checksum and layout fingerprint and "
            "verify it on read; a damaged page is a miss and is recomputed.",
        ),
    )
    storage_retry_s: float = flag(
        30.0,
        number(
            lambda seconds: 0.0 < seconds <= MAX_RETRY_S,
            f"a number of seconds in (0, {MAX_RETRY_S:.0f}]",
            "Seconds storage-tier writes stay paused after repeated failures.",
        ),
    )
    # storage/encoding.py; "off" = the model's dtype.
    storage_precision: str = flag(
        "off",
        Flag(
            "Encoding of storage-tier pages. graded: attention-sink pages and the most "
            "important at the model's dtype, the coldest at 4 bits, the rest at 8 bits (keys "
            "quantised per channel, values per token; thresholds in "
            "--importance-storage-precision-config); uniform8 / uniform4: every page at 8 / 4 "
            "bits (baselines); off: the model's dtype. Needs --importance-storage-integrity on.",
            choices=STORAGE_PRECISIONS,
            then=_precision_needs_integrity,
        ),
    )
    # JSON of the graded thresholds (STORAGE_PRECISION_DEFAULTS); None = the defaults.
    storage_precision_config: Optional[str] = flag(
        None,
        Flag(
            'JSON thresholds for --importance-storage-precision graded, e.g. {"keep": 0.05, '
            '"cold": 0.6, "sink_pages": 1, "order": "importance"} (the defaults): fractions of '
            "each written node's pages kept at the model's dtype and put at 4 bits, leading "
            "sink pages always kept, and the ranking (importance, or blind: by key hash, a control).",
            then=lambda config: config.storage_precision_thresholds(),
        ),
    )
    # hot_set/; "off" = every page attended.
    hot_set_policy: str = flag(
        "off",
        choice(
            HOT_SET_POLICIES,
            "Per-request hot set for long requests: decode attends only over sink pages, "
            "a recent window and the pages the policy keeps (off = every page). Needs "
            "--attention-backend importance_torch or importance_triton (CUDA graphs replay "
            "decode batches with no request past --hot-set-threshold; the others run eagerly "
            "unless --hot-set-graph-rows).",
        ),
    )
    hot_set_budget: Union[int, float] = flag(
        0.2,
        Flag(
            "Hot-set size per request: pages (an integer >= 1) or a fraction of the "
            "request's pages (a number in (0, 1] with a '.', e.g. 0.2 or 1.0).",
            type=parse_budget,
            valid=_is_budget,
            allowed=BUDGET_RANGE,
        ),
    )
    hot_set_window: int = flag(4, integer(1, MAX_HOT_SET_PAGES, "Most recent pages always in the hot set (>= 1)."))
    hot_set_sinks: int = flag(
        1, integer(0, MAX_HOT_SET_SINKS, "Leading pages (attention sinks) always in the hot set.")
    )
    hot_set_threshold: int = flag(
        2048, integer(0, MAX_HOT_SET_THRESHOLD, "Requests longer than this many tokens use the hot set.")
    )
    hot_set_guard_threshold: float = flag(
        0.1,
        number(
            lambda bound: 0.0 < bound <= 1.0,
            "a number in (0, 1] (1 = no guard)",
            "Guard on (< 1): every layer reads the pages its heads want by top-p on their 4-bit key "
            "codes (at most --hot-set-read-cap), estimates the rest from a page sample and bounds the "
            "relative L2 error of its attention output; a layer-step whose bound exceeds this is "
            "flagged (counted) and raises that layer's read cap for the request's later steps. Nothing "
            "is read again within a step. 1 = no guard: nothing estimated or bounded.",
        ),
    )
    hot_set_read_cap: float = flag(
        0.2,
        _share(
            "Guard on: the most pages one layer of a request reads exactly per decode step, as a "
            "fraction of its pages (sinks, window and the page sample included; a flagged layer's cap "
            "doubles for later steps, up to every page).",
        ),
    )
    hot_set_top_p: float = flag(
        0.95,
        _share(
            "Guard on: each query head wants the fewest pages whose mass estimated from their key codes, "
            "with the sinks' and window's, reaches this share of its total (read up to the cap).",
        ),
    )
    # attention/hot_set_attention.py (hot_set/graph/step.py); 0 = off.
    hot_set_graph_rows: int = flag(
        0,
        integer(
            0,
            MAX_HOT_SET_GRAPH_ROWS,
            "importance_triton with CUDA graphs: most requests a captured hot-set decode step holds "
            "(its buffers: this many rows of the longest context's pages, allocated once). A decode batch "
            "holding a request past --hot-set-threshold replays it (guard on or off) when it fits, none of "
            "its requests is in its first guarded step and none reads a page from the host; the others run "
            "eagerly (counted: hot_set_graph_eager). 0 = off: such batches always run eagerly. Not yet run "
            "on a GPU: proven on the CPU by the capture harness (docs/hot_set.md).",
        ),
    )
    # attention/hot_set_attention.py: each step ended one step late.
    hot_set_plan_ahead: str = flag(
        "off",
        choice(
            SWITCH,
            "on = a hot-set decode step is folded and ended (its tally read, the step after the next "
            "planned, its page moves made) while the next step runs, not before it starts: with "
            "--hot-set-graph-rows the host's work between steps overlaps the replay on a GPU instead of "
            "waiting for it; each plan is one step older (eager steps keep the same rhythm). Not yet "
            "run on a GPU.",
        ),
    )
    hot_set_prefix: str = flag(
        "host",
        choice(
            PREFIX_RESIDENCES,
            "Where a running hot-set request keeps the prefix it matched in the radix cache "
            "(a returning session's history): host = pages its hot set leaves out are read from "
            "HiCache's host copies and the tree's device pages become evictable (needs "
            "--enable-hierarchical-cache and the Python tree core, which --radix-eviction-policy "
            "importance selects); device = the whole matched prefix stays on the device while it runs.",
        ),
    )
    hot_set_admission: str = flag(
        "footprint",
        choice(
            ADMISSIONS,
            "How the scheduler charges a request the hot set will release when it admits it: "
            "footprint = the prompt, then its growth only up to what it keeps on the device (its hot "
            "set at its final length), while the host pool can take its pages and its rows can be borrowed "
            "(counted: hot_set_admitted_by_footprint, hot_set_footprint_refused); length = as SGLang "
            "charges any request, its prompt and max_new_tokens (a long generation is admitted as if "
            "it kept all its KV).",
        ),
    )
    hot_set_prefill: str = flag(
        "stream",
        choice(
            PREFILLS,
            "How a prompt past --hot-set-threshold is prefilled with --enable-hierarchical-cache: "
            "stream = at the end of each prefill chunk (--chunked-prefill-size) its full pages are "
            "summarised and released to the host pool (sinks and window kept), and later chunks and "
            "the first decode step read them back from there, so the device holds about one chunk "
            "while it prefills; the output is the same as dense prefill's (importance_torch "
            "and importance_triton); dense = the whole prompt stays on the device until its "
            "first decode step.",
        ),
    )
    hot_set_first_step: str = flag(
        "dense",
        choice(
            FIRST_STEPS,
            "A long request's first decode step with --enable-hierarchical-cache: dense = it reads "
            "every page exactly (from the host pool where its prefill released them) and seeds the "
            "hot set from what it found; seeded = the hot set is seeded from the prefill's last "
            "token's attention (importance_torch on the CPU), so that step reads only the hot set, "
            "the sinks and the window (counted as fewer warmups and host reads).",
        ),
    )
    hot_set_reduce: str = flag(
        "max",
        choice(
            REDUCTIONS,
            "How the importance policy ranks a page from one step: its largest mass in any "
            "layer and KV head (max: a page one retrieval head needs stays), or the mean over them.",
        ),
    )
    # Sequences one request may ask for: prompts x n (request_check/generate.py).
    request_max_sequences: int = flag(
        256,
        integer(
            1,
            MAX_REQUEST_SEQUENCES,
            "Most sequences one generate request may ask for (prompts in a batch x n); more is a 400.",
        ),
    )
    request_max_logprobs: int = flag(
        64,
        integer(
            0,
            MAX_REQUEST_LOGPROBS,
            "Most top log probabilities per position (top_logprobs_num, OpenAI logprobs / "
            "top_logprobs) and token_ids_logprob ids one request may ask for; more is a 400.",
        ),
    )

    def __post_init__(self) -> None:
        check_fields(self, _flag)
        if self.hot_set_policy != "off":
            check_hot_set_room(self.hot_set_budget, self.hot_set_sinks, self.hot_set_window, "--hot-set-")

    def storage_precision_thresholds(self) -> dict[str, Any]:
        """The graded thresholds: ``STORAGE_PRECISION_DEFAULTS`` overridden by the JSON flag.

        Raises:
            ValueError: naming ``--importance-storage-precision-config``, the key and what is allowed.
        """
        label = "--importance-storage-precision-config"
        values = dict(STORAGE_PRECISION_DEFAULTS)
        if self.storage_precision_config is None:
            return values
        import json

        try:
            given = json.loads(self.storage_precision_config)
        except (TypeError, ValueError):
            given = None
        if not isinstance(given, dict):
            raise invalid(f"{label} {self.storage_precision_config!r}", "a JSON object")
        unknown = sorted(set(given) - set(values))
        if unknown:
            raise ValueError(f"{label} has unknown keys {unknown}; allowed: {', '.join(values)}")
        values.update(given)
        for key in ("keep", "cold"):
            if not number_in(values[key], 0.0, 1.0):
                raise invalid(f"{label} {key}={values[key]!r}", "a fraction in [0, 1]")
        if values["keep"] + values["cold"] > 1.0:
            raise invalid(f"{label} keep + cold = {values['keep'] + values['cold']:g}", "<= 1")
        if not int_in(values["sink_pages"], 0, MAX_HOT_SET_SINKS):
            raise invalid(f"{label} sink_pages={values['sink_pages']!r}", f"an integer in [0, {MAX_HOT_SET_SINKS}]")
        if values["order"] not in STORAGE_PRECISION_ORDERS:
            raise invalid(f"{label} order={values['order']!r}", ", ".join(STORAGE_PRECISION_ORDERS))
        return values


def check_hot_set_room(budget: Any, sinks: int, window: int, prefix: str) -> None:
    """A hot set of ``budget`` pages must hold its sinks and window (a fraction grows with
    the request, so only a budget in pages is checked here).

    Raises:
        ValueError: naming ``{prefix}budget`` (a flag's or a request key's prefix).
    """
    if isinstance(budget, int) and budget < sinks + window:
        raise invalid(f"{prefix}budget {budget}", f"at least {prefix}sinks + {prefix}window = {sinks} + {window} pages")


def _flag(name: str) -> str:
    dashed = name.replace("_", "-")
    return f"--{dashed}" if name.startswith(("hot_set_", "request_")) else f"--importance-{dashed}"


# Flag name -> field name. One table so parser, namespace and docs agree.
FLAGS = {_flag(name): name for name in specs(ImportanceConfig)}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's flags to SGLang's argument parser."""
    add_arguments(parser.add_argument_group("sgl-importance"), ImportanceConfig, _flag)


def from_namespace(args: argparse.Namespace) -> ImportanceConfig:
    """Build the config from parsed arguments; absent flags keep defaults."""
    values = {}
    for option, name in FLAGS.items():
        dest = option[2:].replace("-", "_")
        if hasattr(args, dest):
            values[name] = getattr(args, dest)
    config = ImportanceConfig(**values)
    # Only the plugin's flags (a parser without SGLang's, as in tests): no backend to check.
    if hasattr(args, "attention_backend"):
        backend = args.decode_attention_backend or args.attention_backend
        if backend is not None:  # unset: the platform chooses; checked once chosen (runtime.py)
            check_hot_set_backend(config, backend)
    return config


def resolved_flag(server_args: Any, name: str) -> Any:
    """SGLang's flag ``name``: its field, or where that is unset what SGLang's resolution
    declared. SGLang 0.5.23 keeps the defaults the resolution declares (a platform's choice of
    attention backend among them) beside the field, which keeps what the user gave (None where
    nothing was): read the field alone and a server launched without ``--attention-backend``
    looks as if it had none."""
    value = getattr(server_args, name, None)
    if value is not None or getattr(server_args, "_resolved_overrides", None) is None:
        return value
    from sglang.srt.arg_groups.overrides import resolution_result

    return resolution_result(server_args, name)


def check_hot_set_backend(config: ImportanceConfig, backend: Optional[str]) -> None:
    """``--hot-set-policy`` other than ``off`` needs one of the plugin's decode backends.

    Args:
        config: the plugin's flags; backend: the decode attention backend.

    Raises:
        ValueError: naming the policy, the backends allowed and the one given.
    """
    if config.hot_set_policy != "off" and backend not in HOT_SET_BACKENDS:
        raise ValueError(
            f"--hot-set-policy {config.hot_set_policy} needs the decode attention backend "
            f"{' or '.join(HOT_SET_BACKENDS)} (--attention-backend or "
            f"--decode-attention-backend); got {backend!r}"
        )


def from_cli_args(original: Callable[..., Any], cls: Any, args: argparse.Namespace) -> Any:
    """Around ``ServerArgs.from_cli_args``: validate the flags before SGLang builds
    anything (a bad value stops start-up naming the flag, not later in a child
    process), then keep the config on the server args (the runtime reads it there)."""
    config = from_namespace(args)
    server_args = original(cls, args)
    server_args._importance = config
    return server_args
