"""A tiny production-format trace replayed through a real server under the ``credit`` form.

One server (the two-layer tiny Llama, ``importance_torch``, 16-token pages, a
512-token device pool) runs ``--radix-eviction-policy importance`` with
``{"form": "credit"}``; a generated Mooncake-format trace of 12 requests is replayed
by the benchmark's own client (``benchmark/hit_rate/live_replay.py``): conversation
X comes back three times early, two one-off prompts pass, conversation Y comes
back once, two more one-offs pass, and Y returns (11 requests). The per-request cached prompt tokens
the server reports must be the offline page model's for the same config, to the
token: the server's eviction order is the simulator's.

The trace is chosen so that on Y's return the page model tells the credit form
(192 tokens: Y's re-read history outlives the one-offs) from LRU, from a credit on
SGLang's raw ``hit_count`` (a fresh node counted as re-read) and from a credit
without the pool's turnover (X's older, more re-read history kept over Y's): each
of those keeps 16.
"""

from __future__ import annotations

import json

import pytest

from benchmark.hit_rate import page_model
from benchmark.hit_rate.live_replay import Loop, replay
from benchmark.hit_rate.production_trace import load_slice, write_mooncake
from sgl_importance.local_server import start_with_retry
from sgl_importance.sim.shipped import Shipped
from support.server import Server, importance_torch_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POOL = 512
CREDIT = {"form": "credit", "reuse_credit": 1.0}


def tiny_trace() -> list[dict]:
    """Mooncake rows: X x4 turns, 2 one-offs, Y x2, 2 one-offs, Y again (10-block bodies)."""
    rows, next_id = [], 1000

    def send(blocks: list[int]) -> None:
        nonlocal next_id
        # A partial last block of its own, as the trace's last block always is.
        rows.append({"timestamp": 1000 * len(rows), "input_length": 512 * len(blocks) + 200,
                     "output_length": 4, "hash_ids": [*blocks, next_id]})  # fmt: skip
        next_id += 1

    def one_off() -> None:
        nonlocal next_id
        body = list(range(next_id, next_id + 10))
        next_id += 10
        send([0, *body])

    x = [0, *range(1, 11)]
    for turn in range(4):
        x = [*x, 100 + turn]
        send(x)
    for _ in range(2):
        one_off()
    y = [0, *range(200, 210)]
    for turn in range(2):
        y = [*y, 300 + turn]
        send(y)
    for _ in range(2):
        one_off()
    send([*y, 302])
    return rows


@pytest.fixture(scope="module")
def replayed(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace")
    write_mooncake(folder / "trace.jsonl", tiny_trace())
    slice_ = load_slice(folder / "trace.jsonl", every=1, seed=0)
    args = importance_torch_args(
        16, POOL, "--radix-eviction-policy", "importance",
        "--radix-eviction-policy-config", json.dumps(CREDIT), "--enable-cache-report",
    )  # fmt: skip
    server = start_with_retry(lambda: Server(tiny_model, args, {}, folder / "server.log"))
    try:
        result = replay(server.url, slice_, Loop(), progress=False)
    finally:
        server.stop()
    return slice_, result


def test_the_server_caches_what_the_page_model_predicts_under_the_credit_form(replayed):
    slice_, result = replayed
    model = page_model.build(slice_, new_tokens=4)
    want = page_model.cached_tokens(model, Shipped(config=CREDIT), POOL).tolist()
    got = [row["cached"] for row in sorted(result.per_request, key=lambda row: row["i"])]
    assert result.failed == 0 and len(got) == 11
    assert got == want
    assert got[-1] == 192
    assert [row["device"] for row in result.per_request] == [row["cached"] for row in result.per_request]


def test_lru_on_the_same_nodes_would_have_lost_ys_history(replayed):
    slice_, _ = replayed
    model = page_model.build(slice_, new_tokens=4)
    assert page_model.cached_tokens(model, "lru", POOL).tolist()[-1] == 16
