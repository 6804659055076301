"""Per-request device hot set for long contexts.

A request longer than ``--hot-set-threshold`` tokens reads, in each decode step, only
its hot set exactly: sink pages, a recent window and the pages a policy keeps
(``selection.py``). With the guard on, every layer reads its sinks and window and,
per request, the pages its query heads want by top-p on their 4-bit key codes
(``key_codes.py``), at most ``--hot-set-read-cap`` of the request's pages; a wanted page
that was released is a miss, promoted for later steps, never read from the host inside
a layer. The unread rest is estimated from the request's page sample (``sample.py``)
with the smaller of a deterministic and a statistical bound on each layer's output
error; a layer-step over ``--hot-set-guard-threshold`` is flagged and raises that
layer's cap for the request's later steps (``estimate.py``, ``guard.py``). ``decode.py`` runs a
step: which pages each layer reads (``page_lists.py``), what the layers found, folded
once per step (``step_tally.py``), into each request's selection (``request_state.py``),
part of its one record (``record.py``, kept by ``residency.py``). Key ranges
(``key_ranges.py``, each full page's key min/max, written once when the page fills,
``coding.py``) rank unread pages when the guard is off and drive the ``quest`` baseline. With a host pool,
a request's pages (``pages.py``) say where each lives, and ``residency.py`` is the one place pages
move: between steps, the scheduler applies what the decoder's step asked for (releases of
the pages the next plan leaves out, promotions of the planned ones; copies on a side
stream); without one, every page stays on the device and only what is read changes. ``request_params.py`` holds
the parameters requests chose for themselves.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from sgl_importance.hot_set.decode import HotSetDecoder
from sgl_importance.hot_set.estimate import (
    Combined,
    Outside,
    OutsidePlan,
    Sampled,
    combine,
    estimate_outside,
    sampled_pages,
)
from sgl_importance.hot_set.key_codes import GuardPool
from sgl_importance.hot_set.key_ranges import KeyRanges, key_bound
from sgl_importance.hot_set.page_lists import LayerResult
from sgl_importance.hot_set.params import HotSetParams
from sgl_importance.hot_set.selection import (
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
