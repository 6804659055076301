"""Greedy tokens of a running server against a recorded reference (the tiny model's).

``--record`` asks the server for each prompt's greedy continuation with the top-2
logprobs and writes REFERENCE.json; without it the same requests go to the server and
its answers are compared with the file: equal token ids (or the first index where they
part), and the largest |logprob difference| of the chosen tokens over the common
prefix. Exit status 0 when every prompt's ids are equal.

The prompts are sent as token ids (recorded from the recording server's own
tokenizer), so the comparison does not depend on the tokenizer or on
``--skip-tokenizer-init``. Only the standard library is used: the script runs on a
machine where nothing but SGLang is installed.

Usage::

    python scripts/compare_greedy.py REFERENCE.json --url http://127.0.0.1:30000
    python scripts/compare_greedy.py REFERENCE.json --url URL --record --model-dir DIR --server-command "..."
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
)
# ignore_eos: a reference cut short by an end-of-sequence token would compare fewer tokens.
SAMPLING = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}


def post_generate(url: str, body: dict[str, Any], timeout: float = 300) -> dict:
    """POST ``body`` to ``url/generate``; the response's JSON."""
    request = urllib.request.Request(
        url.rstrip("/") + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def greedy_body(prompt: str | list[int], sampling: dict[str, Any]) -> dict[str, Any]:
    """A greedy /generate body with the top-2 logprobs of every output token."""
    source = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
    return {**source, "sampling_params": sampling, "return_logprob": True, "top_logprobs_num": 2}


def read_answer(response: dict) -> dict[str, list]:
    """Output ids, the chosen tokens' logprobs and the runner-ups' (id and logprob)."""
    meta = response["meta_info"]
    top = meta["output_top_logprobs"]
    return {
        "output_ids": [entry[1] for entry in meta["output_token_logprobs"]],
        "chosen_logprobs": [entry[0] for entry in meta["output_token_logprobs"]],
        "runner_up_ids": [pair[1][1] for pair in top],
        "runner_up_logprobs": [pair[1][0] for pair in top],
    }


def record(url: str, model: dict, server_command: str, prompts: tuple[str, ...] = PROMPTS) -> dict:
    """The reference: each prompt's ids (as the server tokenised it) and greedy answer."""
    entries = []
    for text in prompts:
        # logprob_start_len 0 returns the prompt's tokens: the ids the server itself used.
        body = {**greedy_body(text, SAMPLING), "logprob_start_len": 0}
        response = post_generate(url, body)
        input_ids = [entry[1] for entry in response["meta_info"]["input_token_logprobs"]]
        answer = read_answer(post_generate(url, greedy_body(input_ids, SAMPLING)))
        entries.append({"text": text, "input_ids": input_ids, **answer})
    return {"model": model, "server_command": server_command, "sampling_params": SAMPLING, "prompts": entries}


def margins(reference: dict) -> list[float]:
    """Top-1 minus top-2 logprob of every recorded output token."""
    return [
        chosen - runner_up
        for entry in reference["prompts"]
        for chosen, runner_up in zip(entry["chosen_logprobs"], entry["runner_up_logprobs"])
    ]


@dataclass
class PromptResult:
    text: str
    equal: bool
    first_difference: int | None  # index into the output tokens; None when equal
    max_logprob_diff: float  # over the common prefix, chosen tokens


def compare(reference: dict, url: str) -> list[PromptResult]:
    """Send the reference's requests to ``url``; how each answer matches."""
    results = []
    for entry in reference["prompts"]:
        got = read_answer(post_generate(url, greedy_body(entry["input_ids"], reference["sampling_params"])))
        want_ids, got_ids = entry["output_ids"], got["output_ids"]
        first = next((i for i, (a, b) in enumerate(zip(want_ids, got_ids)) if a != b), None)
        if first is None and len(want_ids) != len(got_ids):
            first = min(len(want_ids), len(got_ids))
        prefix = len(want_ids) if first is None else first
        diffs = [abs(a - b) for a, b in zip(entry["chosen_logprobs"][:prefix], got["chosen_logprobs"][:prefix])]
        results.append(PromptResult(entry["text"], first is None, first, max(diffs, default=0.0)))
    return results


def _model_marker(model_dir: Path) -> dict:
    return json.loads((model_dir / "made.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--record", action="store_true", help="write REFERENCE from the server instead of comparing")
    parser.add_argument("--model-dir", type=Path, help="the served model folder (its made.json names the weights)")
    parser.add_argument("--server-command", default="", help="with --record: the server's command line, kept")
    args = parser.parse_args(argv)

    if args.record:
        if args.model_dir is None:
            parser.error("--record needs --model-dir")
        reference = record(args.url, _model_marker(args.model_dir), args.server_command)
        args.reference.write_text(json.dumps(reference, indent=1) + "\n")
        found = sorted(margins(reference))
        print(f"wrote {args.reference}: margin median {found[len(found) // 2]:.2f}, min {found[0]:.2f}")
        return 0

    reference = json.loads(args.reference.read_text())
    if args.model_dir is not None:
        served = _model_marker(args.model_dir)["tensor_sha256"]
        if served != reference["model"]["tensor_sha256"]:
            print(f"error: {args.model_dir} holds weights {served}, the reference was made with {reference['model']}")
            return 2
    results = compare(reference, args.url)
    for r in results:
        where = "" if r.equal else f" (first difference at output token {r.first_difference})"
        print(f"{r.text!r}: equal ids {'yes' if r.equal else 'no'}{where}, max |logprob diff| {r.max_logprob_diff:.2e}")
    return 0 if all(r.equal for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
