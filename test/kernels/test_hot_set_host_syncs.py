"""Issue 34's targets, held in CI: host round trips along a hot-set decode step.

The plugin's real backends (``importance_torch``, and ``importance_triton`` with its
kernels under Triton's interpreter) decode a short request beside two long ones in the
test world, every call that would make a GPU wait on the host counted
(``support/counted_world.py``, ``support/host_syncs.py``).

- **Per layer, 0** — on every tensor (the counter's upper bound: on a CPU a host
  tensor cannot be told from a device one, so nothing is excused): with the guard off,
  both backends, pages released to the host pool or not; with the guard on, both
  backends with the rest on the device. Not 0, by design (``hot_set/guard_reads.py``):
  a guarded layer whose rest pages were released plans each of the guard's rounds on
  the host (a read back per round).
- **Per step, at most 1**, device view (tensors that would live on the GPU), guard off:
  the Triton backend, the GPU's, reads the layers' tally back once where the step ends
  (packed); where it starts it reads nothing (lengths from the host, slots gathered
  where they live) unless the batch changed, when it reads the rows' indices once.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")
pytest.importorskip("sglang", reason="the backends subclass SGLang's")

from sgl_importance.hot_set import HotSetParams  # noqa: E402
from support.counted_world import END, START, counted_decode  # noqa: E402
from support.host_syncs import LAUNCH, SYNC_KINDS  # noqa: E402
from support.hot_set_world import DIM, KV_HEADS, PAGE, Q_HEADS, parents_metadata  # noqa: E402
from support.kernel_device import EMPTY_PAGES_WARN  # noqa: E402

pytestmark = [EMPTY_PAGES_WARN]

LAYERS = 3
STEPS = 2
# The guarded cases are slow (8-12 s under the interpreter): make test runs them, test-fast not.
SLOW = pytest.mark.slow


@pytest.fixture(autouse=True)
def _parents_metadata():
    with parents_metadata():
        yield


def _count(backend: str, *, guard: float, release: bool):
    params = HotSetParams(policy="importance", budget=0.2, window=1, sinks=1, guard_threshold=guard)
    counter, _ = counted_decode(
        backend, params, release=release, lengths=[5, 120, 180], layers=LAYERS, steps=STEPS, warmup=2
    )
    return counter


def _sites(counter, **match) -> str:
    """The counted calls of ``match`` by site, for the failure message."""
    events = {e: n for e, n in counter.counted(device_only=match.pop("device_only", False)).items()}
    return ", ".join(
        f"{e.site} {e.kind} x{n}"
        for e, n in events.items()
        if all(str(getattr(e, k)) == str(v) for k, v in match.items())
    )


@pytest.mark.parametrize(
    "backend, release, guard",
    [
        ("torch", False, 1.0),
        ("torch", True, 1.0),
        ("triton", False, 1.0),
        ("triton", True, 1.0),
        pytest.param("torch", False, 0.1, marks=SLOW),
        pytest.param("triton", False, 0.1, marks=SLOW),
    ],
    ids=[
        "torch-resident",
        "torch-released",
        "triton-resident",
        "triton-released",
        "torch-resident-guard",
        "triton-resident-guard",
    ],
)
def test_a_layer_never_waits_on_the_host(backend, release, guard):
    counter = _count(backend, guard=guard, release=release)
    for layer in range(LAYERS):
        assert counter.total(where=layer) == 0, _sites(counter, where=layer)
    # The counts are there to be had: the step's start and end still read back.
    assert counter.total(where=START) + counter.total(where=END) > 0


def _by_function(counter, **match) -> dict:
    out: dict = {}
    for e, n in counter.counted(device_only=True).items():
        if e.kind in SYNC_KINDS and all(str(getattr(e, k)) == str(v) for k, v in match.items()):
            name = counter.functions[e.site]
            out[name] = out.get(name, 0) + n
    return out


@pytest.mark.parametrize("guard", [1.0, pytest.param(0.1, marks=SLOW)], ids=["guard-off", "guard-on"])
@pytest.mark.parametrize("release", [False, True], ids=["resident", "released"])
def test_the_triton_step_reads_back_once_where_it_ends_and_at_its_start_only_when_the_batch_changed(release, guard):
    counter = _count("triton", guard=guard, release=release)
    for step in range(STEPS):
        # The batch is the warm-up's: its rows are known, its lengths are the host's and
        # its slots are read where they live. The end reads the layers' tally back, packed.
        assert _by_function(counter, step=step, where=START) == {}
        assert _by_function(counter, step=step, where=END) == {"on_host": 1}


def test_a_batch_that_changed_reads_its_rows_back_once():
    params = HotSetParams(policy="importance", budget=0.2, window=1, sinks=1, guard_threshold=1.0)
    counter, world = counted_decode(
        "triton", params, release=False, lengths=[5, 120, 180], layers=LAYERS, steps=1, warmup=1
    )
    world.backend.hot_set.batch_changed()  # what an extend (a prefill) does
    counter.begin_step()
    kv = [torch.randn(LAYERS, 3, KV_HEADS, DIM) for _ in range(2)]
    world.step(*kv, torch.randn(LAYERS, 3, Q_HEADS, DIM), counter=counter)
    assert _by_function(counter, step=1, where=START) == {"_batch_slots": 1}


def test_a_triton_layer_issues_the_same_few_launches_whatever_the_batch():
    # On a GPU an eager hot-set step is launch-bound (benchmark/gpu/RESULTS.md): a layer
    # issues a fixed handful of device launches (the KV write, the page-list read, what the
    # tally keeps), none per request; the step's end reduces them.
    params = HotSetParams(policy="importance", budget=0.2, window=1, sinks=1, guard_threshold=1.0)
    per_layer = {}
    for lengths in ([5, 120, 180], [5, 120, 130, 150, 170, 180]):
        counter, _ = counted_decode("triton", params, release=False, lengths=lengths, layers=LAYERS, steps=1, warmup=2)
        per_layer[len(lengths)] = {counter.total(kinds=[LAUNCH], device_only=True, where=w) for w in range(LAYERS - 1)}
    assert per_layer[3] == per_layer[6], per_layer
    (launches,) = per_layer[3]
    # SGLang's KV write, the page-list read and the tally's one launch (page_tally, the captured
    # step's: masses and key bounds); an equality, so one launch more in a layer fails (11 when
    # the tally kept each layer's inputs for a reduction at the step's end).
    assert launches == 9, launches


# The triton parent's dense decode metadata (every token's slot: SGLang's TritonAttnBackend
# builds it for every decode step, stood in for by support.hot_set_world), not the hot set's.
PARENT_METADATA = "sgl_importance/attention/triton_backend.py"
TALLY_BYTES_PER_PAGE = 24  # what a step reports per page and request: page_tally's three, float64 when read back


@pytest.mark.parametrize("release", [False, True], ids=["resident", "released"])
def test_a_guard_off_step_allocates_nothing_that_grows_with_the_context(release):
    """Issue 45: after warm-up, no device allocation of a guard-off step is sized by the
    requests' context: every one is the same at 60 and at 240 tokens but for the step's tally
    (a float64 or two per page and request, what the step reports), with a budget in pages
    (a plan's lists grow with a fractional budget by design). The key-bound ranking reads each
    page's range where it lies, in the tally's launch (``page_tally``), never a gathered copy."""
    params = HotSetParams(policy="importance", budget=4, window=1, sinks=1, guard_threshold=1.0)
    largest = {}
    for tokens in (60, 240):
        lengths = [5, tokens, tokens]
        counter, _ = counted_decode(
            "triton", params, release=release, lengths=lengths, layers=LAYERS, steps=2, warmup=2
        )
        largest[tokens] = {}
        for _, _, site, nbytes in counter.allocations:
            if not site.startswith(PARENT_METADATA):
                largest[tokens][site] = max(largest[tokens].get(site, 0), nbytes)
    # The tally pads every request's row to the longest: per row, the extra pages of the longest.
    allowed = TALLY_BYTES_PER_PAGE * 3 * ((240 - 60) // PAGE + 1) + 64
    grew = {
        site: (largest[60].get(site, 0), n)
        for site, n in largest[240].items()
        if n - largest[60].get(site, 0) > allowed
    }
    assert grew == {}, f"allocations sized by context (bytes at 60, at 240 tokens): {grew}"
