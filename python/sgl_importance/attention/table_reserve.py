"""The KV pool SGLang sizes, less the page importance table: the one thing the hot set sets
aside at start-up (its rows are borrowed from the pool later, as used: ``hot_set/pages/rows.py``).

``reserve_table`` runs around SGLang's ``KVCacheConfigurator.config_from_budget`` (in the
scheduler process); ``attention/hot_set_attention.build_hot_set`` reads what it recorded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from sgl_importance.hot_set.table_budget import KVShape, plan_table
from sgl_importance.runtime import Runtime

if TYPE_CHECKING:
    from sgl_importance.sglang_types.model import KVCacheConfigurator, MemoryPoolConfig


def reserve_table(
    runtime: Runtime,
    original: Callable[..., MemoryPoolConfig],
    configurator: KVCacheConfigurator,
    budget_bytes: int,
    *args: Any,
    cap_tokens: Optional[int] = None,
    **kwargs: Any,
) -> MemoryPoolConfig:
    """Around ``KVCacheConfigurator.config_from_budget``: the KV pool SGLang sizes, less
    the page importance table (``hot_set/table_budget.py``), recorded on the runtime for
    ``build_hot_set``; the hot set's rows are borrowed from the pool later, as used.

    SGLang turns the profiled memory into the KV pool's tokens there, capped by
    ``--max-total-tokens``; the table's bytes come out of that count, whichever bound
    it, and SGLang sizes the pool again under its own cap (``cap_tokens``). A call that
    already has a cap is SGLang's post-capture resize of a pool sized by the first call:
    the memory it measures already excludes the table, so it passes through.
    """
    config = original(configurator, budget_bytes, *args, cap_tokens=cap_tokens, **kwargs)
    if cap_tokens is not None or runtime.config.hot_set_policy in ("off", "dense"):
        return config  # a dense hot set keeps no rows: it files nothing the table must hold apart
    shape, cap, _ = kv_sizing(configurator)
    kv_tokens_alone = config.max_total_num_tokens
    budget = plan_table(kv_tokens_alone, shape)
    if cap is not None and kv_tokens_alone == cap // shape.page_size * shape.page_size:
        budget = replace(budget, sized_by=f"--max-total-tokens {cap} bound it")
    runtime.table_budget = budget
    if budget.kv_tokens == kv_tokens_alone:
        return config
    return original(configurator, budget_bytes, *args, cap_tokens=budget.kv_tokens, **kwargs)


def kv_sizing(configurator: KVCacheConfigurator) -> tuple[KVShape, Optional[int], bool]:
    """What SGLang sizes this rank's KV pool by: its shape (as ``KVCacheConfigurator``
    sizes an MHA pool), the token cap and whether a host pool takes released pages.

    The cap and the host pool are read from SGLang's resolved settings, as its own
    sizing reads them (a platform's default ``--max-total-tokens`` is not on ServerArgs).
    """
    from sglang.srt.runtime_context import get_memory, get_parallel, get_schedule

    parallel = get_parallel()
    model = configurator.model_config
    shape = KVShape(
        num_layers=configurator.layer_info.num_effective_layers,
        num_kv_heads=model.get_num_kv_heads(parallel.attn_tp_size, parallel.attn_dcp_size),
        head_dim=model.head_dim,
        v_head_dim=model.v_head_dim,
        element_size=configurator.kv_cache_dtype.itemsize,
        page_size=configurator.page_size,
    )
    return shape, get_schedule().max_total_tokens, bool(get_memory().enable_hierarchical_cache)
