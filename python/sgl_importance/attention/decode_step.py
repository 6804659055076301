"""What both importance backends do around their SGLang parent's decode, written once.

``importance_torch`` and ``importance_triton`` differ in the parent they extend and in
how a layer's dense decode reads pages; :class:`ImportanceDecodeSteps`, mixed in
before that parent, is the rest: the process's page importance table sized to the
pool, the last attention layer (whose decode closes the step), the hot set when
``--hot-set-policy`` is on, the step begun with the batch's slots, each layer's hot-set
decode and the step closed after the last layer; a decode step that began no hot-set step
(a CUDA graph's) reads every page with the backend's dense decode. Everything comes from the runtime
the plugin hands the backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sgl_importance.attention.hot_set_attention import HotSetAttention, build_hot_set
from sgl_importance.hot_set.pages.state import page_offsets
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.runtime import Runtime

if TYPE_CHECKING:
    from sgl_importance.attention.released_prefix import ReleasedPrefix
    from sgl_importance.hot_set.plan.page_lists import ExactAttention
    from sgl_importance.sglang_types.model import AttentionLayer, ForwardBatch, KVPool, ModelRunner


def page_importance_for(runtime: Runtime, model_runner: ModelRunner) -> PageImportanceTable:
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


def last_attention_layer_id(model_runner: ModelRunner) -> int:
    """The id of the last attention layer a forward runs on this rank.

    Its ``forward_decode`` closes the decode step. Read from the model's attention
    modules rather than the layer count, so pipeline stages and models whose last
    layer is not attention still close their steps.
    """
    ids = [m.layer_id for m in _attention_layers(model_runner)]
    if ids:
        return max(ids)
    return model_runner.model_config.num_hidden_layers - 1


def _attention_layers(model_runner: ModelRunner) -> list[AttentionLayer]:
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in model_runner.model.modules() if isinstance(m, RadixAttention)]


def plain_causal(layer: AttentionLayer) -> bool:
    """A decoder self-attention layer over the whole sequence (no window, no encoder): one
    whose extend may read a prefix released to the host pool."""
    from sglang.srt.layers.radix_attention import AttentionType

    return (
        not layer.is_cross_attention
        and layer.attn_type != AttentionType.ENCODER_ONLY
        and (layer.sliding_window_size is None or layer.sliding_window_size < 0)
    )


class ImportanceDecodeSteps:
    """The decode-step plumbing both backends share; mixed in before SGLang's backend,
    whose ``token_to_kv_pool`` it reads and whose ``forward_decode`` / ``forward_extend``
    it wraps.

    A backend supplies what differs: ``_records`` (whether a layer's decode is served
    with importance), ``_store_kv`` (the parent's KV write), ``_decode_dense`` (one
    layer over every page, filing its importance) and ``_logit_cap``; it may replace
    ``_extend`` (the parent's extend by default).

    Attributes:
        page_importance: the process's ``PageImportanceTable``.
        last_layer_id: the layer whose decode closes the step.
        hot_set: the backend's ``HotSetAttention``, None with ``--hot-set-policy off``.
        records_importance: the dense decode files page importance (a backend sets it
            False where nothing reads it; then no table step is closed either).
    """

    page_importance: PageImportanceTable
    last_layer_id: int
    hot_set: Optional[HotSetAttention]
    records_importance: bool = True
    token_to_kv_pool: KVPool
    page_size: int

    def _init_decode_steps(
        self,
        runtime: Runtime,
        model_runner: ModelRunner,
        *,
        exact: Optional[ExactAttention] = None,
        extend_seeds: bool = False,
    ) -> None:
        """Call after the parent's ``__init__``; ``exact``: the hot set's page reader;
        ``extend_seeds``: the backend's extend reports a prompt's last token's masses (a seeded
        first step). Both backends' extends read released pages from the host pool where every
        attention layer is plain causal."""
        self.page_importance = page_importance_for(runtime, model_runner)
        self.last_layer_id = last_attention_layer_id(model_runner)
        plain = all(plain_causal(m) for m in _attention_layers(model_runner))
        self.hot_set = build_hot_set(
            runtime,
            model_runner,
            self.last_layer_id,
            self.page_importance,
            exact=exact,
            prefill_reads_host=plain,
            extend_seeds=extend_seeds and plain,
        )

    def _released_prefixes(self, forward_batch: ForwardBatch) -> Optional[list[ReleasedPrefix]]:
        """Where an extend's requests have released pages before their new tokens (a prompt
        streamed chunk by chunk: ``--hot-set-prefill stream``): per request, the positions and
        the host slots of those pages; None when no request has any."""
        residency = self.hot_set.decoder.residency if self.hot_set is not None else None
        lengths_known = forward_batch.seq_lens_cpu is not None and forward_batch.extend_seq_lens_cpu is not None
        if residency is None or not residency.enabled or forward_batch.rids is None or not lengths_known:
            return None
        out, any_released, ps = [], False, self.page_size
        lengths = zip(forward_batch.rids, forward_batch.seq_lens_cpu.tolist(), forward_batch.extend_seq_lens_cpu)
        for rid, seq_len, new in lengths:
            pages = residency.peek(rid)
            released = pages.released_pages() if pages is not None else None
            if released is not None:
                released = released[(released + 1) * ps <= seq_len - new]
            if released is None or released.numel() == 0:
                out.append(None)
                continue
            out.append((page_offsets(released, ps), pages.host_slots(released)))
            any_released = True
        return out if any_released else None

    # -- what a backend supplies ----------------------------------------------------

    def _records(self, q: torch.Tensor, layer: AttentionLayer, kwargs: dict) -> bool:
        """Whether this layer's decode runs here (with importance) rather than in the parent."""
        raise NotImplementedError

    def _store_kv(self, layer: AttentionLayer, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's K and V as the parent would."""
        raise NotImplementedError

    def _decode_dense(
        self, q: torch.Tensor, o: torch.Tensor, layer: AttentionLayer, sinks: Optional[torch.Tensor]
    ) -> None:
        """One layer over every page of the batch into ``o``, its importance filed."""
        raise NotImplementedError

    def _logit_cap(self, layer: AttentionLayer) -> float:
        raise NotImplementedError

    def _extend(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)

    # -- SGLang's entry points ------------------------------------------------------

    def forward_extend(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        o = self._extend(q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
        if self.hot_set is not None:
            self.hot_set.batch_changed()
        return o

    def forward_decode(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        sinks: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        if self._records(q, layer, kwargs):
            o = self._decode_with_importance(q, k, v, layer, forward_batch, save_kv_cache, sinks)
        else:
            if sinks is not None:
                kwargs["sinks"] = sinks
            o = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if layer.layer_id == self.last_layer_id and self.records_importance:
            # The last layer closes the table's step; the hot set's ends after the forward
            # (HotSetAttention.end_batch, from the scheduler).
            self.page_importance.finish_step()
        return o

    # -- the shared steps -------------------------------------------------------------

    def _begin_hot_set_step(self, forward_batch: ForwardBatch, req_to_token: torch.Tensor) -> None:
        """Plan the hot set's decode step (``HotSetAttention.begin_step``)."""
        seq_lens_cpu = forward_batch.seq_lens_cpu
        if seq_lens_cpu is None:  # SGLang keeps it on decode batches; read back only without it
            seq_lens_cpu = forward_batch.seq_lens.cpu()
        self.hot_set.begin_step(forward_batch.rids, forward_batch.req_pool_indices, seq_lens_cpu, req_to_token)

    def _decode_with_importance(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
        sinks: Optional[torch.Tensor],
    ) -> torch.Tensor:
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if save_kv_cache and k is not None and v is not None:
            self._store_kv(layer, forward_batch, k, v)
        out = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        if self.hot_set is None or not self.hot_set.runs_layers:
            # No hot-set step begun: a step SGLang captures or replays as a CUDA graph
            # (none of its requests is past the threshold) reads every page.
            self._decode_dense(q, out, layer, sinks)
            return o
        pool = self.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        self.hot_set.attend(layer, q, k_buffer, v_buffer, out, logit_cap=self._logit_cap(layer), sinks=sinks)
        return o
