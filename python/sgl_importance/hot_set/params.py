"""The hot set's parameters, built from the server's config and a request's own choice.

``config.ImportanceConfig`` validates the ``--hot-set-*`` flags at start-up; here
they become a :class:`HotSetParams`, and a request's ``custom_params.hot_set`` is
checked against the same flag declarations (named by its key, with "off" not a
request's to choose) before it overrides them.

Plain Python over ``config`` and ``choices``; nothing here imports SGLang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from sgl_importance.choices import (
    HOT_SET_FIELDS,
    HOT_SET_PREFIX,
    REQUEST_HOT_SET_FIELD,
    REQUEST_HOT_SET_KEYS,
    REQUEST_HOT_SET_POLICIES,
)
from sgl_importance.config import ImportanceConfig, check_hot_set_room
from sgl_importance.flags import specs


@dataclass(frozen=True)
class HotSetParams:
    """One policy's settings (validated by ``config.ImportanceConfig``, built below).

    Attributes:
        policy: one of ``POLICIES`` except ``off``.
        budget: pages per request when an ``int`` (>= 1), else (a ``float`` in
            (0, 1]) the fraction of the request's pages, rounded up. Sinks and window always count in it;
            when they alone exceed it they are still attended.
        window: recent pages, ``>= 1`` (the last page holds the decoded token).
        sinks: leading pages.
        guard_threshold: allowed bound of the relative error of each layer's attention
            output, in (0, 1]; 1 = no guard (unread pages are neither estimated nor bounded).
            A guarded layer-step whose bound exceeds it is *flagged* (counted) and raises
            that layer's read cap for the request's later steps.
        read_cap: guarded: the most pages a layer reads exactly per step, as a fraction of
            the request's pages (sinks, window and the page sample included), in (0, 1].
        top_p: guarded: each query head wants the fewest pages whose estimated mass (from
            their key codes) with the always-read pages reaches this share, in (0, 1].
        decay: EMA factor of the ``importance`` policy.
        reduce: how the ``importance`` policy reduces a step's page masses over
            layers and KV heads: ``max``, the largest of any (a page one retrieval
            head needs is not averaged away by the heads that ignore it), or
            ``mean``. Other policies take the mean (``lru``'s "used" test, a share of
            the uniform mass, would mark nearly every page used under ``max``).
    """

    policy: str = "importance"
    budget: Union[int, float] = 0.2
    window: int = 4
    sinks: int = 1
    guard_threshold: float = 0.1
    read_cap: float = 0.2
    top_p: float = 0.95
    decay: float = 0.98
    reduce: str = "max"

    @property
    def ranks_by_max(self) -> bool:
        """Whether a step's page mass is its largest over layers and KV heads."""
        return self.policy == "importance" and self.reduce == "max"

    def budget_pages(self, num_pages: int, kept_share: Optional[float] = None) -> int:
        """The hot set's size for a request of ``num_pages`` pages; ``kept_share``: the share
        of its pages the guard grew it to (``request_state.TrackedRequest.kept``; never
        below the budget)."""
        if isinstance(self.budget, int):
            pages = self.budget
        else:
            pages = math.ceil(self.budget * num_pages)
        if kept_share is not None:
            # The share was a page count over num_pages: round-trip it without float's overshoot.
            pages = max(pages, math.ceil(kept_share * num_pages - 1e-9))
        return max(1, min(num_pages, pages))


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
        raise ValueError(
            f"{REQUEST_HOT_SET_FIELD} {value!r} is invalid; allowed: an object with keys "
            f"{', '.join(REQUEST_HOT_SET_KEYS)}"
        )
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
