"""The hot set's parameters, built from the server's config and a request's own choice.

``config.ImportanceConfig`` validates the ``--hot-set-*`` flags at start-up; here
they become a :class:`HotSetParams`, and a request's ``custom_params.hot_set`` is
checked against the same flag declarations (named by its key, with "off" not a
request's to choose) before it overrides them.

Plain Python over ``config`` and ``choices``; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Any, Optional

from sgl_importance.choices import (
    HOT_SET_FIELDS,
    HOT_SET_PREFIX,
    REQUEST_HOT_SET_FIELD,
    REQUEST_HOT_SET_KEYS,
    REQUEST_HOT_SET_POLICIES,
)
from sgl_importance.config import ImportanceConfig, check_hot_set_room
from sgl_importance.flags import specs
from sgl_importance.hot_set.selection import HotSetParams


def _params(values: dict[str, Any]) -> HotSetParams:
    params = {key: values[HOT_SET_PREFIX + key] for key in REQUEST_HOT_SET_KEYS}
    for key in ("guard_threshold", "read_cap", "top_p"):
        params[key] = float(params[key])
    return HotSetParams(**params)


def hot_set_params(config: ImportanceConfig) -> Optional[HotSetParams]:
    """The server's hot-set parameters, or None when ``--hot-set-policy off``."""
    if config.hot_set_policy == "off":
        return None
    return _params({name: getattr(config, name) for name in HOT_SET_FIELDS})


def _request_key(name: str) -> str:
    return f"{REQUEST_HOT_SET_FIELD}.{name.removeprefix(HOT_SET_PREFIX)}"


def request_hot_set_params(config: ImportanceConfig, value: Any) -> HotSetParams:
    """A request's own hot-set parameters (``custom_params.hot_set``) over the server's.

    Args:
        config: the server's config.
        value: the request's ``custom_params["hot_set"]``: a dict with any of
            ``REQUEST_HOT_SET_KEYS``; the others keep the server's flags.

    Raises:
        ValueError: naming ``custom_params.hot_set.<key>``, the value and what is
            allowed; also when the server runs without a hot set, when a budget in pages
            cannot hold the sinks and window, and when it asks for a guard the server
            has no pool for.
    """
    if config.hot_set_policy == "off":
        raise ValueError(f"{REQUEST_HOT_SET_FIELD} needs a server started with --hot-set-policy (this one has it off)")
    if not isinstance(value, dict):
        raise ValueError(f"{REQUEST_HOT_SET_FIELD} {value!r} is invalid; allowed: an object with keys "
                         f"{', '.join(REQUEST_HOT_SET_KEYS)}")  # fmt: skip
    unknown = sorted(set(value) - set(REQUEST_HOT_SET_KEYS))
    if unknown:
        raise ValueError(
            f"{REQUEST_HOT_SET_FIELD} has unknown keys {unknown}; allowed: {', '.join(REQUEST_HOT_SET_KEYS)}"
        )
    values = {name: getattr(config, name) for name in HOT_SET_FIELDS}
    values.update({HOT_SET_PREFIX + key: v for key, v in value.items()})
    # The flags' own declarations, each named by the request's key.
    declared = specs(ImportanceConfig)
    for field in HOT_SET_FIELDS:
        choices = REQUEST_HOT_SET_POLICIES if field == "hot_set_policy" else None
        declared[field].check(_request_key(field), values[field], choices)
    prefix = f"{REQUEST_HOT_SET_FIELD}."
    check_hot_set_room(values["hot_set_budget"], values["hot_set_sinks"], values["hot_set_window"], prefix)
    if values["hot_set_guard_threshold"] < 1.0 and config.hot_set_guard_threshold >= 1.0:
        raise ValueError(
            f"{prefix}guard_threshold {values['hot_set_guard_threshold']!r} asks for a guard, but this server "
            "runs no guard (--hot-set-guard-threshold 1), so it borrows no key-code rows; allowed: 1"
        )
    return _params(values)
