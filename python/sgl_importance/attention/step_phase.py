"""Where a decode batch's hot-set step stands, from its plan to its end.

One batch passes the backend's hooks in order: SGLang picks graph or eager after
``plan_graph_step`` (a batch holding a hot-set request, graphs on), the forward's metadata
hook begins an eager step or prepares a replay, and the scheduler's ``Scheduler.run_batch``
hook ends what ran (``HotSetAttention.end_batch``). Each hook moves the batch's phase along
one edge of ``NEXT``; any other move is a bug in the hooks' order and raises.

Which step runs (dense: no request past the threshold; hot; guarded) is the batch's, not the
phase's; a step ended late (``--hot-set-plan-ahead``) is held by ``hot_set.graph.late_ends``.
"""

from __future__ import annotations

import enum


class StepPhase(enum.Enum):
    IDLE = "idle"  # no step begun: between batches, or an extend
    PLANNED = "planned"  # the captured step's buffers hold the batch's plan; replay or eager next
    REFUSED = "refused"  # planned, the buffers refused it: the eager step takes the plan
    EAGER = "eager"  # the eager step's forward (begin_step ran)
    REPLAYED = "replayed"  # the captured hot-set step replays
    DENSE_REPLAYED = "dense_replayed"  # SGLang's dense graph replays (no hot-set request in it)


NEXT: dict[StepPhase, frozenset[StepPhase]] = {
    StepPhase.IDLE: frozenset({StepPhase.PLANNED, StepPhase.REFUSED, StepPhase.EAGER, StepPhase.DENSE_REPLAYED}),
    # A planned batch SGLang still runs eagerly drops the graph's plan; one whose forward never
    # came is dropped at the batch's end; planned again, the new plan replaces it.
    StepPhase.PLANNED: frozenset({StepPhase.REPLAYED, StepPhase.EAGER, StepPhase.IDLE, StepPhase.REFUSED}),
    StepPhase.REFUSED: frozenset({StepPhase.EAGER, StepPhase.IDLE, StepPhase.PLANNED}),
    StepPhase.EAGER: frozenset({StepPhase.IDLE}),
    StepPhase.REPLAYED: frozenset({StepPhase.IDLE}),
    StepPhase.DENSE_REPLAYED: frozenset({StepPhase.IDLE}),
}


def advance(phase: StepPhase, to: StepPhase) -> StepPhase:
    """``to``, where ``phase`` may move there; raises otherwise (the hooks ran out of order)."""
    if to is not phase and to not in NEXT[phase]:
        raise RuntimeError(f"hot-set step: {phase.value} -> {to.value} is not a step's order")
    return to
