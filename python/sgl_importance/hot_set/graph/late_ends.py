"""Steps ended one step late (``--hot-set-plan-ahead``): which requests end when.

A hot-set step ends (``HotSetDecoder.end_step``: its masses folded into each request's
state, its new full pages coded, the next plan made and the page moves it wants) on the
host. Ended where it ran, the host waits for the step before it can plan the next; on a GPU
the device then idles while the host works. Ended a step late, step N ends after step N+1
has been issued, planning N+2 (``ahead`` 2) while N+1 runs. Each plan is one step older.

A request's first step is the exception, ended with the step it ran in: its dense warm-up
(every page read, the guard's read caps seeded) is what the next plan is made from, and
without it the next step would be a second warm-up. Where that step was replayed from a
graph, ending it waits for the replay (once per request).

Plain Python over the decoder's step records; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Union

if TYPE_CHECKING:
    from sgl_importance.hot_set.graph.step import Replayed
    from sgl_importance.hot_set.plan.request_state import LiveRequest

# A replayed step's read back -> its requests, folded (GraphStep.fold).
Fold = Callable[["Replayed"], list["LiveRequest"]]
# A step run: an eager step's folded requests, or a replayed step's read back (folded when it ends).
Step = Union[list["LiveRequest"], "Replayed"]


class LateEnds:
    """The one step run and not yet ended: an eager step's folded requests (a list) or a
    replayed step's read back (``graph.step.Replayed``, folded when it ends)."""

    def __init__(self) -> None:
        self.pending: Optional[Step] = None

    def ran(self, step: Step, fold: Fold) -> tuple[list[LiveRequest], list[int]]:
        """``step`` has run: what ends now (requests, each with how many steps ahead its next
        plan is): the step held back before it (2) and ``step``'s requests on their first step
        (1); the rest of ``step`` is held back."""
        before, self.pending = self.pending, step
        live = _folded(before, fold) if before is not None else []
        aheads = [2] * len(live)
        if any(_first_step(req) for req in _requests(step)):
            step = _folded(step, fold)
            first = [req for req in step if _first_step(req)]
            self.pending = [req for req in step if not _first_step(req)]
            live, aheads = live + first, aheads + [1] * len(first)
        return live, aheads

    def drain(self, fold: Fold) -> list[LiveRequest]:
        """The step held back, folded, to end now (its requests are leaving); empty if none."""
        step, self.pending = self.pending, None
        return [] if step is None else _folded(step, fold)


def _requests(step: Step) -> list[LiveRequest]:
    return step if isinstance(step, list) else step.live


def _folded(step: Step, fold: Fold) -> list[LiveRequest]:
    return step if isinstance(step, list) else fold(step)


def _first_step(req: LiveRequest) -> bool:
    return req.tracked is not None and req.tracked.state.step == 0
