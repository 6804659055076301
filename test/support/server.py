"""The server the e2e tests start, and the calls most of them make on it.

Starting, stopping and the requests themselves are ``sgl_importance.local_server``
and ``sgl_importance.client``, shared with the benchmarks and scripts; what is here
is the tests' own shape of them (the fixtures are in ``test/conftest.py``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from sgl_importance.client import generate, greedy
from sgl_importance.env import CHECKS_ENV
from sgl_importance.local_server import LocalServer

# Forces every server the suite starts to one --dtype (docs/testing.md), unless the test
# pins its own: "bfloat16" or "float32". Unset: torch_cpu's own pick (bfloat16 where the CPU
# has it natively, else float32).
TEST_DTYPE_ENV = "SGL_IMPORTANCE_TEST_DTYPE"


def with_test_dtype(args: list[str]) -> list[str]:
    """``args`` with the suite's forced ``--dtype``, where one is set and the test set none."""
    dtype = os.environ.get(TEST_DTYPE_ENV)
    if not dtype or "--dtype" in args:
        return args
    return [*args, "--dtype", dtype]


class Server(LocalServer):
    """``python -m sglang.launch_server`` on torch_cpu (``sgl_importance.local_server``),
    plus greedy ``/generate`` calls."""

    def __init__(self, model_path: str, args: list[str], env: dict[str, str], log: Path):
        # The suite's invariant checks, on in every server it starts (docs/testing.md).
        super().__init__(model_path, with_test_dtype(list(args)), log, {CHECKS_ENV: "1", **env})
        self._sent: Counter[str] = Counter()

    def rid(self, prompt: object) -> str:
        """A rid for the next request of ``prompt`` (text or token ids): the prompt's hash and
        how many times this server was sent it before. The hot set's page sample is seeded
        by the rid (``hot_set/plan/sample.py``); random rids made a guarded test's tokens a draw
        per run, these make them the same every run (distinct prompts sent at once included)."""
        digest = hashlib.blake2b(repr(prompt).encode(), digest_size=6).hexdigest()
        n, self._sent[digest] = self._sent[digest], self._sent[digest] + 1
        return f"test-{digest}-{n}"

    def generate(self, text: str, max_new_tokens: int = 8, **extra) -> dict:
        """Greedy /generate of ``text`` with logprobs and the cache report."""
        body = {"return_logprob": True, "return_cached_tokens_details": True, "rid": self.rid(text), **extra}
        return generate(self.url, text=text, sampling_params=greedy(max_new_tokens), **body)


def generate_ids(server: Server, input_ids: list[int], max_new_tokens: int, timeout: float = 300) -> dict:
    """Greedy /generate of exact token ids, with the cache report."""
    return generate(
        server.url,
        input_ids=input_ids,
        sampling_params=greedy(max_new_tokens),
        return_cached_tokens_details=True,
        timeout=timeout,
        rid=server.rid(input_ids),
    )


def importance_torch_args(page: int, device_tokens: int, *more: str) -> list[str]:
    """Launcher flags most e2e servers share: pages of ``page`` tokens, a device pool
    of ``device_tokens`` and the ``importance_torch`` backend, then ``more``."""
    return [
        "--page-size", str(page),
        "--max-total-tokens", str(device_tokens),
        "--attention-backend", "importance_torch",
        *more,
    ]  # fmt: skip


def output_ids_and_logprobs(response: dict) -> tuple[list[int], list[float]]:
    meta = response["meta_info"]
    return response["output_ids"], [entry[0] for entry in meta["output_token_logprobs"]]


def greedy_with_prompt_logprobs(url: str, input_ids: list[int], max_new_tokens: int, rid: str, start: int = 0) -> dict:
    """A greedy request returning the logprob of every prompt token from ``start`` (the prefill's
    output at each position: ``prompt_logprobs``), the rid pinned (a guarded hot set draws its
    page sample from it, so two servers decode alike)."""
    return generate(
        url,
        input_ids=input_ids,
        sampling_params=greedy(max_new_tokens),
        rid=rid,
        return_logprob=True,
        logprob_start_len=start,
        timeout=900,
    )


def prompt_logprobs(response: dict) -> list[float | None]:
    """The prompt tokens' logprobs of a response (None for the prompt's first token)."""
    return [entry[0] for entry in response["meta_info"]["input_token_logprobs"]]


def launch_and_fail(model_path: str, *args: str) -> str:
    """Run the launcher with invalid flags; return its output (it must exit non-zero)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, *args],
        env={**os.environ, "SGLANG_PLATFORM": "torch_cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, "server started despite an invalid flag"
    return proc.stdout + proc.stderr


# Top-two log-probabilities closer than this are a tie for a greedy check: a perturbation
# as small as a path's rounding (another kernel, a prefix read back before an extend,
# bfloat16) may pick either (docs/testing.md).
NEAR_TIE = 0.1


def generate_with_tops(server: Server, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
    """Greedy /generate of exact token ids with the cache report and each step's top two
    ``(logprob, id)`` under ``"tops"``."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, **extra.pop("sampling_params", {})}
    extra = {"rid": server.rid(input_ids), **extra}
    out = generate(
        server.url,
        input_ids=input_ids,
        sampling_params=sampling,
        return_logprob=True,
        top_logprobs_num=2,
        return_cached_tokens_details=True,
        timeout=900,
        **extra,
    )
    out["tops"] = [[(lp, tid) for lp, tid, _ in step] for step in out["meta_info"]["output_top_logprobs"]]
    return out


def departure(got: list[int], want: list[int], tops: list[list[tuple[float, int]]]) -> str | None:
    """Where greedy tokens ``got`` leave ``want`` at a step where ``want``'s run chose clearly
    (its top two ``tops`` apart by ``NEAR_TIE`` or more), said in words; None if they never
    do. At the first near-tie either tied token is right, and the two may part there."""
    for step, (g, w, top) in enumerate(zip(got, want, tops)):
        if top[0][0] - top[1][0] < NEAR_TIE:
            return None if g in (top[0][1], top[1][1]) else f"step {step}: {g} is neither of the tied {top}"
        if g != w:
            return f"step {step}: {got} vs {want}"
    return None if len(got) == len(want) else f"lengths differ: {got} vs {want}"


def follows_until_a_near_tie(got: list[int], want: list[int], tops: list[list[tuple[float, int]]]) -> bool:
    """Whether ``got`` follows ``want`` until ``want``'s first near-tie (``departure``)."""
    return departure(got, want, tops) is None


def assert_same_until_a_near_tie(got: list[int], want: list[int], tops: list[list[tuple[float, int]]]) -> None:
    """``got`` follows ``want`` until ``want``'s first near-tie (``departure``)."""
    reason = departure(got, want, tops)
    assert reason is None, reason
