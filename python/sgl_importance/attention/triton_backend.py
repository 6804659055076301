"""importance_triton: SGLang's Triton attention whose decode records page importance.

Prefill, extend and the decode metadata (``kv_indptr`` / ``kv_indices``, eager and
CUDA graph) are ``TritonAttnBackend``'s. Decode runs
``sgl_kernel_ext.DecodeImportanceWrapper`` over the parent's metadata, which gives
the attention output and each request's page importance in one split-K pass, then
scatters the importance into the process's ``PageImportanceTable``.

CUDA graphs: the graph wrapper is allocated in ``init_cuda_graph_state`` for the
largest captured batch, and the decode path launches kernels on it, the parent's
metadata buffers and the table only (no allocation that outlives the step, no
``.item()``), so capture and replay see the same addresses. Eager batches use a
second wrapper that grows on demand, so a large eager batch never moves buffers a
graph holds. The dummy forwards SGLang runs while capturing count as decode steps
in the table (they read only padding page 0, so they add no importance).

Memory: the importance workspace is ``bs * q_heads * max_context / page_size`` fp32
per wrapper; with page size 1 and long contexts prefer ``--page-size 16`` or more.

Layers the kernel does not serve (MLA, decode context parallelism, sliding window,
fp8 KV with scales, a KV dtype other than the query's, ``score_mod``, xAI
temperature) keep the parent's decode and record no importance.

With ``--hot-set-policy`` (not ``off``), decode runs each request's hot set as
``importance_torch`` does (``hot_set_attention.HotSetAttention``: the step planned in
``init_forward_metadata``, one ``attend`` per layer, the step ended after the last layer),
with ``TritonPageListDecode`` as the exact reader and page copies (made between steps) on a
side stream fenced before the layers read. An
eager hot-set step is data dependent (which pages, how many, what the guard reads, host
copies), so a batch that holds a request longer than ``--hot-set-threshold`` replays a
CUDA graph only as the fixed-shape step of ``hot_set/graph/step.py`` (``--hot-set-graph-rows``;
the ``hot`` graph variant: its plan written between steps by the plugin's hook around
SGLang's ``can_run_graph``, ``hot_set_graphs.eager_with_hot_set_requests``, its prologue
in ``init_forward_metadata_in_graph``, its fold after the batch, ``HotSetAttention.end_batch``); otherwise, or
where its buffers refuse the batch, the step runs eagerly. Graphs are
captured as without the hot set, and a batch of short requests replays one: dense
decode on the graph wrapper, and the hot set's decoder never called (its host side
before the replay, ``HotSetAttention.graph_step``, fences page copies and drops what the decoder tracked,
as its ``begin_step`` would). SGLang's metadata glue graph
(``SGLANG_ENABLE_METADATA_GLUE_GRAPH``, off by default) would skip that host side on
its replays; it is not supported with the hot set. The hot set also needs every decode
layer served by the kernel (no MLA, decode context parallelism, sliding window, or KV
dtype other than the model's), checked when the backend is built.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend, logit_capping_mod
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_attention_variant

from sgl_importance.attention.decode_step import ImportanceDecodeSteps, plain_causal
from sgl_importance.attention.released_prefix import ReleasedPrefixes
from sgl_importance.runtime import Runtime
from sgl_kernel_ext.decode_importance import DecodeImportanceWrapper
from sgl_kernel_ext.page_list import TritonPageListDecode

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ImportanceTritonAttnBackend(ImportanceDecodeSteps, TritonAttnBackend):
    """``triton`` plus page importance on decode."""

    def __init__(self, runtime: Runtime, model_runner: ModelRunner, **kwargs: Any) -> None:
        # runtime: the scheduler process's state (config, page importance, hot-set records).
        super().__init__(model_runner, **kwargs)
        self.max_pages = _cdiv(self.max_context_len, self.page_size)
        self.max_decode_bs = model_runner.req_to_token_pool.size
        self.head_dim = model_runner.model_config.head_dim
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.model_dtype = model_runner.dtype
        self.graph_wrapper: Optional[DecodeImportanceWrapper] = None
        self.eager_wrapper: Optional[DecodeImportanceWrapper] = None
        # The wrapper the next forward_decode uses, chosen by the metadata init.
        self.decode_wrapper: Optional[DecodeImportanceWrapper] = None
        # An extend batch's prefixes with pages on the host (streamed prefill, a returning
        # turn), staged for the parent's kernel once a forward; None: every page on the device.
        self.extend_staged: Optional[ReleasedPrefixes] = None
        self._init_decode_steps(runtime, model_runner, exact=TritonPageListDecode(max_splits=self.max_kv_splits))
        if self.hot_set is not None:
            check_hot_set_serves(
                self._serves_with_importance(),
                sliding_window=model_runner.sliding_window_size,
                kv_cache_dtype=self.kv_cache_dtype,
                model_dtype=self.model_dtype,
            )

    def _new_wrapper(self, max_batch_size: int) -> DecodeImportanceWrapper:
        return DecodeImportanceWrapper(
            max_batch_size,
            self.num_head,
            self.num_kv_head,
            self.head_dim,
            max_pages=self.max_pages,
            v_head_dim=self.v_head_dim,
            page_size=self.page_size,
            max_splits=self.max_kv_splits,
            dtype=self.model_dtype,
            device=self.device,
        )

    def _serves_with_importance(self) -> bool:
        # Backend-wide conditions; per-layer ones are in _records.
        return not self.use_mla and self.dcp_size == 1 and self.page_size & (self.page_size - 1) == 0

    # -- metadata: pick the wrapper; the parent builds kv_indptr / kv_indices -------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args: Any, **kwargs: Any) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        if self._serves_with_importance():
            self.graph_wrapper = self._new_wrapper(max_num_tokens)
            if self.hot_set is not None:
                exact = TritonPageListDecode(max_splits=self.max_kv_splits)
                self.hot_set.enable_graphs(max_bs, self.max_pages, exact=exact)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        # Before a graph is captured (in_capture) or replayed: the dense variant reads every
        # page (no hot-set request), the hot one runs the step planned into its buffers.
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        decode = forward_batch.forward_mode.is_decode_or_idle()
        if decode:
            self.decode_wrapper = self.graph_wrapper
        if self.hot_set is not None:
            if decode:  # SGLang names the variant while capturing; a replay's is the one it selected
                variant = get_capture_attention_variant() if in_capture else self.hot_set.replay_variant
                self.hot_set.graph_metadata(variant, in_capture, forward_batch.batch_size)
            elif not in_capture:
                self.hot_set.fence()

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata_in_graph(forward_batch)
        if self.hot_set is not None and forward_batch.forward_mode.is_decode_or_idle():
            self.hot_set.graph_prologue(forward_batch.batch_size, self.req_to_token)

    def plan_hot_set_graph_step(self, forward_batch: ForwardBatch, padded_bs: int) -> bool:
        """Whether the batch's hot-set step was planned into the captured step's buffers
        (the plugin's hook around SGLang's ``can_run_graph``; ``padded_bs``: the captured
        batch size it replays at)."""
        if self.hot_set is None or self.hot_set.graph is None:
            return False
        seq_lens_cpu = forward_batch.seq_lens_cpu
        if seq_lens_cpu is None:
            return False
        args = forward_batch.rids, forward_batch.req_pool_indices, seq_lens_cpu, self.req_to_token
        return self.hot_set.plan_graph_step(*args, padded_bs)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)
        self.decode_wrapper = None
        self.extend_staged = None
        if self.hot_set is not None:
            self.hot_set.graph_mode = False  # an eager forward: no captured step runs
            # Promotions of the last step must land before this forward reads or frees pages.
            self.hot_set.fence()
            if forward_batch.forward_mode.is_decode():
                self._begin_hot_set_step(forward_batch, self.req_to_token)
            elif forward_batch.forward_mode.is_extend() and not forward_batch.forward_mode.is_target_verify():
                self.extend_staged = self._staged_prefixes(forward_batch)
            return
        if forward_batch.forward_mode.is_decode() and self._serves_with_importance():
            bs = self.forward_metadata.kv_indptr.numel() - 1
            wrapper = self.eager_wrapper
            if wrapper is None or wrapper.max_batch_size < bs:
                # Eager only: grow in powers of two, capped by the request pool.
                size = min(max(1 << max(bs - 1, 0).bit_length(), 8), max(self.max_decode_bs, bs))
                wrapper = self.eager_wrapper = self._new_wrapper(size)
            self.decode_wrapper = wrapper

    def _staged_prefixes(self, forward_batch: ForwardBatch) -> Optional[ReleasedPrefixes]:
        released = self._released_prefixes(forward_batch)
        if released is None:
            return None
        pool, last = self.token_to_kv_pool, self.last_layer_id  # every layer's buffers alike
        keys, values = pool.get_key_buffer(last), pool.get_value_buffer(last)
        lengths = zip(forward_batch.seq_lens_cpu.tolist(), forward_batch.extend_seq_lens_cpu)
        prefix_lens = [n - new for n, new in lengths]
        return ReleasedPrefixes(
            released,
            prefix_lens,
            self.forward_metadata.kv_indices,
            kv_heads=keys.shape[1],
            head_dim=keys.shape[2],
            v_head_dim=values.shape[2],
            dtype=keys.dtype,
            device=keys.device,
        )

    # -- extend over pages on the host --------------------------------------------

    def _extend(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
        **kwargs,
    ) -> torch.Tensor:
        staged = self.extend_staged
        if staged is None:
            return super()._extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        sinks = kwargs.pop("sinks", None)
        plain = plain_causal(layer) and forward_batch.encoder_lens is None and layer.k_scale is None
        if not plain or k is None or v is None or any(a is not None for a in kwargs.values()):
            # The parent would read the released slot for the prefix's released tokens.
            raise NotImplementedError(f"layer {layer.layer_id}: an extend over released pages needs a plain layer")
        if save_kv_cache:
            self._store_kv(layer, forward_batch, k, v)
        pool, md = self.token_to_kv_pool, self.forward_metadata
        read_host = functools.partial(self.hot_set.decoder.residency.read_host, layer.layer_id)
        keys, values = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        stage_k, stage_v = staged.layer(keys, values, read_host)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        # The parent's kernel and arguments for a plain causal layer, over the staged prefixes.
        self.extend_attention_fwd(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            k.contiguous(),
            v.contiguous(),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            stage_k,
            stage_v,
            md.qo_indptr,
            md.kv_indptr,
            md.kv_indices,
            md.custom_mask,
            True,
            md.mask_indptr,
            md.max_extend_len,
            1.0,
            1.0,
            layer.scaling,
            logit_cap=self._logit_cap(layer),
            sliding_window_size=-1,
            sinks=sinks,
            window_kv_offsets=None,
            xai_temperature_len=layer.xai_temperature_len,
            page_size=1,
            score_mod=None,
            aux_tensors=None,
            extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
            identity_kv_indices=True,
        )
        return o

    # -- decode -------------------------------------------------------------------

    def _records(self, q: torch.Tensor, layer: RadixAttention, kwargs: dict) -> bool:
        return (
            (self.decode_wrapper is not None or (self.hot_set is not None and self.hot_set.in_step))
            and kwargs.get("score_mod") is None
            and q.dtype == self.kv_cache_dtype
            and (layer.sliding_window_size is None or layer.sliding_window_size < 0)
            and layer.k_scale is None
            and layer.v_scale is None
            and layer.xai_temperature_len <= 0
            and not layer.is_cross_attention
        )

    def _store_kv(self, layer: RadixAttention, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        # The parent's write, unchanged (k_scale/v_scale are None here).
        loc = KVWriteLoc.for_batch(forward_batch, swa_loc=self.forward_metadata.swa_out_cache_loc)
        self._set_kv_buffer(forward_batch, layer, loc, k, v)

    def _logit_cap(self, layer: RadixAttention) -> float:
        return logit_capping_mod(layer.logit_capping_method, layer.logit_cap)

    def _decode_dense(
        self, q: torch.Tensor, out: torch.Tensor, layer: RadixAttention, sinks: Optional[torch.Tensor]
    ) -> None:
        kv_indptr = self.forward_metadata.kv_indptr
        kv_indices = self.forward_metadata.kv_indices
        result = self.decode_wrapper.run(
            q,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            kv_indptr,
            kv_indices,
            sm_scale=layer.scaling,
            logit_cap=self._logit_cap(layer),
            sinks=sinks,
            out=out,
        )
        self.page_importance.add_layer(result.importance, kv_indptr, kv_indices)


def check_hot_set_serves(
    serves: bool, *, sliding_window: Optional[int], kv_cache_dtype: torch.dtype, model_dtype: torch.dtype
) -> None:
    """Raise unless every decode layer can run the hot set's page-list kernel.

    A layer left to the parent's decode would read released pages' padding slots as
    if they were the request's tokens.

    Args:
        serves: the backend-wide conditions hold (no MLA, no decode context parallelism,
            a power-of-two page size).

    Raises:
        ValueError: naming what the hot set cannot serve.
    """
    why = None
    if not serves:
        why = "MLA, decode context parallelism or a page size that is not a power of two"
    elif sliding_window is not None and sliding_window > 0:
        why = f"sliding-window attention (window {sliding_window})"
    elif kv_cache_dtype != model_dtype:
        why = f"a KV cache dtype ({kv_cache_dtype}) other than the model's ({model_dtype})"
    if why is not None:
        raise ValueError(f"--hot-set-policy with --attention-backend importance_triton cannot serve {why}")
