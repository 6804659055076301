"""What both importance backends do around their SGLang parent's decode, written once.

``importance_torch`` and ``importance_triton`` differ in the parent they extend and in
how a layer's dense decode reads pages; :class:`ImportanceDecodeSteps`, mixed in
before that parent, is the rest: the process's page importance table sized to the
pool, the last attention layer (whose decode closes the step), the hot set when
``--hot-set-policy`` is on, its summaries after every KV write, the step begun with
the batch's slots, each layer's hot-set decode and the step closed after the last
layer. Everything comes from the runtime the plugin hands the backend.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sgl_importance.attention.hot_set_attention import HotSetAttention, build_hot_set
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.runtime import Runtime


def page_importance_for(runtime: Runtime, model_runner: Any) -> PageImportanceTable:
    """The process's page importance table (the runtime's), sized to this model runner's KV pool."""
    config = runtime.config
    pool = model_runner.token_to_kv_pool
    return runtime.page_importance.get_or_create(
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


class ImportanceDecodeSteps:
    """The decode-step plumbing both backends share; mixed in before SGLang's backend,
    whose ``token_to_kv_pool`` it reads.

    Attributes:
        page_importance: the process's ``PageImportanceTable``.
        last_layer_id: the layer whose decode closes the step.
        hot_set: the backend's ``HotSetAttention``, None with ``--hot-set-policy off``.
    """

    page_importance: PageImportanceTable
    last_layer_id: int
    hot_set: Optional[HotSetAttention]
    token_to_kv_pool: Any

    def _init_decode_steps(self, runtime: Runtime, model_runner: Any, *, exact: Any = None) -> None:
        """Call after the parent's ``__init__``; ``exact``: the hot set's page reader."""
        self.page_importance = page_importance_for(runtime, model_runner)
        self.last_layer_id = last_attention_layer_id(model_runner)
        self.hot_set = build_hot_set(runtime, model_runner, self.last_layer_id, self.page_importance, exact=exact)

    def _begin_hot_set_step(
        self, forward_batch: Any, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, req_to_token: torch.Tensor
    ) -> None:
        """Plan the hot set's decode step (``HotSetAttention.begin_step``)."""
        self.hot_set.begin_step(forward_batch.rids, forward_batch.req_pool_indices, kv_indptr, kv_indices, req_to_token)

    def _summarise(self, layer: Any, slots: torch.Tensor) -> None:
        self.hot_set.kv_written(layer.layer_id, slots, self.token_to_kv_pool.get_key_buffer(layer.layer_id))

    def _after_extend(self, layer: Any, forward_batch: Any, save_kv_cache: bool, k: Any) -> None:
        """After the parent's extend: the prompt's pages get their summaries as it stores them."""
        if self.hot_set is not None and save_kv_cache and k is not None and not layer.is_cross_attention:
            self._summarise(layer, forward_batch.out_cache_loc)

    def _after_decode_layer(self, layer: Any) -> None:
        """After each layer's decode: the last one closes the step (table, then hot set)."""
        if layer.layer_id == self.last_layer_id:
            self.page_importance.finish_step()
            if self.hot_set is not None:
                self.hot_set.end_step()

    @staticmethod
    def _decode_output(q: torch.Tensor, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` as ``[bs, q_heads, D]`` and the layer's empty output ``[bs, q_heads * Dv]``."""
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        return q, q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))

    def _decode_hot_set(
        self,
        q: torch.Tensor,
        o: torch.Tensor,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool,
        sinks: Optional[torch.Tensor],
        logit_cap: float,
    ) -> torch.Tensor:
        """One layer over the batch's hot sets, this step's KV already written; returns ``o``."""
        if save_kv_cache:
            self._summarise(layer, forward_batch.out_cache_loc)
        self.hot_set.attend(
            layer,
            q,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            logit_cap=logit_cap,
            sinks=sinks,
        )
        return o
