"""Hot-set parameters a request chose for itself, by rid.

A request may override the server's policy, budget, window, sinks and guard
threshold for its own decode (``custom_params.hot_set``, validated by
``params.request_hot_set_params`` in the tokenizer manager, so a bad
value is a 400 and never reaches the scheduler). The scheduler notes them when the
request arrives (``scheduler/hot_set_requests.py``); the decoder reads them when it
first tracks the request; the scheduler forgets them when the request leaves.

Requests aborted while still queued never leave through the KV release, so the
record is bounded: past ``capacity`` entries the oldest are dropped (such a request
would decode with the server's parameters, which is what it would get anyway had it
asked for nothing).

Plain Python; nothing here imports SGLang.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from sgl_importance.hot_set.params import HotSetParams

DEFAULT_CAPACITY = 1 << 16


class RequestParams:
    """rid -> the request's own ``HotSetParams``."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._params: OrderedDict[str, HotSetParams] = OrderedDict()

    def note(self, rid: str, params: HotSetParams) -> None:
        self._params[rid] = params
        self._params.move_to_end(rid)
        while len(self._params) > self.capacity:
            self._params.popitem(last=False)

    def get(self, rid: str, default: Optional[HotSetParams] = None) -> Optional[HotSetParams]:
        """The request's own parameters, else ``default`` (the server's, where the caller has them)."""
        return self._params.get(rid, default)

    def forget(self, rid: str) -> None:
        self._params.pop(rid, None)

    def __len__(self) -> int:
        return len(self._params)
