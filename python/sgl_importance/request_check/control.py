"""SGLang's expert-distribution endpoints, refused with a 400 where the server records nothing.

``/start_expert_distribution_record``, ``/stop_expert_distribution_record`` and
``/dump_expert_distribution_record`` reach the scheduler's recorder, which without
``--expert-distribution-recorder-mode`` (set by the user, or by SGLang for EPLB) is a no-op
that raises on every call; SGLang 0.5.23's scheduler exits on a control request's exception,
so one GET took the whole server down. ``plugin.py`` wraps the tokenizer manager's three
methods, so the HTTP routes and ``Engine``'s methods both stop here before the scheduler.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Awaitable, Callable

from sgl_importance.config import resolved_flag

MODE_FLAG = "expert_distribution_recorder_mode"


def recorder_problem(server_args: Any) -> str | None:
    """Why the server cannot record expert distributions, or None where it can."""
    if resolved_flag(server_args, MODE_FLAG) is not None:
        return None
    return (
        "expert distribution recording needs a server started with --expert-distribution-recorder-mode "
        "(stat, stat_approx, per_pass or per_token) on a mixture-of-experts model; this one has it off"
    )


async def recorder_needed(original: Callable[[Any], Awaitable[Any]], tokenizer_manager: Any) -> Any:
    """Around the tokenizer manager's start, stop and dump of the expert record: a 400 naming the
    flag where the server has no recorder; SGLang's call otherwise."""
    problem = recorder_problem(tokenizer_manager.server_args)
    if problem is not None:
        from fastapi import HTTPException

        raise HTTPException(status_code=HTTPStatus.BAD_REQUEST, detail=problem)
    return await original(tokenizer_manager)
