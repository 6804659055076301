"""Per-request device hot set for long contexts.

A request longer than ``--hot-set-threshold`` tokens attends, in each decode step,
only over its hot set: sink pages, a recent window and the pages a policy keeps
(``selection.py``). Page summaries (``summaries.py``) bound the logits of pages
outside it; the guard (``guard.py``) adds pages whenever that bound says the
attention outside could exceed ``--hot-set-guard-threshold``. ``decode.py`` runs a
step. With a host pool, ``release.py`` gives back the device pages a request's hot
set leaves out and copies planned ones back; without one, every page stays on the
device and only what is attended changes.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from sgl_importance.hot_set.decode import HotSetDecoder, LayerResult
from sgl_importance.hot_set.guard import outside_mass_bound, pages_to_add
from sgl_importance.hot_set.selection import (
    POLICIES,
    HotSetCounts,
    HotSetParams,
    RequestHotSet,
    fixed_mask,
)
from sgl_importance.hot_set.summaries import PageSummaries, key_bound

__all__ = [
    "POLICIES",
    "HotSetCounts",
    "HotSetDecoder",
    "HotSetParams",
    "LayerResult",
    "PageSummaries",
    "RequestHotSet",
    "fixed_mask",
    "key_bound",
    "outside_mass_bound",
    "pages_to_add",
]
