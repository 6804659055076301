"""Long chat/agent sessions that come back: dense eviction vs the hot set, from one device pool.

``--sessions`` sessions of ``--turns`` turns run at once against a fresh
``python -m sglang.launch_server`` per arm (torch_cpu, ``importance_torch``, page 16,
HiCache's host pool, ``--enable-metrics``, ``--decode-log-interval 1``). Each session
has its own history, a distinct essay slice of ``--length`` tokens with a few planted
facts ("The access code for Alice is 1234.": names distinct within a session,
codes distinct across sessions) in its first 15 %.
Every turn re-sends the session's whole history so far, the earlier turns' questions
and greedy answers appended as in a chat, plus ``--facts-per-turn`` short questions,
each asking one planted fact (one request per question, sent at once; on a session's
first turn the first goes alone, so the uncached history is prefilled once, not once
per question). One thread per session, a session's turns one after another: the
device pool (``--device-tokens``, by default about two sessions' worth) is shared by
all of them, so a returning session finds its history on the host or the device.

Arms, each on a fresh server:

- ``lru``: dense with HiCache, ``--radix-eviction-policy lru``;
- ``importance``: dense, the project's ``--radix-eviction-policy importance``;
- ``hot-set-device``: importance eviction and the hot set (``--hot-set-policy
  importance --hot-set-budget 0.2``) with ``--hot-set-prefix device``: a running
  request's matched prefix stays resident on the device;
- ``hot-set-host``: the same with ``--hot-set-prefix host``: a running request holds
  its matched prefix in the host pool and brings back the pages its plan asks for;
- ``hot-set-seeded``: the same with ``--hot-set-first-step seeded``: a request's first
  decode step is planned from its prefill's last token, reading its hot set rather than
  every page (a history on the host, a streamed prompt) a second time.

**Equal memory**, as ``bench_capacity``: every arm gets the same ``--max-total-tokens``
(a hot-set server takes its pools, every device byte of its own, out of it); every arm
gets the same host pool,
``--hicache-ratio`` (default SGLang's 2) times dense's device pool (SGLang sizes it as a
ratio of the server's KV pool, so a hot-set server is given its own ratio; the table
gives both pools).

Per arm: the most sessions decoding at once (client side: a session with a request
between its first token and its last), the most requests decoding in one step (the
server log), turns per minute (wall, all sessions), TTFT (streamed ``/generate``: the first token of a turn's first
question) on first and on returning turns, decode tokens/s (the median of the
per-step rates SGLang logs), what the server moved host to device per turn (HiCache's
``sglang:load_back_tokens_total``, the hot set's pages copied in, its prefix pages
copied into a request's own pages and its pages read from their host copy) in tokens,
in this server's bytes and at a Llama-3.1-8B shape (128 KiB a token), the matched
prefix per turn (``meta_info.cached_tokens``: what a dense load-back brings back when
the whole history is on the host), the hot set's prefix pages lent and released, its
finished requests put back in the radix tree and left out of it (a history left out
is prefilled again on the session's next turn), and the fact answers: right, and of
those ``lru`` got right, how many the arm kept (the same question of the same session
and turn; a history holds the arm's own earlier answers, so the prompts may differ).
Writes RESULTS_sessions.md, rows.json (every answer) and sessions.png into --out and
prints the table.

    python -m benchmark.long_context.bench_sessions --out /tmp/bench_sessions
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import requests

from benchmark.long_context.bench_capacity import (
    KV_LINE,
    SGLANG_HICACHE_RATIO,
    decode_steps,
    host_ratio,
    model_shape,
    server_dtype,
)
from benchmark.long_context.bench_hot_set import NAMES, PAGE, essay_text
from sgl_importance.client import flush_cache, greedy, metrics_text
from sgl_importance.local_server import (
    HOST_MEMORY,
    PORT_CLASH,
    LocalServer,
    metric,
    model_path,
    start_with_retry,
)

ARMS = ("lru", "importance", "hot-set-device", "hot-set-host", "hot-set-seeded")
BUDGET = 0.2  # the README's hot set
FACT_DEPTHS = (0.02, 0.15)  # planted facts sit in this share of the history
QUESTION_ROOM = 32  # tokens a question takes, with margin (sizes the pool and the context check)
CONTEXT = 8192  # the embedded model's context
LLAMA_8B_TOKEN_BYTES = 2 * 32 * 8 * 128 * 2  # 32 layers, 8 KV heads, head dim 128, bf16: 128 KiB
HOST_LINE = re.compile(r"Allocating kv hierarchical KV host pool: (\d+) tokens")
KV_DTYPE_LINE = re.compile(r"KV Cache is allocated\. dtype: torch\.(\w+)")
# /metrics series read before and after the sessions (absent ones print "—"). SGLang
# shows its labelled load-back counter only from the first load-back on: absent is 0.
LOAD_BACK = "sglang:load_back_tokens_total"
HOT = "sgl_importance:hot_set_"
COPIED_IN = HOT + "pages_copied_in_total"
READ_FROM_HOST = HOT + "pages_read_from_host_total"  # summed over layers
MISSED = HOT + "pages_missed_total"  # pages the guard's selection wanted while released (not read)
ATTENDED = HOT + "pages_attended_total"  # pages the hot set read exactly, over layers
DENSE = HOT + "pages_dense_total"  # ... dense attention would have read
PREFIX_OWNED = HOT + "prefix_pages_owned_total"
PREFIX_LENT = HOT + "prefix_pages_lent_total"
PREFIX_RELEASED = HOT + "prefix_pages_released_total"
REINSERTED = HOT + "finished_reinserted_total"
UNCACHED = HOT + "finished_uncached_total"  # finished hot-set requests left out of the radix tree
ON_HOST = HOT + "finished_on_host_total"  # ... put into the tree host-only (no device room)
SERIES = (
    LOAD_BACK, COPIED_IN, READ_FROM_HOST, MISSED, ATTENDED, DENSE,
    PREFIX_OWNED, PREFIX_LENT, PREFIX_RELEASED, REINSERTED, ON_HOST, UNCACHED,
)  # fmt: skip


# --- the workload (pure) ---------------------------------------------------------------


def fact_sentence(name: str, code: str) -> str:
    return f" The access code for {name} is {code}. "


def fact_question(name: str) -> str:
    # The answer is primed: the 135M model completes a sentence far better than it
    # answers a question (a "Question: / Answer:" frame halved its hits in a trial).
    return f"\n\nWhat is the access code for {name}? The access code for {name} is"


def answered(text: str, code: str) -> bool:
    """Whether an answer holds the planted code."""
    return code in text


def make_facts(rng: random.Random, count: int, taken: set[str]) -> list[tuple[str, str]]:
    """``count`` (name, code) facts for one session: distinct names (not numbered
    vaults: the 135M model mixes up 100, 101, ...) and 4-digit codes not in ``taken``
    (which this fills), so no two facts of a run share a code."""
    if count > len(NAMES):
        raise ValueError(f"{count} facts per session; at most {len(NAMES)} (one per name)")
    facts = []
    for name in rng.sample(NAMES, count):
        code = str(rng.randrange(1000, 10000))
        while code in taken:
            code = str(rng.randrange(1000, 10000))
        taken.add(code)
        facts.append((name, code))
    return facts


def plant(hay: list[int], pieces: list[list[int]], depths: tuple[float, float] = FACT_DEPTHS) -> list[int]:
    """``hay`` with each of ``pieces`` inserted, spread evenly over the ``depths`` share
    of it (in order)."""
    lo, hi = depths
    n = len(pieces)
    out: list[int] = []
    last = 0
    for i, piece in enumerate(pieces):
        at = int((lo + (hi - lo) * (i + 0.5) / n) * len(hay))
        out += hay[last:at] + piece
        last = at
    return out + hay[last:]


def schedule(rng: random.Random, facts: list[tuple[str, str]], turns: int, per_turn: int) -> list[list[int]]:
    """Which facts (indices) each turn asks: every fact once, in a shuffled order."""
    order = list(range(len(facts)))
    rng.shuffle(order)
    return [order[t * per_turn : (t + 1) * per_turn] for t in range(turns)]


def build_sessions(
    filler: list[int],
    tokenize: Callable[[str], list[int]],
    sessions: int,
    turns: int,
    per_turn: int,
    length: int,
    seed: int = 0,
) -> list[dict]:
    """Each session's opening history (``length`` tokens: a distinct slice of
    ``filler`` with ``turns x per_turn`` facts planted early), its facts and, per turn,
    the facts asked with their question tokens."""
    rng = random.Random(seed)
    taken: set[str] = set()
    stride = (len(filler) - length) // max(sessions, 1)
    if stride < length:
        raise ValueError(f"the filler ({len(filler)} tokens) has no {sessions} distinct slices of {length}")
    out = []
    for s in range(sessions):
        facts = make_facts(rng, turns * per_turn, taken)
        pieces = [tokenize(fact_sentence(v, c)) for v, c in facts]
        body = length - sum(len(p) for p in pieces)
        history = plant(filler[s * stride : s * stride + body], pieces)
        asks = [
            [{"fact": i, "name": facts[i][0], "code": facts[i][1], "ids": tokenize(fact_question(facts[i][0]))}
             for i in turn]
            for turn in schedule(rng, facts, turns, per_turn)
        ]  # fmt: skip
        out.append({"session": s, "history": history, "facts": facts, "turns": asks})
    return out


def default_device_tokens(length: int, turns: int, per_turn: int, max_new: int) -> int:
    """About two sessions' worth of KV at their longest: 2.2 x (history + every turn's
    questions and answers), in whole pages."""
    longest = length + turns * per_turn * (QUESTION_ROOM + max_new)
    return math.ceil(2.2 * longest / PAGE) * PAGE


def model_kv_bytes(config: dict, dtype: str) -> int:
    """K and V of one token in every layer (``model_shape``'s)."""
    return model_shape(config, dtype).kv_bytes_per_page // PAGE


def arm_flags(arm: str, device_tokens: int) -> tuple[int, list[str]]:
    """``--max-total-tokens`` and the arm's own flags, at dense's bytes."""
    if arm == "lru":
        return device_tokens, ["--radix-eviction-policy", "lru"]
    if arm == "importance":
        return device_tokens, ["--radix-eviction-policy", "importance"]
    prefix = {"hot-set-device": "device", "hot-set-host": "host", "hot-set-seeded": "host"}[arm]
    hot = ["--hot-set-policy", "importance", "--hot-set-budget", str(BUDGET), "--hot-set-prefix", prefix]
    if arm == "hot-set-seeded":
        hot += ["--hot-set-first-step", "seeded"]
    return device_tokens, ["--radix-eviction-policy", "importance", *hot]


# --- one arm against a server ----------------------------------------------------------


def ask(url: str, ids: list[int], max_new: int, timeout: float = 7200) -> dict:
    """One streamed greedy ``/generate``: its answer, TTFT (send to the first chunk with
    a token), latency and the prompt tokens the cache matched."""
    start = time.time()
    first: Optional[float] = None
    last: dict = {}
    body = {"input_ids": ids, "sampling_params": greedy(max_new), "stream": True}
    with requests.post(url + "/generate", json=body, stream=True, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:"):
                continue
            payload = line[len(b"data:") :].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"/generate streamed an error: {chunk['error']}")
            if first is None and chunk.get("output_ids"):
                first = time.time()
            last = chunk
    meta = last.get("meta_info", {})
    end = time.time()
    return {
        "text": last.get("text", ""),
        "output_ids": last.get("output_ids", []),  # cumulative in each chunk
        "ttft": (first or end) - start,
        "latency": end - start,
        "decoding": [first or end, end],  # wall clock: first token to the last
        "cached": meta.get("cached_tokens", 0),
        "cached_details": meta.get("cached_tokens_details"),
    }


def run_session(url: str, session: dict, max_new: int) -> list[dict]:
    """A session's turns, one after another; a turn's questions at once. One row per question."""
    history = list(session["history"])
    rows = []
    with ThreadPoolExecutor(max(len(t) for t in session["turns"])) as pool:
        for t, questions in enumerate(session["turns"]):
            prompts = [history + q["ids"] for q in questions]
            started = time.time()
            if t == 0:
                # Nothing cached yet: prefill the history once, then the others find it.
                answers = [ask(url, prompts[0], max_new)]
                answers += list(pool.map(lambda p: ask(url, p, max_new), prompts[1:]))
            else:
                answers = list(pool.map(lambda p: ask(url, p, max_new), prompts))
            for j, (q, r) in enumerate(zip(questions, answers)):
                rows.append({
                    "session": session["session"], "turn": t, "question": j, "name": q["name"],
                    "code": q["code"], "correct": answered(r["text"], q["code"]), "prompt_tokens": len(prompts[j]),
                    "turn_s": time.time() - started, **r,
                })  # fmt: skip
                # The chat goes on: the question and the answer join the history.
                history += q["ids"] + r["output_ids"]
    return rows


def run_arm(arm: str, sessions: list[dict], a, out: Path) -> dict:
    tokens, extra = arm_flags(arm, a.device_tokens)
    args = [
        "--page-size", str(PAGE), "--attention-backend", "importance_torch", "--enable-hierarchical-cache",
        "--max-total-tokens", str(tokens), "--decode-log-interval", "1", "--enable-metrics", "--dtype", a.dtype,
        *extra,
    ]  # fmt: skip
    # The same host pool for every arm (the equal memory: KV + host + guard): SGLang
    # sizes it as a ratio of the KV pool, which beside a guard pool is the smaller.
    host_tokens = (a.hicache_ratio or SGLANG_HICACHE_RATIO) * a.device_tokens
    args += host_ratio(tokens, a.kv_shape, extra, host_tokens)
    log = out / f"server_{arm}.log"
    print(f"[{arm}] starting: --max-total-tokens {tokens} {' '.join(extra)}", flush=True)
    server = start_with_retry(
        lambda: LocalServer(model_path(), args, log), retry_on=(PORT_CLASH, HOST_MEMORY), pause_s=10, label=arm
    )
    try:
        warm = sessions[0]["history"][-64:]  # a prompt no session starts with
        ask(server.url, warm, 4)
        flush_cache(server.url).raise_for_status()
        before = metrics_text(server.url)
        mark = len(server.log())
        start = time.time()
        # Not a `with` block: on Ctrl-C it would wait for the requests in flight before
        # the server that would end them is stopped.
        pool = ThreadPoolExecutor(len(sessions))
        try:
            futures = [pool.submit(run_session, server.url, s, a.max_new) for s in sessions]
            rows = [r for f in futures for r in f.result()]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        wall = time.time() - start
        after = metrics_text(server.url)
        log_text = server.log()
    finally:
        server.stop()
    deltas = {name: (metric(after, name) - metric(before, name) if name in after else None) for name in SERIES}
    # Every counter at the end, to see where a column's bytes came from (guard reads, refusals, ...).
    (out / f"metrics_{arm}.txt").write_text(after)
    steps = decode_steps(log_text[mark:])
    kv = KV_LINE.search(log_text)
    host = HOST_LINE.search(log_text)
    dtype = KV_DTYPE_LINE.search(log_text)
    if host and abs(int(host.group(1)) - host_tokens) > 0.02 * host_tokens:
        # Equal memory needs equal host pools: the ratio was sized for a KV pool the server did not make.
        print(f"[{arm}] WARNING: host pool {host.group(1)} tokens, not {host_tokens:.0f}", flush=True)
    return {
        "arm": arm,
        "max_total_tokens": tokens,
        "kv_tokens": int(kv.group(1)) if kv else 0,
        "host_tokens": int(host.group(1)) if host else 0,
        "kv_dtype": dtype.group(1) if dtype else None,
        "wall_s": wall,
        "peak": max((n for n, _ in steps), default=0),
        "tps": statistics.median([rate for _, rate in steps] or [0.0]),
        "rows": rows,
        "deltas": deltas,
    }


# --- the report (pure) -----------------------------------------------------------------


def turn_firsts(rows: list[dict]) -> list[dict]:
    """Each turn's first question (the one sent at the turn's start)."""
    return [r for r in rows if r["question"] == 0]


def moved_tokens(deltas: dict, layers: int) -> dict[str, float]:
    """Tokens' worth of KV the server moved host to device, by route: HiCache load-back
    (prefetch included), hot-set pages copied in, lent prefix pages copied into a
    request's own pages, and pages read from their host copy (a count over layers, so
    divided by them)."""

    def d(name: str) -> float:
        return deltas.get(name) or 0.0

    return {
        "load_back": d(LOAD_BACK),
        "copied_in": d(COPIED_IN) * PAGE,
        "prefix_owned": d(PREFIX_OWNED) * PAGE,
        "host_reads": d(READ_FROM_HOST) * PAGE / layers,
    }


def fact_counts(rows: list[dict], dense: Optional[list[dict]]) -> tuple[int, int, Optional[tuple[int, int]]]:
    """(right, asked, (of dense's right: kept, dense's right) or None without dense)."""
    right = sum(r["correct"] for r in rows)
    if dense is None:
        return right, len(rows), None
    mine = {(r["session"], r["turn"], r["question"]): r["correct"] for r in rows}
    hits = [(r["session"], r["turn"], r["question"]) for r in dense if r["correct"]]
    return right, len(rows), (sum(mine.get(k, False) for k in hits), len(hits))


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarise(result: dict, dense: Optional[dict], token_bytes: int, layers: int) -> dict:
    """The table's numbers of one arm (``dense``: the ``lru`` arm's result, or None)."""
    if "error" in result:
        return {"arm": result["arm"], "error": result["error"]}
    rows = result["rows"]
    firsts = turn_firsts(rows)
    turns = len(firsts) or 1
    moved = moved_tokens(result["deltas"], layers)
    per_turn = sum(moved.values()) / turns
    right, asked, kept = fact_counts(rows, dense["rows"] if dense and "rows" in dense else None)
    returning = [r["ttft"] for r in firsts if r["turn"] > 0]
    return {
        "arm": result["arm"],
        "max_total_tokens": result["max_total_tokens"],
        "kv_tokens": result["kv_tokens"],
        "host_tokens": result["host_tokens"],
        "peak": result["peak"],
        "turns_per_min": turns / (result["wall_s"] / 60) if result["wall_s"] else 0.0,
        "ttft_first": _median([r["ttft"] for r in firsts if r["turn"] == 0]),
        "ttft_return": _median(returning),
        "ttft_return_max": max(returning, default=None),
        "tps": result["tps"],
        "moved": {k: v / turns for k, v in moved.items()},
        "moved_tokens": per_turn,
        "moved_bytes": per_turn * token_bytes,
        "moved_llama": per_turn * LLAMA_8B_TOKEN_BYTES,
        # What a dense load-back of the whole matched history would bring per turn.
        "matched": sum(r["cached"] for r in firsts) / turns,
        "matched_host": sum((r["cached_details"] or {}).get("host", 0) for r in firsts) / turns,
        "lent": result["deltas"].get(PREFIX_LENT),
        "released": result["deltas"].get(PREFIX_RELEASED),
        "reinserted": result["deltas"].get(REINSERTED),
        "uncached": result["deltas"].get(UNCACHED),
        "on_host": result["deltas"].get(ON_HOST),
        # Where the host reads come from, and how much of dense's reading the hot set did.
        "missed": _share(result["deltas"].get(MISSED), result["deltas"].get(DENSE)),
        "attended": _share(result["deltas"].get(ATTENDED), result["deltas"].get(DENSE)),
        "sessions_at_once": sessions_decoding_at_once(result["rows"]),
        "right": right,
        "asked": asked,
        "kept": kept,
    }


def sessions_decoding_at_once(rows: list[dict]) -> int:
    """The most sessions with a request between its first token and its last at one time."""
    events = []
    for session in {r["session"] for r in rows}:
        spans = sorted(tuple(r["decoding"]) for r in rows if r["session"] == session)
        merged: list[list[float]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            events += [(lo, 1), (hi, -1)]
    best = now = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        now += step
        best = max(best, now)
    return best


def _share(part: Optional[float], whole: Optional[float]) -> Optional[float]:
    return part / whole if part is not None and whole else None


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def _s(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}"


def _count(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.0f}"


HEADER = (
    "| arm | --max-total-tokens (KV pool / host pool) | sessions decoding at once | most requests decoding at once "
    "| turns / min "
    "| TTFT s, first turn (median) | TTFT s, returning turns (median / max) | decode tok/s (median step) "
    "| host→device per turn, tokens: load-back + hot set in + prefix owned + host reads "
    "| host→device per turn, MiB: this server / Llama-3.1-8B shape "
    "| matched prefix per turn (a dense load-back), tokens (of them on the host) / Llama-8B MiB "
    "| misses (pages wanted while released) / dense's pages | pages attended / dense's "
    "| prefix pages lent / released | hot-set requests finished: back in the tree / on the host / left out "
    "| fact answers right | of lru's right, kept |"
)


def format_table(summaries: list[dict]) -> str:
    """The markdown table, one row per arm (a failed arm says why)."""
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for s in summaries:
        if "error" in s:
            lines.append(f"| {s['arm']} | failed: {s['error']} |" + " |" * (HEADER.count(" | ") - 1))
            continue
        m = s["moved"]
        route = " + ".join(f"{m[k]:.0f}" for k in ("load_back", "copied_in", "prefix_owned", "host_reads"))
        kept = f"{s['kept'][0]}/{s['kept'][1]}" if s["kept"] else "—"
        cells = (
            s["arm"],
            f"{s['max_total_tokens']} ({s['kv_tokens']} / {s['host_tokens']})",
            s["sessions_at_once"],
            s["peak"],
            f"{s['turns_per_min']:.2f}",
            _s(s["ttft_first"]),
            f"{_s(s['ttft_return'])} / {_s(s['ttft_return_max'])}",
            f"{s['tps']:.1f}",
            f"{s['moved_tokens']:.0f} = {route}",
            f"{_mib(s['moved_bytes'])} / {_mib(s['moved_llama'])}",
            f"{s['matched']:.0f} ({s['matched_host']:.0f}) / {_mib(s['matched'] * LLAMA_8B_TOKEN_BYTES)}",
            _pct(s["missed"]),
            _pct(s["attended"]),
            f"{_count(s['lent'])} / {_count(s['released'])}",
            f"{_count(s['reinserted'])} / {_count(s['on_host'])} / {_count(s['uncached'])}",
            f"{s['right']}/{s['asked']}",
            kept,
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=4, help="sessions at once, one thread each")
    p.add_argument("--turns", type=int, default=3, help="turns per session, one after another")
    p.add_argument("--facts-per-turn", type=int, default=2, help="fact questions per turn, sent at once")
    p.add_argument("--length", type=int, default=6500, help="tokens of each session's opening history")
    p.add_argument("--max-new", type=int, default=24, help="greedy tokens per answer")
    p.add_argument("--device-tokens", type=int, default=0, help="dense's --max-total-tokens (0: ~two sessions)")
    p.add_argument(
        "--hicache-ratio",
        type=float,
        default=0.0,
        help="every arm's host pool over dense's device pool (0: SGLang's default, 2)",
    )
    p.add_argument("--arms", default=",".join(ARMS), help=f"from {', '.join(ARMS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="every server's --dtype (auto: bfloat16 where the CPU has it)")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench_sessions_")))
    a = p.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    if unknown := [x for x in arms if x not in ARMS]:
        p.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    if min(a.sessions, a.turns, a.facts_per_turn, a.max_new) < 1:
        p.error("--sessions, --turns, --facts-per-turn and --max-new must be at least 1")
    longest = a.length + a.turns * a.facts_per_turn * (QUESTION_ROOM + a.max_new)
    if longest > CONTEXT:
        p.error(f"a session grows to ~{longest} tokens, past the model's context of {CONTEXT}")
    a.device_tokens = a.device_tokens or default_device_tokens(a.length, a.turns, a.facts_per_turn, a.max_new)
    a.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    model = model_path()
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = json.loads((Path(model) / "config.json").read_text())
    a.kv_shape = model_shape(config, server_dtype(config, a.dtype))  # the torch_cpu server's KV

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    sessions = build_sessions(tokenize(essay_text()), tokenize, a.sessions, a.turns, a.facts_per_turn, a.length, a.seed)
    started = time.time()
    results = []
    for arm in arms:
        try:
            results.append(run_arm(arm, sessions, a, a.out))
        except Exception as e:  # one arm failing (e.g. a flag this server lacks) leaves the others
            traceback.print_exc()
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            results.append({"arm": arm, "error": last[:200]})
        print(f"[{arm}] done, {(time.time() - started) / 60:.1f} min so far", flush=True)
    write_results(results, config, a, (time.time() - started) / 60, a.out)


def write_results(results: list[dict], config: dict, a, minutes: float, out: Path) -> None:
    dtype = next((r["kv_dtype"] for r in results if r.get("kv_dtype")), None) or config.get("dtype", "bfloat16")
    token_bytes = model_kv_bytes(config, dtype)
    dense = next((r for r in results if r["arm"] == "lru" and "rows" in r), None)
    summaries = [summarise(r, dense, token_bytes, config["num_hidden_layers"]) for r in results]
    table = format_table(summaries)
    command = "python -m benchmark.long_context.bench_sessions " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    questions = a.sessions * a.turns * a.facts_per_turn
    host = (a.hicache_ratio or SGLANG_HICACHE_RATIO) * a.device_tokens
    text = (
        "# Sessions that come back: dense eviction vs the hot set (bench_sessions.py)\n\n"
        f"Command (took {minutes:.0f} min):\n\n```\n{command}\n```\n\n"
        f"{a.sessions} sessions at once, {a.turns} turns each, {a.facts_per_turn} fact questions a turn "
        f"({questions} per arm), opening histories of {a.length} tokens, {a.max_new} greedy tokens per answer. "
        f"--max-total-tokens {a.device_tokens} for every arm ({a.device_tokens // PAGE} pages of {PAGE}; a "
        f"hot-set server takes its pools out of it itself); every arm's HiCache host pool {host:.0f} tokens "
        f"(each server's own --hicache-ratio over its KV pool). KV bytes per token: {token_bytes:,} for this "
        f"server ({dtype}), {LLAMA_8B_TOKEN_BYTES:,} at a Llama-3.1-8B shape (32 layers, 8 KV heads, head dim "
        "128, bf16).\n\n"
        f"Series (deltas over the sessions): `{LOAD_BACK}` (HiCache load-back, prefetch included), "
        f"`{COPIED_IN}` × {PAGE}, `{PREFIX_OWNED}` × {PAGE}, `{READ_FROM_HOST}` × {PAGE} / layers; "
        f"`{PREFIX_LENT}`, `{PREFIX_RELEASED}`, `{REINSERTED}`, `{ON_HOST}`, `{UNCACHED}` "
        "(— where the server has no such "
        "series; SGLang's load-back series appears at its first load-back, so absent counts 0). TTFT: a turn's first "
        "question, streamed, send to the first token (first turns include the history's prefill). The matched "
        "prefix is that question's `meta_info.cached_tokens`, averaged over every turn (a first turn matches "
        "nothing).\n\n"
        f"{table}\n"
    )
    (out / "RESULTS_sessions.md").write_text(text)
    (out / "rows.json").write_text(json.dumps(results, indent=1))
    print(text)
    plot([s for s in summaries if "error" not in s], a, out / "sessions.png")


def plot(summaries: list[dict], a, path: Path) -> None:
    if not summaries:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["arm"] for s in summaries]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    axes[0].bar(names, [s["peak"] for s in summaries])
    axes[0].set_ylabel("requests decoding at once")
    axes[1].bar(names, [s["turns_per_min"] for s in summaries])
    axes[1].set_ylabel("turns / min")
    x = range(len(names))
    axes[2].bar([i - 0.2 for i in x], [s["moved_llama"] / 2**20 for s in summaries], 0.4, label="moved")
    axes[2].bar(
        [i + 0.2 for i in x], [s["matched"] * LLAMA_8B_TOKEN_BYTES / 2**20 for s in summaries], 0.4,
        label="dense load-back of the match",
    )  # fmt: skip
    axes[2].set_xticks(list(x), names)
    axes[2].set_ylabel("host→device MiB/turn (Llama-8B)")
    axes[2].legend(fontsize=7)
    axes[3].bar(names, [s["right"] / s["asked"] if s["asked"] else 0 for s in summaries])
    axes[3].set_ylim(0, 1)
    axes[3].set_ylabel("fact answers right")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(
        f"{a.sessions} sessions x {a.turns} turns, histories of {a.length}, dense pool {a.device_tokens} tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
