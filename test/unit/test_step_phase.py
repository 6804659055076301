"""attention/step_phase.py: a batch's hot-set step moves only along the hooks' order."""

import pytest

from sgl_importance.attention.step_phase import NEXT, StepPhase, advance

P = StepPhase


@pytest.mark.parametrize(
    "path",
    [
        [P.EAGER, P.IDLE],  # an eager step
        [P.PLANNED, P.REPLAYED, P.IDLE],  # a captured step replayed
        [P.PLANNED, P.EAGER, P.IDLE],  # planned, SGLang ran it eagerly after all
        [P.REFUSED, P.EAGER, P.IDLE],  # the buffers refused the plan
        [P.PLANNED, P.IDLE],  # planned, no forward came
        [P.DENSE_REPLAYED, P.IDLE],  # SGLang's dense graph
    ],
)
def test_a_batch_moves_along_the_hooks_order(path):
    phase = P.IDLE
    for to in path:
        phase = advance(phase, to)
    assert phase is P.IDLE


@pytest.mark.parametrize(
    "start, to",
    [(P.IDLE, P.REPLAYED), (P.EAGER, P.PLANNED), (P.EAGER, P.REPLAYED), (P.REPLAYED, P.EAGER), (P.REFUSED, P.REPLAYED)],
)
def test_a_move_out_of_order_raises(start, to):
    with pytest.raises(RuntimeError, match=f"{start.value} -> {to.value}"):
        advance(start, to)


def test_every_phase_ends_at_idle():
    assert all(P.IDLE in NEXT[p] for p in P if p is not P.IDLE)
