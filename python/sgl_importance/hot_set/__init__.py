"""Per-request device hot set for long contexts.

A request longer than ``--hot-set-threshold`` tokens reads, in each decode step, only
its hot set exactly: sink pages, a recent window and the pages a policy keeps
(``selection.py``). With the guard on, every other page is accounted for in the same
softmax: its 4-bit key codes (``key_codes.py``) bound its tokens' logits, so pages that
could be heavy are read exactly, and the rest is estimated from a uniform sample of
pages (``sample.py``) with a statistical bound on each layer's output error; where the
bound exceeds ``--hot-set-guard-threshold`` every unread page is read exactly
(``estimate.py``, ``guard.py``). ``decode.py`` runs a
step: which pages each layer reads (``page_lists.py``), what the layers found, folded
once per step (``step_tally.py``), into the decoder's records of its requests
(``request_state.py``). Key ranges (``key_ranges.py``, each full page's key min/max,
written once when the page fills, ``coding.py``) rank unread pages when the guard is off
and drive the ``quest`` baseline. With a host pool,
``residency.py`` records where each page of a request lives and is the one place pages
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
    heavy_pages,
    sampled_pages,
)
from sgl_importance.hot_set.key_codes import GuardPool
from sgl_importance.hot_set.key_ranges import KeyRanges, key_bound
from sgl_importance.hot_set.page_lists import LayerResult
from sgl_importance.hot_set.selection import (
    POLICIES,
    HotSetCounts,
    HotSetParams,
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
    "heavy_pages",
    "key_bound",
    "sampled_pages",
]
