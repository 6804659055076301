"""From an SGLang cache to the ``importance`` policy's state for it: one accessor.

Under ``--radix-eviction-policy importance`` the tree core's eviction strategy is an
``ImportanceStrategy`` holding the cache's :class:`~sgl_importance.cache.state.CacheState`
(built by the runtime). The cache layer's hooks, which SGLang hands a cache or a tree
core, reach it through :func:`state_of` (or :func:`tree_state` where they hold the tree
core) and get None under any other policy, so "is the policy on?" is asked in one way.
Scheduler-side code reads it from the runtime instead (``Runtime.cache_state``).
Imports nothing of the package: the modules the state is made of call it.
"""

from __future__ import annotations

from typing import Any


def tree_state(tree_core: Any) -> Any:
    """The ``CacheState`` of an SGLang tree core, or None under other policies."""
    # Optional by design: SGLang's Rust tree core (every policy but ``importance``)
    # keeps no Python strategy at all, and SGLang's own strategies carry no state.
    strategy = getattr(tree_core, "eviction_strategy", None)
    return getattr(strategy, "state", None)


def state_of(cache: Any) -> Any:
    """The ``CacheState`` of an SGLang radix cache, or None under other policies.

    Args:
        cache: the scheduler's tree cache (``scheduler.tree_cache``).
    """
    # Optional by design: only the unified radix cache has a tree core; the scheduler
    # builds other caches too (``--disable-radix-cache``, ``--radix-cache-backend``).
    tree_core = getattr(cache, "tree_core", None)
    return None if tree_core is None else tree_state(tree_core)
