"""Per-request device hot set for long contexts.

A request longer than ``--hot-set-threshold`` tokens reads, in each decode step, only
its hot set exactly: sink pages, a recent window and the pages a policy keeps. With the
guard on, every layer also reads, per request, the pages its query heads want by top-p
on their 4-bit key codes (at most ``--hot-set-read-cap`` of them; a released one is read
from its host copy on the CPU, a miss promoted for later steps on a GPU) and estimates
the unread rest with a bound on its output error. Four parts, lower to higher (a part
imports only those before it):

- ``pages/``: a request's page states and slots, the moves a step asks for, the copies;
- ``guard/``: page summaries (key ranges, key codes), the estimate and the guarded layer;
- ``plan/``: the selection, the page sample, what it tracks per request, the step's
  page lists and tally;
- ``graph/``: the same step in fixed shapes, for a CUDA graph.

Above them: ``record.py``, one record per long request (its pages, its selection's
state), kept by ``residency.py``, the one place pages move (between steps, from the
moves a step returns); ``decode.py`` runs an eager step (``guard_reads.py``, a guarded
layer's exact reads); ``coding.py`` writes a full page's summaries once; ``prefill.py``
summarises a streamed prompt and seeds its first step; ``params.py`` and
``request_params.py`` are the server's and a request's parameters.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from sgl_importance.hot_set.decode import HotSetDecoder
from sgl_importance.hot_set.guard.estimate import (
    Combined,
    Outside,
    OutsidePlan,
    Sampled,
    combine,
    estimate_outside,
    sampled_pages,
)
from sgl_importance.hot_set.guard.key_codes import GuardPool
from sgl_importance.hot_set.guard.key_ranges import KeyRanges, key_bound
from sgl_importance.hot_set.params import HotSetParams
from sgl_importance.hot_set.plan.page_lists import LayerResult
from sgl_importance.hot_set.plan.selection import (
    POLICIES,
    HotSetCounts,
    RequestHotSet,
    fixed_mask,
)

__all__ = [
    "POLICIES",
    "Combined",
    "HotSetCounts",
    "HotSetDecoder",
    "GuardPool",
    "HotSetParams",
    "LayerResult",
    "Outside",
    "OutsidePlan",
    "KeyRanges",
    "RequestHotSet",
    "Sampled",
    "combine",
    "estimate_outside",
    "fixed_mask",
    "key_bound",
    "sampled_pages",
]
