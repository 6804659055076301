"""One long request's record: everything the hot set knows about it, in one place.

A ``LongRequest`` lives in ``residency.Residency.records`` from the first moment the hot set
has something of the request (its history loan at admission, its pages admitted to release,
its selection once it passes the threshold, its prefill's seed) until nothing is left:
``Residency.forget`` (SGLang's ``release_kv_cache``) ends its pages, the decoder's
``forget_request`` its selection and seed, ``returning.lend_history`` its loan (once the row
exists), and the record goes with its last part. So for
any request, ``residency.record(rid)`` is the one object to read; each part says where it
lives (``RequestPages`` for each page, ``TrackedRequest`` for its hot set and rows).

Plain data; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sgl_importance.hot_set.pages.prefix_hold import HistoryLoan
from sgl_importance.hot_set.pages.state import RequestPages
from sgl_importance.hot_set.plan.request_state import Seed, TrackedRequest


@dataclass
class LongRequest:
    """What the hot set holds of request ``rid``; a part is None where it has none."""

    rid: str
    pages: Optional[RequestPages] = None  # admitted to release: each page's state and host copy (Residency.admit)
    tracked: Optional[TrackedRequest] = None  # past the threshold: its hot set, rows and caps across steps
    seed: Optional[Seed] = None  # its prefill's last-token masses (--hot-set-first-step seeded)
    prefilling: bool = False  # its prompt streams: tracked before any decode batch holds it
    loan: Optional[HistoryLoan] = None  # a returning turn's history, taken from the host until its row exists
    leaving_row: Optional[int] = None  # its req_to_token row while SGLang's release_kv_cache frees it

    @property
    def empty(self) -> bool:
        """Nothing left of it: the record may go."""
        parts = (self.pages, self.tracked, self.seed, self.loan)
        return all(p is None for p in parts) and not self.prefilling
