"""Scheduler side of per-request hot-set parameters.

A request may choose its own hot-set policy, budget, window, sinks and guard
threshold with ``custom_params: {"hot_set": {...}}`` (in ``sampling_params`` on
``/generate``, top-level on the OpenAI endpoints). The tokenizer manager has refused
invalid values with a 400 (``request_check/prompt.check_hot_set_request``); here the
scheduler notes the parsed parameters by rid when the request arrives and forgets
them when it finishes or is aborted (a retracted request keeps them: it decodes
again later). The decoder (``hot_set/decode.py``) reads them when it first tracks
the request, so one server can serve requests at different budgets or policies —
dense for one that must be exact, a smaller budget for a background job.
"""

from __future__ import annotations

from sgl_importance.choices import REQUEST_HOT_SET_KEY
from sgl_importance.config import ImportanceConfig
from sgl_importance.hot_set.params import request_hot_set_params
from sgl_importance.hot_set.request_params import RequestParams
from sgl_importance.sglang_types.scheduler import GenerateReqInput, Req, Scheduler


def note_request(
    request_params: RequestParams, config: ImportanceConfig, scheduler: Scheduler, recv_req: GenerateReqInput
) -> None:
    """Before ``Scheduler.handle_generate_request``: note the request's own parameters
    in ``request_params`` (the runtime's, as is ``config``)."""
    custom = recv_req.sampling_params.custom_params
    if not isinstance(custom, dict) or REQUEST_HOT_SET_KEY not in custom:
        return
    # Validated in the tokenizer manager already; parsing again yields the params
    # (and a request that reached the scheduler another way still fails loudly).
    params = request_hot_set_params(config, custom[REQUEST_HOT_SET_KEY])
    request_params.note(recv_req.rid, params)


def forget_request(request_params: RequestParams, req: Req) -> None:
    """When a request's KV is released: forget its parameters if it is leaving."""
    if req.finished():
        request_params.forget(req.rid)
