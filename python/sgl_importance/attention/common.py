"""What both importance backends share: the page table and the layer that ends a step."""

from __future__ import annotations

from typing import Any

from sgl_importance.config import config_of
from sgl_importance.importance.page_table import PageImportanceTable, PageTables


def page_table_for(tables: PageTables, model_runner: Any) -> PageImportanceTable:
    """The process's page table (in ``tables``), sized to this model runner's KV pool."""
    config = config_of(model_runner.server_args)
    pool = model_runner.token_to_kv_pool
    return tables.get_or_create(
        pool.size,
        page_size=model_runner.page_size,
        reduce=config.reduce,
        sample_interval=config.sample_interval,
        device=pool.device,
    )


def last_attention_layer_id(model_runner: Any) -> int:
    """The id of the last attention layer a forward runs on this rank.

    Its ``forward_decode`` closes the decode step. Read from the model's attention
    modules rather than the layer count, so pipeline stages and models whose last
    layer is not attention still close their steps.
    """
    from sglang.srt.layers.radix_attention import RadixAttention

    ids = [m.layer_id for m in model_runner.model.modules() if isinstance(m, RadixAttention)]
    if ids:
        return max(ids)
    return model_runner.model_config.num_hidden_layers - 1
