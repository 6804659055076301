"""Per-request device hot set for long contexts.

A request longer than ``--hot-set-threshold`` tokens reads, in each decode step, only
its hot set exactly: sink pages, a recent window and the pages a policy keeps
(``selection.py``). With the guard on, every other page is estimated from its 8-bit
shadow (``shadow.py``) in the same softmax, and the error of each layer's attention
output is bounded; where the bound exceeds ``--hot-set-guard-threshold`` the most
suspect pages are read exactly (``estimate.py``, ``guard.py``). ``decode.py`` runs a
step: which pages each layer reads (``page_lists.py``), what the layers found, folded
once per step (``step_tally.py``), into the decoder's records of its requests
(``request_state.py``). Page summaries (``summaries.py``, key min/max) rank unread
pages when the guard is off and drive the ``quest`` baseline. With a host pool,
``residency.py`` gives back the device pages a request's hot set leaves out and copies
planned ones back (promotions on a side stream, ``promotion.py``); without one, every
page stays on the device and only what is read changes. ``request_params.py`` holds
the parameters requests chose for themselves.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from sgl_importance.hot_set.decode import HotSetDecoder, LayerResult
from sgl_importance.hot_set.estimate import Combined, Outside, OutsidePlan, combine, estimate_outside, pages_to_read
from sgl_importance.hot_set.selection import (
    POLICIES,
    HotSetCounts,
    HotSetParams,
    RequestHotSet,
    fixed_mask,
)
from sgl_importance.hot_set.shadow import ShadowPool
from sgl_importance.hot_set.summaries import PageSummaries, key_bound

__all__ = [
    "POLICIES",
    "Combined",
    "HotSetCounts",
    "HotSetDecoder",
    "HotSetParams",
    "LayerResult",
    "Outside",
    "OutsidePlan",
    "PageSummaries",
    "RequestHotSet",
    "ShadowPool",
    "combine",
    "estimate_outside",
    "fixed_mask",
    "key_bound",
    "pages_to_read",
]
