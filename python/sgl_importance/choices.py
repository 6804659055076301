"""The choices and keys flags, requests and the hot set share, defined once.

A leaf: ``config`` validates flags against these, ``hot_set/`` runs the policies
they name, ``request_check/prompt.py`` and the scheduler read a request's own hot-set keys by
them, and ``importance/`` reduces page masses by them. Nothing here imports anything.
"""

from __future__ import annotations

# How a page's masses are reduced over layers (and, in the hot set, KV heads).
REDUCTIONS = ("mean", "max")

# Hot-set policies; "off" (every page attended) is a server setting, never a request's.
# The hot set's "importance" ranks one request's pages by their moving average of
# attention; the radix eviction policy of that name is importance/priority.py's.
HOT_SET_POLICIES = ("off", "dense", "window", "quest", "lru", "importance")
REQUEST_HOT_SET_POLICIES = HOT_SET_POLICIES[1:]

# The config's hot-set fields, in the order they are checked.
HOT_SET_FIELDS = (
    "hot_set_policy",
    "hot_set_budget",
    "hot_set_window",
    "hot_set_sinks",
    "hot_set_threshold",
    "hot_set_guard_threshold",
    "hot_set_read_cap",
    "hot_set_top_p",
    "hot_set_reduce",
)
HOT_SET_PREFIX = "hot_set_"
# Where a running hot-set request keeps its matched prefix (--hot-set-prefix).
PREFIX_RESIDENCES = ("host", "device")
ADMISSIONS = ("footprint", "length")  # --hot-set-admission
PREFILLS = ("stream", "dense")  # --hot-set-prefill
FIRST_STEPS = ("dense", "seeded")  # --hot-set-first-step
# What one request may set for itself in ``custom_params["hot_set"]`` (the threshold
# stays the server's: it decides, at admission, whether the prompt's pages may leave).
# Each key is a HotSetParams field and, with HOT_SET_PREFIX, a config field.
REQUEST_HOT_SET_KEY = "hot_set"
REQUEST_HOT_SET_FIELD = f"custom_params.{REQUEST_HOT_SET_KEY}"
REQUEST_HOT_SET_KEYS = ("policy", "budget", "window", "sinks", "guard_threshold", "read_cap", "top_p", "reduce")
