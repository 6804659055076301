"""SGLang's control endpoints, refused with a 400 where the scheduler would have died on them.

SGLang 0.5.23's scheduler exits on a control request's exception, and the server with it; a
few control requests also break the HTTP side for good. ``plugin.py`` wraps the tokenizer
manager's methods (the HTTP routes and ``Engine``'s calls both go through them), each function
here named after the method it checks:

- ``/start_expert_distribution_record``, ``/stop_...``, ``/dump_...`` without
  ``--expert-distribution-recorder-mode`` (set by the user, or by SGLang for EPLB): the
  scheduler's no-op recorder raises on every call;
- ``/slow_down`` with a ``forward_sleep_time`` that is not a finite number of seconds up to
  ``MAX_SLEEP_S`` (``1e308`` overflowed ``time.sleep`` in the scheduler's next batch);
- ``/start_profile`` with ``activities`` this machine cannot record: ``MEM`` without CUDA, ``RPD``
  without ROCm's tracer, or none left once those it lacks are dropped (``["GPU"]`` on a CPU);
- ``/configure_logging`` with a ``log_requests_level`` outside 0-3 or a format other than
  ``text``/``json``: SGLang stored it, answered 500, and every request after failed to log
  (``/health`` 503) until logging was turned off; a ``log_level`` that is no level name.

The scheduler's own guards (memory release and resume, weight updates and sends that fail, a session replace)
are ``scheduler/control.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from http import HTTPStatus
from typing import Any, Callable, Optional

from sgl_importance.config import resolved_flag

MODE_FLAG = "expert_distribution_recorder_mode"
MAX_SLEEP_S = 3600.0  # an hour a batch: already a stopped server
LOG_REQUESTS_LEVELS = (0, 1, 2, 3)
LOG_REQUESTS_FORMATS = ("text", "json")


def _answer(problem: Optional[str], original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
    if problem is not None:
        from fastapi import HTTPException

        raise HTTPException(status_code=HTTPStatus.BAD_REQUEST, detail=problem)
    return original(manager, *args, **kwargs)


def recorder_problem(server_args: Any) -> Optional[str]:
    """Why the server cannot record expert distributions, or None where it can."""
    if resolved_flag(server_args, MODE_FLAG) is not None:
        return None
    return (
        "expert distribution recording needs a server started with --expert-distribution-recorder-mode "
        "(stat, stat_approx, per_pass or per_token) on a mixture-of-experts model; this one has it off"
    )


def start_expert_distribution_record(original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
    """A 400 naming the flag where the server has no recorder; SGLang's call otherwise."""
    return _answer(recorder_problem(manager.server_args), original, manager, *args, **kwargs)


stop_expert_distribution_record = dump_expert_distribution_record = start_expert_distribution_record


def sleep_problem(seconds: Any) -> Optional[str]:
    """Why ``forward_sleep_time`` cannot be slept before every batch, or None (None and ≤ 0: no sleep)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return f"forward_sleep_time {seconds!r} is invalid; allowed: null or a number of seconds up to {MAX_SLEEP_S:g}"
    if seconds > MAX_SLEEP_S:
        return f"forward_sleep_time {seconds!r} is over {MAX_SLEEP_S:g} s; allowed: null or a number up to it"
    return None


def slow_down(original: Callable[..., Any], manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """A 400 for a sleep the scheduler cannot take; SGLang's call otherwise."""
    return _answer(sleep_problem(obj.forward_sleep_time), original, manager, obj, *args, **kwargs)


def logging_problem(obj: Any) -> Optional[str]:
    """Why a ``/configure_logging`` body would leave logging broken, or None."""
    level, form, log_level = obj.log_requests_level, obj.log_requests_format, obj.log_level
    if level is not None and (isinstance(level, bool) or level not in LOG_REQUESTS_LEVELS):
        return f"log_requests_level {level!r} is invalid; allowed: {', '.join(map(str, LOG_REQUESTS_LEVELS))}"
    if form is not None and form not in LOG_REQUESTS_FORMATS:
        return f"log_requests_format {form!r} is invalid; allowed: {', '.join(LOG_REQUESTS_FORMATS)}"
    if log_level is not None and not isinstance(logging.getLevelName(str(log_level).upper()), int):
        return f"log_level {log_level!r} is no logging level; allowed: debug, info, warning, error, critical"
    return None


def configure_logging(original: Callable[..., Any], manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """A 400 for a body SGLang would store and then fail every request's log on."""
    return _answer(logging_problem(obj), original, manager, obj, *args, **kwargs)


def profile_problem(activities: Optional[list]) -> Optional[str]:
    """Why SGLang's profiler cannot record ``activities`` here, or None (None: SGLang's default)."""
    if activities is None:
        return None
    import torch

    cuda = torch.cuda.is_available()
    lacking = {"MEM": not cuda, "RPD": importlib.util.find_spec("rpdTracerControl") is None}
    missing = [a for a in activities if lacking.get(a, False)]
    if missing:
        return f"profiler activities {missing} cannot be recorded on this machine (MEM needs CUDA, RPD ROCm's tracer)"
    recordable = {
        "CPU",
        *(["GPU"] if cuda else []),
        *(["XPU"] if hasattr(torch, "xpu") and torch.xpu.is_available() else []),
    }
    if not recordable & set(activities) and "RPD" not in activities:
        allowed = ", ".join(sorted(recordable))
        return f"profiler activities {list(activities)} record nothing on this machine; allowed: {allowed}"
    return None


def start_profile(original: Callable[..., Any], manager: Any, req: Any = None, *args: Any, **kwargs: Any) -> Any:
    """A 400 for profiler activities this machine cannot record; SGLang's call otherwise."""
    activities = None if req is None else req.activities
    return _answer(profile_problem(activities), original, manager, req, *args, **kwargs)
