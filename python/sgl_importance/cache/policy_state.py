"""From an SGLang cache to the plugin's state for it: one accessor.

Under ``--radix-eviction-policy importance`` everything the plugin keeps per cache
hangs off the tree core's eviction strategy, an ``ImportanceStrategy``
(``cache/strategy.py``): the aggregator, the L3 admission rule, the warm index, the
stored importance and the policy's configuration. Every module reaches it through
:func:`importance_strategy` (or :func:`core_strategy` where it holds the tree core)
and gets None under any other policy, so "is the policy on?" is asked in one way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from sgl_importance.cache.strategy import ImportanceStrategy


def core_strategy(tree_core: Any) -> Optional["ImportanceStrategy"]:
    """The ``importance`` strategy of an SGLang tree core, or None under other policies."""
    # Imported here: strategy.py imports the modules that call this one.
    from sgl_importance.cache.strategy import ImportanceStrategy

    # Optional by design: SGLang's Rust tree core (every policy but ``importance``)
    # keeps no Python strategy at all.
    strategy = getattr(tree_core, "eviction_strategy", None)
    return strategy if isinstance(strategy, ImportanceStrategy) else None


def importance_strategy(cache: Any) -> Optional["ImportanceStrategy"]:
    """The ``importance`` strategy of an SGLang radix cache, or None under other policies.

    Args:
        cache: the scheduler's tree cache (``scheduler.tree_cache``).
    """
    # Optional by design: only the unified radix cache has a tree core; the scheduler
    # builds other caches too (``--disable-radix-cache``, ``--radix-cache-backend``).
    tree_core = getattr(cache, "tree_core", None)
    return None if tree_core is None else core_strategy(tree_core)
