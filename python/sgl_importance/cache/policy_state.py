"""From an SGLang cache to the ``importance`` policy's state for it: one accessor.

Under ``--radix-eviction-policy importance`` the tree core's eviction strategy is an
``ImportanceStrategy`` holding the cache's :class:`~sgl_importance.cache.policy.CachePolicy`
(built by the runtime). Every hook reaches it through :func:`policy_of` (or
:func:`core_policy` where it holds the tree core) and gets None under any other
policy, so "is the policy on?" is asked in one way. Imports nothing of the package:
the modules the policy is made of call it.
"""

from __future__ import annotations

from typing import Any


def core_policy(tree_core: Any) -> Any:
    """The ``CachePolicy`` of an SGLang tree core, or None under other policies."""
    # Optional by design: SGLang's Rust tree core (every policy but ``importance``)
    # keeps no Python strategy at all, and SGLang's own strategies carry no policy.
    strategy = getattr(tree_core, "eviction_strategy", None)
    return getattr(strategy, "policy", None)


def policy_of(cache: Any) -> Any:
    """The ``CachePolicy`` of an SGLang radix cache, or None under other policies.

    Args:
        cache: the scheduler's tree cache (``scheduler.tree_cache``).
    """
    # Optional by design: only the unified radix cache has a tree core; the scheduler
    # builds other caches too (``--disable-radix-cache``, ``--radix-cache-backend``).
    tree_core = getattr(cache, "tree_core", None)
    return None if tree_core is None else core_policy(tree_core)
