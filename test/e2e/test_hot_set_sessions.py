"""A returning session's matched prefix held on the host while it decodes.

Two servers, one after the other, alike but for ``--hot-set-prefix``: ``device`` (the whole
matched prefix stays on the device) and ``host``. Both run the importance hot set (guard on,
20 % of a request's pages) on the embedded model with 16-token pages, HiCache's host pool,
``file`` storage and ``--radix-eviction-policy importance`` (the Python tree core the host
hold needs). Each serves one session: a first turn of ~600 tokens; then a long returning
turn (the history plus a question, 160 new tokens) and, once it holds the prefix on the
host, a ~2,000-token unrelated prompt that needs the device pages the prefix leaves and a
second returning turn sharing the prefix, which on the ``host`` server finds it in the
host pool while the first still decodes from it (and reads it from there, never loading it
back whole: ``scheduler/returning.py``); then ``/flush_cache`` (device and host emptied: the history is only in
the file tier) and a third turn that brings it back from storage. Prefill reads every page
exactly wherever it lives, so each answer's first token must be the same on both servers;
after it they may part by design: a prefix page held on the host that a layer's selection
wants is a miss (not read inside the layer, promoted later), where the ``device`` server
reads it (issue 46). The ``host`` server must count the prefix pages it lent, left on the
host and took back, and its guard must still check the resumed requests' layers.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_importance.client import flush_cache, generate, metrics_text
from sgl_importance.local_server import metric
from support.prompts import essay_text
from support.server import generate_ids
from support.storage import settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
FIRST_TURN = 600
QUESTION = 40
MAX_NEW = 8
LONG_NEW = 160  # the first returning turn decodes while the others arrive
FILLER = 2000
# Float32 pinned: the first tokens must be the same on two servers whose prefixes reach
# attention by different paths (device, host, storage), and the pools are sized for float32's
# bytes per token (bfloat16 changes what the guard's share leaves the KV pool).
ARGS = [
    "--dtype", "float32",
    "--page-size", str(PAGE), "--attention-backend", "importance_torch",
    "--radix-eviction-policy", "importance", "--enable-hierarchical-cache", "--hicache-ratio", "4",
    # A 2,576-token KV pool (the hot set's key codes and ranges borrow their rows from it):
    # room for the 2,000-token prompt beside a decoding turn, not for the held prefix too.
    "--hicache-storage-backend", "file", "--max-total-tokens", "2576", "--enable-metrics",
    "--hot-set-policy", "importance", "--hot-set-budget", "0.2", "--hot-set-threshold", "256",
    # The third turn's storage hit must not depend on how busy the machine is (best_effort may admit first).
    "--hicache-storage-prefetch-policy", "wait_complete",
]  # fmt: skip
COUNTERS = (
    "prefix_pages_lent",
    "prefix_pages_released",
    "prefix_pages_owned",
    "prefix_holds",
    "guard_checks",
    "history_pages_on_host",
)


@pytest.fixture(scope="module")
def session(token_ids):
    ids = token_ids(essay_text(4), FIRST_TURN + 4 * QUESTION + FILLER)
    questions = [ids[FIRST_TURN + i * QUESTION : FIRST_TURN + (i + 1) * QUESTION] for i in range(3)]
    return ids[:FIRST_TURN], questions, ids[-FILLER:]


def counters(server) -> dict[str, float]:
    text = metrics_text(server.url)
    return {name: metric(text, f"sgl_importance:hot_set_{name}_total") for name in COUNTERS}


def run_session(launch, tmp_path_factory, session, residence: str) -> dict:
    """The session's turns on a fresh server; their answers, cache reports and counters."""
    storage = tmp_path_factory.mktemp(f"hicache_{residence}")
    server = launch(
        [*ARGS, "--hot-set-prefix", residence], env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)}
    )
    history, questions, filler = session
    first = generate_ids(server, history, MAX_NEW, timeout=900)
    history = history + first["output_ids"]
    done: dict[str, float] = {}

    def long_turn() -> dict:
        out = generate(
            server.url,
            input_ids=history + questions[0],
            # Guard off for this turn: guarded, its hot set grows toward the whole request by
            # its selections' misses (residency follows the guard), and the unrelated prompt
            # would wait for the room; this test is about the prefix it holds on the host.
            sampling_params={
                "max_new_tokens": LONG_NEW,
                "temperature": 0,
                "ignore_eos": True,
                "custom_params": {"hot_set": {"guard_threshold": 1.0}},
            },
            return_cached_tokens_details=True,
            timeout=900,
        )
        done["long"] = time.monotonic()
        return out

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_turn)
        if residence == "host":
            # Its device lock on the prefix goes a few steps into its decode.
            deadline = time.monotonic() + 300
            while counters(server)["prefix_holds"] < 1 and not running.done() and time.monotonic() < deadline:
                time.sleep(0.5)
        generate_ids(server, filler, 1, timeout=900)
        second = generate_ids(server, history + questions[1], MAX_NEW, timeout=900)
        done["second"] = time.monotonic()
        both = [running.result(), second]
    before_storage = counters(server)
    assert settled(storage), "nothing was written to the file tier"
    assert flush_cache(server.url).status_code == 200
    third = generate_ids(server, history + questions[2], MAX_NEW, timeout=900)
    # Page moves are counted at the next decode step: one more short request folds them.
    generate_ids(server, history[:64], 2, timeout=300)
    after = counters(server)
    server.stop()
    return {
        "answers": [first["output_ids"], *(r["output_ids"] for r in both), third["output_ids"]],
        "cached": [r["meta_info"]["cached_tokens_details"] for r in (*both, third)],
        "before_storage": before_storage,
        "after": after,
        "second_while_long_ran": done["second"] < done["long"],
    }


@pytest.fixture(scope="module")
def on_device(launch, tmp_path_factory, session):
    return run_session(launch, tmp_path_factory, session, "device")


@pytest.fixture(scope="module")
def on_host(launch, tmp_path_factory, session, on_device):  # one server at a time
    return run_session(launch, tmp_path_factory, session, "host")


def test_a_prefix_held_on_the_host_by_a_running_request_is_matched_by_another(on_device, on_host):
    # The long turn matched the first turn's history on the device.
    assert on_host["cached"][0]["device"] >= FIRST_TURN - PAGE, on_host["cached"][0]
    # The unrelated prompt took the device pages the held prefix left: the second turn,
    # sent while the long one still decoded, found the prefix in the host pool (the long
    # turn's host lock kept it there).
    assert on_host["second_while_long_ran"]
    assert on_host["cached"][1]["host"] > 0, on_host["cached"][1]
    assert [a[:1] for a in on_host["answers"]] == [a[:1] for a in on_device["answers"]]
    lent = on_host["before_storage"]
    # Both returning turns held the shared prefix on the host (~38 pages each), left most
    # of it there and copied in only what their plans kept.
    assert lent["prefix_holds"] >= 2 and lent["prefix_pages_lent"] >= 2 * (FIRST_TURN // PAGE)
    assert lent["prefix_pages_released"] > lent["prefix_pages_owned"] > 0
    # The second turn read the history it found in the host pool from there (never loaded
    # back whole), and its first token is the device server's, which loaded it back.
    assert lent["history_pages_on_host"] > 0
    assert on_device["after"]["prefix_pages_lent"] == on_device["after"]["history_pages_on_host"] == 0


def test_a_prefix_back_from_file_storage_is_held_on_the_host_again(on_device, on_host):
    details = on_host["cached"][2]
    assert details["storage"] > 0 and details["device"] == 0, details
    assert on_host["answers"][3][:1] == on_device["answers"][3][:1]
    grew = {k: on_host["after"][k] - on_host["before_storage"][k] for k in COUNTERS}
    # Storage brought it into the host pool; the turn read it from there, not loaded back.
    assert grew["prefix_holds"] >= 1 and grew["history_pages_on_host"] >= FIRST_TURN // PAGE - 1, grew


def test_the_guard_still_checks_a_resumed_request(on_device, on_host):
    # The guard bounded the resumed requests' layers on both servers, the same number of
    # times: reading a page from the tree's host copy changes nothing it checks.
    assert on_host["after"]["guard_checks"] > 0
    assert on_host["after"]["guard_checks"] == on_device["after"]["guard_checks"]
