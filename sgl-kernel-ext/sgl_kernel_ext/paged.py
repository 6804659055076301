"""Decode attention with page importance over page lists, batched, in plain torch.

The CPU fast path. ``decode_importance_reference`` is written for exactness (one
Python iteration per request, every slot gathered one by one); this one reads what a
decode step has to read and little else:

- K and V are gathered **by page** from views of the pool as pages
  (``[num_pages, page_size, kv_heads, D]``): one contiguous copy per listed page, not
  one per token, and only the listed pages are converted to float32 (a bf16 pool is
  never converted whole).
- The batch is padded to its longest page list: logits and values are two batched
  matmuls over ``[bs, kv_heads]`` (a KV head's query heads share one matrix), the
  softmax is one pass over ``[bs, q_heads, tokens]``, and the page masses are sums of
  the same (unnormalised) weights, divided by the same denominator.
- The per-step work (padding the page lists, the mask of valid tokens) lives in a
  :class:`PagedDecodePlan`, built once per decode step and reused by every layer
  (FlashInfer's plan/run split): no Python loop per request on the per-layer path.
- Long lists are processed in chunks of pages (``chunk_pages``) so that a gathered
  chunk is still in cache when the matmul reads it back: a gather costs a read and a
  write, and without chunking the matmul reads the copy again from memory.

Page lists may be unordered and non-contiguous; importance columns follow the listed
order (column ``j`` of request ``b`` is its ``j``-th listed page). Page ids at or past
the pool's ``num_pages`` name pages of optional staging buffers (``extra_k_pages``,
``extra_v_pages``; id ``num_pages + i`` is their page ``i``), where a caller stages
pages that live elsewhere (a host pool).

SGLang's padding page 0: :func:`plan_from_slots` (the helper that turns SGLang's
per-request slot rows into page lists) gives page 0 zero valid tokens, so it is never
attended and gets importance 0, which is what the reference's ``mask_page0`` does.
:func:`plan_paged_decode` itself treats every id alike: a caller that lists page 0
with tokens attends it.

Knows nothing of SGLang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from . import native as _native
from .output import DecodeImportanceOutput

# Float32 bytes of K (or V) gathered at a time, all requests of the batch together.
# Measured on a 2-core Zen 4 (2 MiB L2 per core), SmolLM2 shapes: 1 x 7.6K tokens was
# fastest unchunked (5.8 MiB per layer), 4 x 7.6K at 64 pages (3 MiB), 8 x 2K at 32
# pages (3 MiB); chunks far below ~1 MiB pay more in per-op overhead than they save.
DEFAULT_CHUNK_BYTES = 3 << 20
# Tokens of a request's list one work item of the C kernel reads (a split). Fixed, so a
# request decodes alike in any batch: a split sized by the batch's longest list or by its
# size would sum a request's tokens in another order beside other requests.
SPLIT_TOKENS = 256


@dataclass
class PagedDecodePlan:
    """The batch's page lists, padded once per decode step for every layer to use.

    Attributes:
        page_size: tokens per page.
        table: int64 ``[bs, max_pages]`` listed page ids, padded with page 0.
        tokens: int64 ``[bs, max_pages]`` valid tokens of each listed page (0 on padding).
        bias: float32 ``[bs, max_pages * page_size]``: 0 for a valid token, -inf otherwise
            (padding columns, the unused tail of a partial page).
        live: bool ``[bs]``: the request has at least one valid token.
        page_indptr, page_ids, page_tokens: the lists the plan was built from.
    """

    page_size: int
    table: torch.Tensor
    tokens: torch.Tensor
    bias: torch.Tensor
    live: torch.Tensor
    page_indptr: torch.Tensor
    page_ids: torch.Tensor
    page_tokens: torch.Tensor
    # What the C kernel takes of the plan (its lists as it reads them, the split count, its
    # scratch), made by a step's first layer and reused by the others (``_decode_native``).
    native_inputs: Optional[Any] = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.table.shape[0]

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]


def plan_paged_decode(
    page_indptr: torch.Tensor,
    page_ids: torch.Tensor,
    page_tokens: torch.Tensor,
    *,
    page_size: int,
    max_pages: Optional[int] = None,
) -> PagedDecodePlan:
    """Pad the batch's packed page lists into a ``[bs, max_pages]`` table (vectorised).

    Args:
        page_indptr: ``[bs + 1]``: request ``b`` attends ``page_ids[page_indptr[b]:page_indptr[b + 1]]``.
        page_ids: the listed pages, all requests one after another.
        page_tokens: valid tokens of each listed page, in ``[0, page_size]`` (a full page
            ``page_size``, a request's last page possibly fewer; 0 skips the page).
        page_size: tokens per page.
        max_pages: columns of the table; defaults to the longest list (at least 1). Pages
            past it are not attended.

    Returns:
        The plan :func:`decode_importance_paged` takes.
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    dev = page_ids.device
    indptr = page_indptr.to(device=dev, dtype=torch.int64)
    bs = indptr.numel() - 1
    counts = indptr[1:] - indptr[:-1]
    if max_pages is None:
        max_pages = max(int(counts.max()) if bs > 0 else 0, 1)
    cols = torch.arange(max_pages, device=dev)
    listed = cols[None, :] < counts[:, None]  # [bs, max_pages]
    where = (indptr[:-1, None] + cols[None, :]).clamp(max=max(page_ids.numel() - 1, 0))
    if page_ids.numel() == 0:
        table = torch.zeros(bs, max_pages, dtype=torch.int64, device=dev)
        tokens = torch.zeros(bs, max_pages, dtype=torch.int64, device=dev)
    else:
        table = torch.where(listed, page_ids.to(torch.int64)[where], 0)
        tokens = torch.where(listed, page_tokens.to(device=dev, dtype=torch.int64)[where], 0)
    return _finish_plan(table, tokens, page_size, page_indptr, page_ids, page_tokens)


def plan_from_slots(
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
) -> PagedDecodePlan:
    """The plan of a dense decode step, from SGLang-style slot rows (vectorised).

    Request ``b`` holds its tokens ``0 .. seq_lens[b] - 1`` in slots
    ``req_to_token[req_rows[b], :seq_lens[b]]``, ``page_size`` consecutive tokens per
    physical page (SGLang's paged allocator), so its ``j``-th page is the page of slot
    ``req_to_token[row, j * page_size]``. Page 0 (SGLang's padding page) is listed with
    0 valid tokens: never attended, importance 0.

    Returns:
        A plan whose ``page_ids`` / ``page_indptr`` / ``page_tokens`` are the packed lists.
    """
    dev = req_to_token.device
    lens = seq_lens.to(device=dev, dtype=torch.int64)
    bs = lens.numel()
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(bs + 1, dtype=torch.int64, device=dev)
    if bs:
        torch.cumsum(pages, 0, out=indptr[1:])
    max_pages = max(int(pages.max()) if bs else 0, 1)
    # The first slot of each page names it; slice the columns before picking the rows.
    firsts = req_to_token[:, : max_pages * page_size : page_size][req_rows.to(device=dev, dtype=torch.int64)]
    ids = firsts.to(torch.int64) // page_size
    if ids.shape[1] < max_pages:  # a row table narrower than the longest request
        ids = torch.nn.functional.pad(ids, (0, max_pages - ids.shape[1]))
    cols = torch.arange(max_pages, device=dev)
    listed = cols[None, :] < pages[:, None]
    tokens = (lens[:, None] - cols[None, :] * page_size).clamp(0, page_size)
    # Page 0 is SGLang's padding page: listed (its column stays), never attended.
    tokens = torch.where(listed & (ids != 0), tokens, 0)
    table = torch.where(listed, ids, 0)
    return _finish_plan(table, tokens, page_size, indptr, table[listed], tokens[listed])


def plan_from_table(table: torch.Tensor, tokens: torch.Tensor, page_size: int) -> PagedDecodePlan:
    """A plan over a fixed table: request ``b`` lists ``table[b]``, each page with
    ``tokens[b, j]`` valid tokens (0 skips it). Fixed-shape ops only: a table and token
    counts computed on the device (a mask over a fixed list) never come back to the host.

    Args:
        table: int64 ``[bs, max_pages]`` page ids; tokens: int ``[bs, max_pages]``.
    """
    bs, width = table.shape
    tokens = tokens.to(torch.int64)
    indptr = torch.arange(bs + 1, device=table.device) * width
    return _finish_plan(table, tokens, page_size, indptr, table.reshape(-1), tokens.reshape(-1))


def _finish_plan(
    table: torch.Tensor,
    tokens: torch.Tensor,
    page_size: int,
    page_indptr: torch.Tensor,
    page_ids: torch.Tensor,
    page_tokens: torch.Tensor,
) -> PagedDecodePlan:
    bs, max_pages = table.shape
    offsets = torch.arange(page_size, device=table.device)
    valid = (offsets[None, None, :] < tokens[:, :, None]).reshape(bs, max_pages * page_size)
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=table.device).masked_fill_(~valid, float("-inf"))
    return PagedDecodePlan(
        page_size=page_size,
        table=table,
        tokens=tokens,
        bias=bias,
        live=valid.any(dim=1),
        page_indptr=page_indptr,
        page_ids=page_ids,
        page_tokens=page_tokens,
    )


class PagedDecodeWorkspace:
    """Scratch tensors reused by every layer and step (grown when a batch needs more).

    A fresh multi-megabyte tensor per layer costs page faults on first touch (measured:
    a 1.5 MiB gather into a fresh tensor ran at 2.5 GB/s, into a reused one at 14 GB/s),
    so the gathered pages and the logits live here. Results handed back to the caller
    are never views of it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` (uninitialised) backed by the buffer ``name``."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


def decode_importance_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: PagedDecodePlan,
    *,
    sm_scale: Optional[float] = None,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    extra_k_pages: Optional[torch.Tensor] = None,
    extra_v_pages: Optional[torch.Tensor] = None,
    chunk_pages: Optional[int] = None,
    workspace: Optional[PagedDecodeWorkspace] = None,
    native: Optional[bool] = None,
    importance: bool = True,
    out: Optional[torch.Tensor] = None,
) -> DecodeImportanceOutput:
    """Attention output, lse and page importance of one decode step over page lists.

    Same numbers as ``decode_importance_reference`` run on the listed pages' slots
    (masses normalised by the full denominator, sinks included), in float32.

    Args:
        q: ``[bs, q_heads, D]``.
        k_pages: ``[num_pages, page_size, kv_heads, D]``, a view of the K pool as pages
            (``k_buffer.view(-1, page_size, kv_heads, D)``); v_pages likewise with ``Dv``.
        plan: the step's page lists (:func:`plan_paged_decode` / :func:`plan_from_slots`).
        sm_scale: logit scale; default ``1 / sqrt(D)``.
        logit_cap: ``cap * tanh(logit / cap)`` when > 0.
        sinks: ``[q_heads]`` sink logits counted in each head's denominator.
        extra_k_pages, extra_v_pages: staging buffers ``[extra_pages, page_size, kv_heads, D]``;
            listed id ``num_pages + i`` reads their page ``i``.
        chunk_pages: pages of each request gathered at a time; None: as many as keep
            ``DEFAULT_CHUNK_BYTES`` of float32 K for the whole batch; 0: all at once.
        workspace: scratch reused across calls (a fresh one when None).
        native: run the C kernel (``native.py``: one pass over the listed pages, read in
            place). None: when it is built and the inputs suit it (CPU tensors, a
            contiguous float32/bf16/f16 pool), else the torch path below; True: the C
            kernel or an error; False: the torch path.
        importance: False skips the page masses (a plain decode nobody reads them from):
            the C kernel then runs without its importance code, the torch path without
            the mass sums.
        out: where the C kernel writes the output (contiguous float32 ``[bs, q_heads, Dv]``,
            e.g. the caller's attention output: no copy afterwards); the torch path and
            another layout return a fresh tensor. The returned ``output`` is it either way.

    Returns:
        DecodeImportanceOutput: ``output`` float32 ``[bs, q_heads, Dv]``, ``lse`` float32,
        ``importance`` ``[bs, max_pages]`` and ``importance_per_kv_head``
        ``[bs, max_pages, kv_heads]`` in listed order (float32; both None with
        ``importance=False``). A request without a valid token gets zero output, lse and
        importance.
    """
    bs, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    v_head_dim = v_pages.shape[-1]
    if page_size != plan.page_size:
        raise ValueError(f"k_pages has pages of {page_size} tokens, the plan {plan.page_size}")
    if plan.batch_size != bs:
        raise ValueError(f"q has {bs} requests, the plan {plan.batch_size}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q_heads={num_q_heads} is not a multiple of kv_heads={num_kv_heads}")
    if (extra_k_pages is None) != (extra_v_pages is None):
        raise ValueError("extra_k_pages and extra_v_pages go together")
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    ws = workspace if workspace is not None else PagedDecodeWorkspace()
    if native is not False:
        lib = _native.library() if bs else None
        inputs = _native_inputs(lib, q, k_pages, v_pages, extra_k_pages, extra_v_pages, plan, ws, importance)
        if inputs is not None:
            return _decode_native(
                lib,
                inputs,
                q,
                k_pages,
                v_pages,
                plan,
                sm_scale,
                logit_cap,
                sinks,
                extra_k_pages,
                extra_v_pages,
                importance,
                out,
            )
        if native:
            raise RuntimeError("native=True, but the C decode kernel is not built or does not take these inputs")
    f32, dev = torch.float32, q.device
    max_pages = plan.max_pages
    tokens = max_pages * page_size
    if chunk_pages is None:
        page_bytes = page_size * num_kv_heads * head_dim * 4
        chunk_pages = max(16, DEFAULT_CHUNK_BYTES // (bs * page_bytes)) if bs else max_pages
    chunk = max_pages if not chunk_pages else max(1, min(chunk_pages, max_pages))
    k_gather = _Gather(k_pages, extra_k_pages, plan.table, ws, "k")
    v_gather = _Gather(v_pages, extra_v_pages, plan.table, ws, "v")

    # Scaling q (a few hundred numbers) instead of the logits (tokens x heads of them).
    qf = (q.to(f32) * sm_scale).view(bs, num_kv_heads, group, head_dim)
    scores = ws.get("scores", (bs, num_kv_heads, group, tokens), f32, dev)
    for c0 in range(0, max_pages, chunk):
        c1 = min(c0 + chunk, max_pages)
        k = k_gather(c0, c1)  # [bs, n, kv, D]
        for h in range(num_kv_heads):
            # [bs, g, D] @ [bs, D, n]: the KV head's query heads are the rows, its tokens
            # the long side (measured ~3x faster in MKL than tokens as rows, M=3 vs M=n).
            torch.bmm(qf[:, h], k[:, :, h].transpose(1, 2), out=scores[:, h, :, c0 * page_size : c1 * page_size])
    if logit_cap > 0:
        scores.div_(logit_cap).tanh_().mul_(logit_cap)
    scores.add_(plan.bias[:, None, None, :])

    peak = scores.amax(dim=-1, keepdim=True)
    sink_logit = None
    if sinks is not None:
        sink_logit = sinks.to(f32).view(1, num_kv_heads, group, 1)
        peak = torch.maximum(peak, sink_logit)
    # A request without a valid token has peak -inf; 0 keeps exp() finite there.
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    weights = scores.sub_(peak).exp_()  # in place: the logits are not needed again
    denom = weights.sum(dim=-1, keepdim=True)
    if sink_logit is not None:
        denom = denom + torch.exp(sink_logit - peak)

    out = torch.zeros(bs, num_kv_heads, group, v_head_dim, dtype=f32, device=dev)
    for c0 in range(0, max_pages, chunk):
        c1 = min(c0 + chunk, max_pages)
        v = v_gather(c0, c1)
        for h in range(num_kv_heads):
            out[:, h].baddbmm_(weights[:, h, :, c0 * page_size : c1 * page_size], v[:, :, h])
    live = plan.live.view(bs, 1, 1, 1)
    inv = torch.where(live, 1.0 / denom, 0.0)
    output = out.mul_(inv).view(bs, num_q_heads, v_head_dim)
    lse = torch.where(live, peak + torch.log(denom), 0.0).view(bs, num_q_heads)
    if not importance:
        return DecodeImportanceOutput(output=output, lse=lse, importance=None, importance_per_kv_head=None)
    # [bs, kv, g, pages, page_size] -> mass per (request, kv head, page), mean over the group
    mass = weights.view(bs, num_kv_heads, group, max_pages, page_size).sum(-1)
    per_kv = mass.mul_(inv).mean(dim=2).transpose(1, 2).contiguous()  # [bs, pages, kv]
    return DecodeImportanceOutput(
        output=output,
        lse=lse,
        importance=per_kv.mean(dim=-1),
        importance_per_kv_head=per_kv,
    )


_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Tokens of one online-softmax update in the C kernel (BLOCK_TOKENS in csrc/paged_decode.c;
# a page larger than that is a block of its own).
_NATIVE_BLOCK_TOKENS = 32
# Per work item the kernel keeps on its stack: a block's logits and its K and V rows as
# float32 (a bf16/f16 pool's, converted), q_heads x Dv sums and the scaled query. 512 KiB,
# well inside a thread's stack.
_NATIVE_MAX_STACK_FLOATS = 1 << 17


def _native_fits(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    extra_k: Optional[torch.Tensor],
    extra_v: Optional[torch.Tensor],
) -> bool:
    pools = [k_pages, v_pages] + ([extra_k, extra_v] if extra_k is not None else [])
    block = max(k_pages.shape[1], _NATIVE_BLOCK_TOKENS)
    rows = block * k_pages.shape[2] * (k_pages.shape[-1] + v_pages.shape[-1])
    return (
        q.device.type == "cpu"
        and all(t.device.type == "cpu" and t.dtype == k_pages.dtype for t in pools)
        and _pools_laid_out(k_pages, v_pages, extra_k, extra_v)
        and k_pages.dtype in _NATIVE_DTYPES
        and q.shape[1] * (block + v_pages.shape[-1] + q.shape[2] + 3) + rows + 8 * block <= _NATIVE_MAX_STACK_FLOATS
    )


def _pools_laid_out(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    extra_k: Optional[torch.Tensor] = None,
    extra_v: Optional[torch.Tensor] = None,
) -> bool:
    """What the C kernel reads: the pool contiguous; staging pages with each token's heads
    side by side, pages and tokens at any stride (a host pool's layer view in place)."""
    rows = (t is None or (t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]) for t in (extra_k, extra_v))
    return k_pages.is_contiguous() and v_pages.is_contiguous() and all(rows)


class _NativeInputs(NamedTuple):
    """What a plan's C decode calls share, made at its first call: the key it was made
    for (workspace, importance, threads, the pools' and q's layout), the thread count, the
    pages a split holds, the splits the scratch buffers are sized for (the one count the C kernel
    indexes them by) and the lists' and scratch buffers' addresses (the tensors kept alive beside them)."""

    key: tuple
    threads: int
    split_pages: int
    splits: int
    kept: tuple
    pointers: list


def _native_inputs(
    lib,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    extra_k: Optional[torch.Tensor],
    extra_v: Optional[torch.Tensor],
    plan: PagedDecodePlan,
    ws: PagedDecodeWorkspace,
    importance: bool,
) -> Optional[_NativeInputs]:
    """The plan's C-kernel inputs, or None where the kernel does not take these tensors.
    Every layer of a step calls this: a hit costs a key compare and two contiguity checks."""
    if lib is None:
        return None
    threads = torch.get_num_threads()
    extra = None if extra_k is None else (extra_k.dtype, extra_v.dtype)
    key = (ws, bool(importance), threads, k_pages.shape, v_pages.shape, k_pages.dtype, q.shape, extra)
    cached = plan.native_inputs
    pools = (k_pages, v_pages) if extra_k is None else (k_pages, v_pages, extra_k, extra_v)
    if cached is not None and cached.key == key and _pools_laid_out(*pools):
        return cached  # the key and the layout are what _native_fits found fitting
    if not _native_fits(q, k_pages, v_pages, extra_k, extra_v):
        return None
    bs, num_q_heads, _ = q.shape
    kv_heads, v_dim, max_pages = k_pages.shape[2], v_pages.shape[-1], plan.max_pages
    group, f32, cpu = num_q_heads // kv_heads, torch.float32, q.device
    # A split is SPLIT_TOKENS of a request's list, whatever the batch: its sums, and so its
    # output, are the same alone and beside longer lists (the C kernel splits alike).
    split_pages = max(1, SPLIT_TOKENS // k_pages.shape[1])
    splits = max(1, -(-max_pages // split_pages))
    table = plan.table.to(torch.int64).contiguous()
    tokens = plan.tokens.to(torch.int64).contiguous()
    live = plan.live.contiguous().view(torch.uint8) if plan.live.dtype == torch.bool else plan.live.to(torch.uint8)
    scratch = [
        ws.get("native_split_max", (bs, kv_heads, splits, group), f32, cpu),
        ws.get("native_split_sum", (bs, kv_heads, splits, group), f32, cpu),
        ws.get("native_split_acc", (bs, kv_heads, splits, group, v_dim), f32, cpu),
    ]
    if importance:
        scratch[:0] = [
            ws.get("native_page_max", (bs, kv_heads, max_pages, group), f32, cpu),
            ws.get("native_page_sum", (bs, kv_heads, max_pages, group), f32, cpu),
        ]
    # The tensors stay referenced here, so their addresses hold for the step. Kept on the
    # plan only where the lists are its own tensors (no converted copy), so a plan
    # updated in place between calls (a captured step's) is still read as it stands.
    kept = (table, tokens, live, *scratch)
    inputs = _NativeInputs(key, threads, split_pages, splits, kept, [t.data_ptr() for t in kept])
    same = all(a.data_ptr() == b.data_ptr() for a, b in zip(kept, (plan.table, plan.tokens, plan.live)))
    plan.native_inputs = inputs if same else None
    return inputs


def _decode_native(
    lib,
    inputs: _NativeInputs,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: PagedDecodePlan,
    sm_scale: float,
    logit_cap: float,
    sinks: Optional[torch.Tensor],
    extra_k: Optional[torch.Tensor],
    extra_v: Optional[torch.Tensor],
    importance: bool = True,
    into: Optional[torch.Tensor] = None,
) -> DecodeImportanceOutput:
    bs, num_q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    v_dim, group, max_pages = v_pages.shape[-1], num_q_heads // kv_heads, plan.max_pages
    f32 = torch.float32
    table_p, tokens_p, live_p, *scratch_p = inputs.pointers
    page_max_p, page_sum_p = scratch_p[:-3] if importance else (None, None)
    split_max_p, split_sum_p, split_acc_p = scratch_p[-3:]
    # Rows of heads side by side (a view of a fused QKV output too): read in place.
    qf = q if q.dtype == f32 and q.stride(2) == 1 and q.stride(1) == head_dim else q.to(f32).contiguous()
    sink_logits = sinks.to(f32).contiguous() if sinks is not None else None
    mass = torch.empty(bs, max_pages, kv_heads, dtype=f32) if importance else None
    fits = into is not None and into.dtype == f32 and into.shape == (bs, num_q_heads, v_dim) and into.is_contiguous()
    out = into if fits else torch.empty(bs, num_q_heads, v_dim, dtype=f32)
    lse = torch.empty(bs, num_q_heads, dtype=f32)

    def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
        return t.data_ptr() if t is not None else None

    rc = lib.sgl_paged_decode(
        ptr(qf), qf.stride(0), float(sm_scale), ptr(k_pages), ptr(v_pages), ptr(extra_k), ptr(extra_v),
        table_p, tokens_p, live_p, ptr(sink_logits),
        num_pages, extra_k.shape[0] if extra_k is not None else 0,
        *(extra_k.stride()[:2] + extra_v.stride()[:2] if extra_k is not None else (0, 0, 0, 0)), bs, max_pages,
        page_size, kv_heads, group, head_dim, v_dim,
        _NATIVE_DTYPES[k_pages.dtype], inputs.split_pages, inputs.splits, float(logit_cap), int(importance),
        page_max_p, page_sum_p, split_max_p, split_sum_p, split_acc_p,
        ptr(out), ptr(lse), ptr(mass), inputs.threads,
    )  # fmt: skip
    if rc == -2:
        raise IndexError(f"a listed page is outside the pool ({num_pages} pages) and the staging pages")
    if rc != 0:
        raise RuntimeError(f"sgl_paged_decode returned {rc}")
    if mass is None:
        return DecodeImportanceOutput(output=out, lse=lse, importance=None, importance_per_kv_head=None)
    return DecodeImportanceOutput(output=out, lse=lse, importance=mass.mean(dim=-1), importance_per_kv_head=mass)


class _Gather:
    """Listed pages ``[c0, c1)`` of every request as float32 ``[bs, n, kv_heads, D]``,
    copied page by page into the workspace (converted there when the pool is not float32)."""

    def __init__(
        self,
        pages: torch.Tensor,
        extra: Optional[torch.Tensor],
        table: torch.Tensor,
        ws: PagedDecodeWorkspace,
        name: str,
    ) -> None:
        self.pages, self.extra, self.table, self.ws, self.name = pages, extra, table, ws, name
        num_pages = pages.shape[0]
        self.staged = None
        if extra is not None:
            self.staged = table >= num_pages
            self.local = torch.where(self.staged, 0, table)
        else:
            self.local = table

    def __call__(self, c0: int, c1: int) -> torch.Tensor:
        bs = self.table.shape[0]
        num_pages, page_size, kv_heads, dim = self.pages.shape
        rows = bs * (c1 - c0)
        flat = self.pages.view(num_pages, -1)
        ids = self.local[:, c0:c1].reshape(-1)
        raw = self.ws.get(self.name + "_raw", (rows, flat.shape[1]), flat.dtype, flat.device)
        torch.index_select(flat, 0, ids, out=raw)
        if self.staged is not None:
            where = self.staged[:, c0:c1].reshape(-1).nonzero().squeeze(1)
            if where.numel():
                # Staged pages may live on the host (a released page read from its copy).
                extra_ids = (self.table[:, c0:c1].reshape(-1)[where] - num_pages).to(self.extra.device)
                # Whole pages by id, then flattened: a page of a host layer view may hold other
                # layers' rows between its tokens (SGLang's page_first).
                staged = self.extra.index_select(0, extra_ids).reshape(where.numel(), -1)
                raw[where] = staged.to(raw.device, raw.dtype)
        if raw.dtype != torch.float32:
            got = self.ws.get(self.name, raw.shape, torch.float32, raw.device)
            got.copy_(raw)
            raw = got
        return raw.view(bs, (c1 - c0) * page_size, kv_heads, dim)
