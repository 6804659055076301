"""importance_torch: SGLang's torch_native attention whose decode records page importance.

Prefill and extend compute what ``TorchNativeAttnBackend``'s do, with one change:
each request's new tokens attend to its cached prefix as queries of their own
(SDPA with a causal mask offset by the prefix), where torch_native runs SDPA over
the whole sequence with placeholder queries for the prefix and keeps the tail.
That costs a request ``new x (prefix + new)`` logits instead of ``(prefix + new)^2``:
the second chunk of a 4K prompt, or a 16-token question after a cached 8K document,
no longer pays for attention over the prefix it did not change. Cross-attention,
encoder-only and sliding-window layers keep torch_native's extend. Decode computes the same
softmax attention with ``sgl_kernel_ext.decode_importance_paged`` (float32 arithmetic,
the result rounded once to the model dtype, as SDPA does on a CPU), which also returns
each request's page importance; the backend files it in the process's
``PageImportanceTable``. The step's page lists are packed once in
``init_forward_metadata`` (``self.decode_plan``, with ``page_indptr`` / ``page_ids`` /
``page_tokens`` beside it) and every layer reads the pool as pages, batched over the
requests; the pages are read by sgl_kernel_ext's C kernel where it builds (one pass
straight from the pool), else by its torch path. ``SGL_IMPORTANCE_DECODE`` in the
server's environment picks, for A/B runs: ``paged`` (the default, as above), ``torch``
(the torch path even where the C kernel builds) or ``reference``
(``decode_importance_reference``: one Python iteration per request and layer, slot by
slot). For the CPU (torch_cpu
platform), where CUDA graphs are off.

With ``--hot-set-policy`` (not ``off``), decode of requests longer than
``--hot-set-threshold`` tokens attends only over each request's hot set
(``sgl_importance.hot_set``): the backend hands the decoder each step's requests,
with their ``req_to_token`` rows when pages may be released to the host pool
(``scheduler/hot_set_release.py``). That part is ``hot_set_attention.HotSetAttention``,
which ``importance_triton`` runs too; the step's plumbing around the parent (the
table, the hot set's step and layers) is ``decode_step.ImportanceDecodeSteps``.

Greedy tokens equal torch_native's on the embedded model (``test_attention_torch``);
logprobs differ by bf16 rounding. Unlike torch_native, decode honours a layer's logit
soft cap and attention sinks.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Callable, Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sgl_importance.attention.decode_step import ImportanceDecodeSteps, plain_causal
from sgl_importance.env import DECODE_ENV
from sgl_importance.hot_set.prefill import seed_layer
from sgl_importance.runtime import Runtime
from sgl_kernel_ext import (
    PagedDecodePlan,
    PagedDecodeWorkspace,
    decode_importance_paged,
    decode_importance_reference,
    plan_from_slots,
)
from sgl_kernel_ext.layer_ops import store_kv

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sgl_importance.attention.released_prefix import ReleasedPrefix
    from sgl_importance.sglang_types.model import KVPool, MHAPool

# Which dense decode runs: the batched page-list path, or the slot-by-slot reference
# (for A/B timing and as a fallback); read once when the backend is built.
DECODE_IMPLS = ("paged", "torch", "reference")


class ImportanceTorchAttnBackend(ImportanceDecodeSteps, TorchNativeAttnBackend):
    """``torch_native`` plus page importance on decode."""

    def __init__(self, runtime: Runtime, model_runner: ModelRunner) -> None:
        # runtime: the scheduler process's state (config, page importance, hot-set records).
        super().__init__(model_runner)
        self.page_size = model_runner.page_size
        self.decoding = False  # the batch is a decode this backend serves with importance
        self.kv_indptr: Optional[torch.Tensor] = None
        self.kv_indices: Optional[torch.Tensor] = None
        self.decode_impl = decode_impl_from_env()
        # The step's page lists (one list per request, in sequence order), packed once
        # per decode step; None outside decode or with the reference decode.
        self.decode_plan: Optional[PagedDecodePlan] = None
        self.page_indptr: Optional[torch.Tensor] = None
        self.page_ids: Optional[torch.Tensor] = None
        self.page_tokens: Optional[torch.Tensor] = None
        self.paged_workspace = PagedDecodeWorkspace()
        # Per request of an extend batch: its released prefix pages' positions and host
        # slots (None: all on the device), read back from the host pool in every layer.
        self.extend_released: Optional[list[ReleasedPrefix]] = None
        # Per request of an extend batch: its rid where its first decode step is seeded from
        # this extend (--hot-set-first-step seeded; None: not seeded), worked out once a forward.
        self.extend_seeded: Optional[list] = None
        self._init_decode_steps(runtime, model_runner, extend_seeds=True)
        # Nothing reads page importance (no importance policy, hot set, grading, trace):
        # a dense decode skips it, so plain serving pays nothing for it.
        self.records_importance = runtime.records_importance
        self.plain_pool = plain_kv_pool(self.token_to_kv_pool)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)
        if self.hot_set is not None:
            self.hot_set.fence()
        self.kv_indptr = self.kv_indices = None
        self.decode_plan = self.page_indptr = self.page_ids = self.page_tokens = None
        self.decoding = forward_batch.forward_mode.is_decode() and forward_batch.encoder_lens is None
        self.extend_released = None if self.decoding else self._released_prefixes(forward_batch)
        self.extend_seeded = None if self.decoding else self._seeded_requests(forward_batch)
        if self.decoding and self.hot_set is not None:
            # The hot set plans its own lists (every layer reads them): the dense ones
            # would cost a pass over every request's slots for nothing.
            self._begin_hot_set_step(forward_batch, self.req_to_token_pool.req_to_token)
        elif self.decoding:
            if self.records_importance or self.decode_impl == "reference":
                # The slots the reference reads and the table files importance under.
                self.kv_indptr, self.kv_indices = self._decode_kv_indices(forward_batch)
            if self.decode_impl != "reference":
                plan = plan_from_slots(
                    self.req_to_token_pool.req_to_token,
                    forward_batch.req_pool_indices,
                    forward_batch.seq_lens,
                    page_size=self.page_size,
                )
                self.decode_plan = plan
                self.page_indptr, self.page_ids, self.page_tokens = plan.page_indptr, plan.page_ids, plan.page_tokens

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
        if not (plain_causal(layer) and forward_batch.encoder_lens is None and not kwargs):
            return super()._extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if save_kv_cache and k is not None and v is not None:
            self._store_kv(layer, forward_batch, k, v)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        extend_causal_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            forward_batch.extend_seq_lens,
            scaling=layer.scaling,
            released=self.extend_released,
            read_host=functools.partial(self.hot_set.decoder.residency.read_host, layer.layer_id)
            if self.extend_released
            else None,
            seeds=[
                functools.partial(seed_layer, self.hot_set.decoder, rid, layer.layer_id) if rid else None
                for rid in self.extend_seeded
            ]
            if self.extend_seeded
            else None,
            page_size=self.page_size,
        )
        return o

    def _seeded_requests(self, forward_batch: ForwardBatch) -> Optional[list]:
        """Where long requests' first decode steps are seeded from this extend
        (``--hot-set-first-step seeded``): per request, its rid if past the threshold, else None."""
        decoder = self.hot_set.decoder if self.hot_set is not None else None
        lengths = forward_batch.seq_lens_cpu
        if decoder is None or not decoder.seed_first_step or forward_batch.rids is None or lengths is None:
            return None
        return [rid if n > decoder.threshold else None for rid, n in zip(forward_batch.rids, lengths.tolist())]

    def _store_kv(self, layer: RadixAttention, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        pool: MHAPool = self.token_to_kv_pool  # type: ignore[assignment]  # plain_pool says so
        if self.plain_pool and self.swa_out_cache_loc is None:
            # SGLang's write for an unquantized MHA pool is pool[loc] = rows behind checks that
            # cost a short decode step more than the copy: the same copy in one C call.
            at = layer.layer_id - pool.start_layer
            if store_kv(k, v, pool.k_buffer[at], pool.v_buffer[at], forward_batch.out_cache_loc):
                return
        pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)

    def _decode_kv_indices(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # The same slots torch_native reads per request (req_to_token[r, :seq_len]),
        # concatenated once per step instead of once per layer.
        seq_lens = forward_batch.seq_lens.to(torch.int64)
        indptr = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=indptr[1:])
        if seq_lens.numel() == 0:
            return indptr, torch.zeros(0, dtype=torch.int64, device=seq_lens.device)
        width = int(seq_lens.max())
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, :width]
        live = torch.arange(width, device=rows.device)[None, :] < seq_lens[:, None].to(rows.device)
        return indptr, rows[live].to(torch.int64)

    def _records(self, q: torch.Tensor, layer: RadixAttention, kwargs: dict) -> bool:
        # Sliding-window and cross-attention layers read other token ranges than
        # the request's pages; they keep torch_native's decode and record nothing.
        return (
            self.decoding
            and not layer.is_cross_attention
            and (layer.sliding_window_size is None or layer.sliding_window_size < 0)
        )

    def _logit_cap(self, layer: RadixAttention) -> float:
        # SGLang leaves the cap None or 0 on layers without one; the kernels take 0.0 as off.
        return layer.logit_cap if layer.logit_cap and layer.logit_cap > 0 else 0.0

    def _decode_dense(
        self, q: torch.Tensor, out: torch.Tensor, layer: RadixAttention, sinks: Optional[torch.Tensor]
    ) -> None:
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if self.decode_plan is not None:
            result = decode_importance_paged(
                q,
                as_pages(k_buffer, self.page_size),
                as_pages(v_buffer, self.page_size),
                self.decode_plan,
                sm_scale=layer.scaling,
                logit_cap=self._logit_cap(layer),
                sinks=sinks,
                workspace=self.paged_workspace,
                native=False if self.decode_impl == "torch" else None,
                importance=self.records_importance,
                out=out,
            )
        else:
            result = decode_importance_reference(
                q,
                k_buffer,
                v_buffer,
                self.kv_indptr,
                self.kv_indices,
                page_size=self.page_size,
                sm_scale=layer.scaling,
                logit_cap=self._logit_cap(layer),
                sinks=sinks,
            )
        if result.output is not out:
            out.copy_(result.output)
        if self.records_importance:
            self.page_importance.add_layer(result.importance, self.kv_indptr, self.kv_indices)


def plain_kv_pool(pool: KVPool) -> bool:
    """SGLang's own unquantized MHA pool (not a subclass, no write-loc plan): one whose
    ``set_kv_buffer`` is ``pool[loc] = rows``, which ``store_kv`` can do in its place."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return (
        type(pool) is MHATokenToKVPool
        and not pool.is_quantized_kv_cache
        and pool.store_dtype == pool.dtype
        and not getattr(pool, "requires_physical_write_loc", False)
    )


def extend_causal_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    *,
    scaling: float,
    released: Optional[list[ReleasedPrefix]] = None,
    read_host: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None,
    seeds: Optional[list] = None,
    page_size: int = 1,
) -> None:
    """Causal attention of each request's new tokens over its whole sequence.

    Args:
        q: ``[new tokens, q_heads, D]``, requests one after another; out: ``[new tokens,
            q_heads, Dv]``, written in place.
        k_buffer, v_buffer: the layer's KV pool, the new tokens' KV already stored.
        req_to_token, req_pool_indices, seq_lens: where each request's sequence lives.
        extend_seq_lens: new tokens per request (the last ones of its sequence).
        released, read_host: per request, ``(positions, host slots)`` of its prefix pages
            that live only in the host pool (None: every page on the device), and what reads
            host slots' K and V for this layer: those positions are attended from there, the
            same values the device held, so the output is what it would have been.
        seeds, page_size: per request, None or what is called with its last new token's
            attention mass per page and KV head ``[kv_heads, pages]`` (the mean over the
            head's query group, as the decode kernels report a page's mass).
    """
    gqa = q.shape[1] != k_buffer.shape[1]
    start = 0
    rows = zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist())
    for i, (row, seq_len, new) in enumerate(rows):
        if new == 0:
            continue
        slots = req_to_token[row, :seq_len].to(torch.int64)
        qr = q[start : start + new].transpose(0, 1)  # [heads, new, D]
        kr, vr = k_buffer[slots], v_buffer[slots]  # copies
        if released is not None and released[i] is not None:
            positions, host_slots = released[i]
            host_k, host_v = read_host(host_slots)
            kr[positions], vr[positions] = host_k.to(kr.device), host_v.to(vr.device)
        kr = kr.transpose(0, 1).to(qr.dtype)
        vr = vr.transpose(0, 1).to(qr.dtype)
        prefix = seq_len - new
        mask = None
        if prefix:
            # Query i (absolute position prefix + i) sees keys 0 .. prefix + i.
            positions = torch.arange(seq_len, device=q.device)
            mask = positions[None, :] <= (prefix + torch.arange(new, device=q.device))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qr[None], kr[None], vr[None], attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )
        out[start : start + new] = o[0].transpose(0, 1)
        if seeds is not None and seeds[i] is not None:
            seeds[i](_last_token_masses(qr[:, -1], kr, scaling, page_size))
        start += new


def _last_token_masses(q: torch.Tensor, k: torch.Tensor, scaling: float, page_size: int) -> torch.Tensor:
    """``q`` ``[q_heads, D]`` (the last token's, which sees every key) over ``k`` ``[kv_heads, n, D]``:
    each page's attention mass per KV head, ``[kv_heads, pages]`` float32."""
    kv_heads, n = k.shape[0], k.shape[1]
    scores = torch.einsum("kgd,knd->kgn", q.view(kv_heads, -1, q.shape[-1]).float(), k.float()) * scaling
    probs = torch.nn.functional.pad(torch.softmax(scores, dim=-1), (0, -n % page_size))
    return probs.view(kv_heads, probs.shape[1], -1, page_size).sum(-1).mean(1)


def decode_impl_from_env() -> str:
    """``$SGL_IMPORTANCE_DECODE`` (default ``paged``).

    Raises:
        ValueError: naming the variable, the value and the allowed ones.
    """
    value = os.environ.get(DECODE_ENV, "paged").strip().lower() or "paged"
    if value not in DECODE_IMPLS:
        raise ValueError(f"{DECODE_ENV}={value!r} is invalid; allowed: {', '.join(DECODE_IMPLS)}")
    return value


def as_pages(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """A ``[slots, heads, D]`` pool buffer viewed as ``[pages, page_size, heads, D]`` (no copy)."""
    whole = buffer.shape[0] // page_size * page_size
    return buffer[:whole].view(-1, page_size, *buffer.shape[1:])
