"""The Triton decode-with-importance kernel over a step's page lists.

:class:`TritonPageListDecode` takes what :func:`~sgl_kernel_ext.decode_importance_paged`
takes (the pool viewed as pages, a :class:`~sgl_kernel_ext.PagedDecodePlan`, optional
staging buffers) and returns the same :class:`DecodeImportanceOutput`, computed by the
split-K kernel of ``decode_importance`` (``decode_importance_fwd``). It is what a GPU
backend hands the hot set as its exact reader.

The kernel walks each request's *slot list* and groups it into pages by position:
column ``j`` of a request's importance is its slots ``[j * page_size, (j + 1) *
page_size)``. :func:`page_list_slots` therefore writes every listed page as a whole
``page_size`` run, in listed order: the page's valid slots, then slot 0 for the rest.
Slot 0 lies on SGLang's padding page 0, which the kernel masks (``mask_page0``), so a
partial page, a page listed with no tokens or one the kernel cannot address costs its
run but adds nothing and keeps the columns after it in place.

Two kinds of listed page the kernel cannot address:

- *staged* pages (ids at or past the pool's page count, read from ``extra_*``): the
  kernel reads one KV buffer by slot, and copying the pool and the staging buffers into
  one is what staging exists to avoid;
- page 0 listed with tokens (a caller of ``plan_paged_decode`` may do so; SGLang never
  stores a token there): the kernel masks it.

Those pages (few: a hot set stages only promotions that found no device page) are read
in plain torch (:func:`_side_pages`) and merged with the kernel's part by their
log-sum-exps, which is exact: the two parts are disjoint sets of tokens of one softmax.
Their page masses are computed per query head against the merged denominator, and the
kernel's pages get theirs from the per-page log-sum-exps the kernel leaves in its
workspace (the kernel's own importance is normalised by its part's denominator only).
Without such pages the kernel's output, lse and importance are returned as they are.

The slot lists are built once per plan (vectorised, on the device) and reused while the
same plan object comes back, as it does for every layer of a step. Whether a plan has
pages the kernel cannot address is decided on the plan's device: a plan built on the
host (the hot set's are) costs no device sync.

Knows nothing of SGLang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .decode_importance import decode_importance_fwd
from .output import DecodeImportanceOutput
from .paged import PagedDecodePlan, PagedDecodeWorkspace
from .plan import decode_geometry, default_num_splits

# Splits per request at most (SGLang's Triton backend defaults to 8 as well).
DEFAULT_MAX_SPLITS = 8


@dataclass
class PageListSlots:
    """A plan's page lists as the kernel reads them.

    Attributes:
        kv_indptr: int32 ``[bs + 1]``: request ``b`` reads
            ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, ``page_size`` slots per
            listed page up to its last page the kernel addresses.
        kv_indices: int64 slots (past ``kv_indptr[-1]``: unused).
        side: bool ``[bs, max_pages]`` on the plan's device: listed pages with tokens the
            kernel cannot address (read in torch), or None when there are none.
        kernel_live: bool ``[bs]``: the request has a token the kernel reads.
        staged: some listed page with tokens is a staged one (needs ``extra_*``).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    side: Optional[torch.Tensor]
    kernel_live: torch.Tensor
    staged: bool = False


def page_list_slots(
    plan: PagedDecodePlan, num_pages: int, device: torch.device | str, *, staged: Optional[bool] = None
) -> PageListSlots:
    """The kernel's slot lists of ``plan`` over a pool of ``num_pages`` pages.

    Args:
        plan: the step's page lists; ``table`` ids ``>= num_pages`` are staged pages.
        num_pages: pages in the pool the kernel reads.
        device: where the kernel runs.
        staged: whether the plan lists staged pages, where the caller knows it (a plan
            built on the device is then never read back); None: looked up in the plan.

    Returns:
        The slot lists (on ``device``) and which listed pages the kernel leaves out.
    """
    ps = plan.page_size
    table, tokens = plan.table, plan.tokens
    bs, width = table.shape
    with_tokens = tokens > 0
    addressable = with_tokens & (table > 0) & (table < num_pages)
    side = with_tokens & ~addressable
    if staged is None:
        # Decided where the plan lives: a host plan answers without a device sync.
        has_side = bool(side.any())
        staged = has_side and bool((side & (table >= num_pages)).any())
    else:
        # The only pages a hot-set plan lists that the kernel cannot address are staged.
        has_side = staged
    dev = torch.device(device)
    table = table.to(dev, torch.int64)
    tokens = tokens.to(dev, torch.int64)
    addressable = addressable.to(dev)
    cols = torch.arange(1, width + 1, device=dev)
    # Each request's list ends at its last page the kernel reads.
    count = torch.where(addressable, cols[None, :], 0).amax(dim=1)
    lengths = count * ps
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    torch.cumsum(lengths, 0, out=kv_indptr[1:])
    offsets = torch.arange(ps, device=dev)
    slots = table[:, :, None] * ps + offsets[None, None, :]
    keep = addressable[:, :, None] & (offsets[None, None, :] < tokens[:, :, None])
    slots = torch.where(keep, slots, 0)
    # Scatter, not boolean indexing: no device sync for the packed size. Runs past a
    # request's count go to one spare entry past the end.
    spare = bs * width * ps
    dest = kv_indptr[:-1, None, None].to(torch.int64) + (cols[None, :, None] - 1) * ps + offsets[None, None, :]
    dest = torch.where((cols[None, :] <= count[:, None])[:, :, None], dest, spare)
    kv_indices = torch.zeros(spare + 1, dtype=torch.int64, device=dev)
    kv_indices.scatter_(0, dest.reshape(-1), slots.reshape(-1))
    kernel_live = addressable.any(dim=1)
    return PageListSlots(kv_indptr, kv_indices, side if has_side else None, kernel_live, staged)


class TritonPageListDecode:
    """``decode_importance_paged``'s contract, run by the Triton decode kernel.

    One instance serves every layer and step of a model runner: the split workspace
    grows on demand and the slot lists of the last plan are kept for the next call.
    Results are fresh tensors (a caller may keep one while it calls again).

    Args:
        max_splits: most splits per request (the kernel's split-K depth).
        num_splits: splits per request for every call (tests); None: as many as fill the
            device (``default_num_splits``), at most ``max_splits``.
    """

    def __init__(self, *, max_splits: int = DEFAULT_MAX_SPLITS, num_splits: Optional[int] = None) -> None:
        if max_splits < 1 or (num_splits is not None and num_splits < 1):
            raise ValueError(f"max_splits={max_splits} and num_splits={num_splits} must be >= 1")
        self.max_splits = max_splits
        self.num_splits = num_splits
        self._workspace = PagedDecodeWorkspace()
        self._cached: Optional[tuple[PagedDecodePlan, int, torch.device, PageListSlots]] = None

    def slots(
        self, plan: PagedDecodePlan, num_pages: int, device: torch.device, *, staged: Optional[bool] = None
    ) -> PageListSlots:
        """The slot lists of ``plan``, built once while the same plan comes back
        (``staged``: as :func:`page_list_slots` takes it)."""
        cached = self._cached
        if cached is not None and cached[0] is plan and cached[1] == num_pages and cached[2] == device:
            return cached[3]
        built = page_list_slots(plan, num_pages, device, staged=staged)
        self._cached = (plan, num_pages, device, built)
        return built

    def keep_slots(self, plan: PagedDecodePlan, num_pages: int, device: torch.device, slots: PageListSlots) -> None:
        """Use ``slots`` for ``plan`` from now on: a plan whose buffers are rewritten in place
        between steps (a captured step's) has its slot lists rebuilt by its owner."""
        self._cached = (plan, num_pages, device, slots)

    def __call__(
        self,
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
        out: Optional[torch.Tensor] = None,
    ) -> DecodeImportanceOutput:
        """Output, lse and page importance of one decode step over ``plan``'s page lists.

        Args:
            q: ``[bs, q_heads, D]``, the pool's dtype.
            k_pages, v_pages: the layer's pool as pages ``[num_pages, page_size, kv_heads, D]``
                (views of contiguous slot buffers).
            plan: the step's page lists.
            sm_scale, logit_cap, sinks: as ``decode_importance_paged``.
            extra_k_pages, extra_v_pages: staging buffers; listed id ``num_pages + i``
                reads their page ``i`` (any device; read in torch).
            out: ``[bs, q_heads, Dv]`` (any float dtype) the output is written into and
                returned as (a caller's buffer: no copy); None: a float32 tensor.

        Returns:
            DecodeImportanceOutput on ``q``'s device (float32 but ``out``), columns in listed order.
        """
        bs, num_q_heads, head_dim = q.shape
        num_pages, page_size, num_kv_heads, _ = k_pages.shape
        v_head_dim = v_pages.shape[-1]
        if page_size != plan.page_size:
            raise ValueError(f"k_pages has pages of {page_size} tokens, the plan {plan.page_size}")
        if plan.batch_size != bs:
            raise ValueError(f"q has {bs} requests, the plan {plan.batch_size}")
        if q.dtype != k_pages.dtype or v_pages.dtype != k_pages.dtype:
            raise ValueError(f"q/k/v dtypes {q.dtype}/{k_pages.dtype}/{v_pages.dtype} must match for the kernel")
        if (extra_k_pages is None) != (extra_v_pages is None):
            raise ValueError("extra_k_pages and extra_v_pages go together")
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(head_dim)
        dev, f32 = q.device, torch.float32
        width = plan.max_pages
        given = out
        lse = torch.empty(bs, num_q_heads, dtype=f32, device=dev)
        importance = torch.empty(bs, width, dtype=f32, device=dev)
        per_kv = torch.empty(bs, width, num_kv_heads, dtype=f32, device=dev)
        lists = self.slots(plan, num_pages, dev) if bs else None
        # The kernel writes a caller's buffer unless a torch part is merged in (float32 first).
        if given is None or (lists is not None and lists.side is not None):
            out = torch.empty(bs, num_q_heads, v_head_dim, dtype=f32, device=dev)
        if bs == 0:
            return DecodeImportanceOutput(out, lse, importance, per_kv)
        geometry = decode_geometry(num_q_heads, num_kv_heads, head_dim, v_head_dim, page_size)
        splits = self.num_splits or default_num_splits(bs, num_kv_heads, geometry, self.max_splits, dev)
        if lists.staged and extra_k_pages is None:
            raise ValueError(f"the plan lists staged pages (ids >= {num_pages}) but no extra_k_pages/extra_v_pages")
        ws = self._workspace
        page_lse = ws.get("page_lse", (bs, num_q_heads, width), f32, dev)
        decode_importance_fwd(
            q if q.stride(-1) == 1 else q.contiguous(),
            k_pages.view(-1, num_kv_heads, head_dim),
            v_pages.view(-1, num_kv_heads, v_head_dim),
            lists.kv_indptr,
            lists.kv_indices,
            page_size=page_size,
            out=out,
            lse=lse,
            mid_o=ws.get("mid_o", (bs, num_q_heads, splits, v_head_dim), f32, dev),
            mid_lse=ws.get("mid_lse", (bs, num_q_heads, splits), f32, dev),
            num_splits=splits,
            sm_scale=sm_scale,
            logit_cap=logit_cap,
            sinks=sinks,
            page_lse=page_lse,
            importance=importance,
            importance_per_kv_head=per_kv,
            mask_page0=True,
            geometry=geometry,
        )
        if lists.side is None:
            return DecodeImportanceOutput(out, lse, importance, per_kv)
        side = _side_pages(
            q, k_pages, v_pages, plan, lists.side, extra_k_pages, extra_v_pages, sm_scale=sm_scale, logit_cap=logit_cap
        )
        merged = _merge_side(out, lse, page_lse, lists, side, plan, sinks, num_kv_heads)
        if given is None:
            return merged
        given.copy_(merged.output)
        return merged._replace(output=given)


@dataclass
class _Side:
    """The pages read in torch, per request: their softmax part and per-head page masses."""

    lse: torch.Tensor  # [bs, Hq] natural log, -inf where the request has none
    output: torch.Tensor  # [bs, Hq, Dv] normalised by the part's own denominator
    page_lse: torch.Tensor  # [bs, Hq, S] natural log of each page's sum, -inf on padding
    columns: torch.Tensor  # [bs, S] the plan column of each page (width: padding)


def _side_pages(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: PagedDecodePlan,
    side: torch.Tensor,
    extra_k: Optional[torch.Tensor],
    extra_v: Optional[torch.Tensor],
    *,
    sm_scale: float,
    logit_cap: float,
) -> _Side:
    """Attend the listed pages the kernel leaves out (``side``), in float32 torch."""
    dev, f32 = q.device, torch.float32
    bs, num_q_heads, head_dim = q.shape
    num_pages, ps, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    width = plan.max_pages
    # Compact each request's side pages to the left: [bs, S] with S the most any has.
    rank = torch.cumsum(side.to(torch.int64), dim=1) - 1
    most = int(rank[:, -1].max()) + 1  # the plan's device: free for a host plan
    where = torch.where(side, rank, most)  # padding goes to a spare column
    columns = torch.full((bs, most + 1), width, dtype=torch.int64, device=side.device)
    columns.scatter_(1, where, torch.arange(width, device=side.device).expand(bs, width).contiguous())
    columns = columns[:, :most].to(dev)
    valid_col = columns < width
    safe_col = torch.where(valid_col, columns, 0)
    table = plan.table.to(dev, torch.int64).gather(1, safe_col)
    tokens = torch.where(valid_col, plan.tokens.to(dev, torch.int64).gather(1, safe_col), 0)

    staged = table >= num_pages

    def gather(pages: torch.Tensor, extra: Optional[torch.Tensor]) -> torch.Tensor:
        got = pages.index_select(0, torch.where(staged, 0, table).reshape(-1)).to(f32)
        if extra is not None:
            ids = torch.where(staged, table - num_pages, 0).reshape(-1).to(extra.device)
            from_extra = extra.index_select(0, ids).to(dev, f32)
            got = torch.where(staged.reshape(-1, 1, 1, 1), from_extra, got)
        return got.view(bs, most * ps, num_kv_heads, -1)

    k = gather(k_pages, extra_k)  # [bs, S*ps, kv, D]
    v = gather(v_pages, extra_v)
    qf = (q.to(f32) * sm_scale).view(bs, num_kv_heads, group, head_dim)
    logits = torch.einsum("bhgd,bthd->bhgt", qf, k)
    if logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    offsets = torch.arange(ps, device=dev)
    valid = (offsets[None, None, :] < tokens[:, :, None]).reshape(bs, 1, 1, most * ps)
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [bs, kv, g], -inf without a token
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    weights = torch.exp(logits - safe[..., None])
    output = torch.einsum("bhgt,bthd->bhgd", weights, v)
    page_lse = torch.logsumexp(logits.view(bs, num_kv_heads, group, most, ps), dim=-1)
    return _Side(
        lse=lse.reshape(bs, num_q_heads),
        output=output.reshape(bs, num_q_heads, -1),
        page_lse=page_lse.reshape(bs, num_q_heads, most),
        columns=columns,
    )


def _merge_side(
    out: torch.Tensor,
    lse: torch.Tensor,
    page_lse: torch.Tensor,
    lists: PageListSlots,
    side: _Side,
    plan: PagedDecodePlan,
    sinks: Optional[torch.Tensor],
    num_kv_heads: int,
) -> DecodeImportanceOutput:
    """The kernel's part and the torch part as one softmax (sinks counted once, in the kernel's)."""
    bs, num_q_heads = lse.shape
    width = plan.max_pages
    dev = lse.device
    ninf = torch.tensor(float("-inf"), device=dev)
    kernel_live = lists.kernel_live[:, None]
    # The kernel writes lse 0 for a request it reads no token of; its part is then the
    # sink alone (or nothing).
    if sinks is not None:
        empty = sinks.to(dev, torch.float32)[None, :].expand(bs, num_q_heads)
    else:
        empty = ninf.expand(bs, num_q_heads)
    lse_k = torch.where(kernel_live, lse, empty)
    total = torch.logaddexp(lse_k, side.lse)
    live = torch.isfinite(side.lse) | lists.kernel_live[:, None]
    safe = torch.where(torch.isfinite(total), total, 0.0)
    w_k = torch.where(torch.isfinite(lse_k), torch.exp(lse_k - safe), 0.0)
    w_s = torch.where(torch.isfinite(side.lse), torch.exp(side.lse - safe), 0.0)
    output = torch.where(live[..., None], w_k[..., None] * out + w_s[..., None] * side.output, 0.0)
    # Per-head masses against the merged denominator: the kernel's pages from its
    # base-2 page log-sum-exps (written only up to each request's count), the torch
    # part's from its own.
    count = (lists.kv_indptr[1:] - lists.kv_indptr[:-1]).to(torch.int64) // plan.page_size
    in_list = torch.arange(width, device=dev)[None, :] < count[:, None]
    kernel_pages = torch.where(in_list[:, None, :], page_lse * math.log(2.0), ninf)
    mass = torch.exp(kernel_pages - safe[..., None])  # [bs, Hq, W]
    side_mass = torch.exp(side.page_lse - safe[..., None])  # [bs, Hq, S]
    padded = torch.zeros(bs, num_q_heads, width + 1, dtype=torch.float32, device=dev)
    padded.scatter_(2, side.columns[:, None, :].expand_as(side_mass), side_mass)
    mass = mass + padded[..., :width]
    mass = torch.where(live[..., None], mass, 0.0)
    per_kv = mass.view(bs, num_kv_heads, num_q_heads // num_kv_heads, width).mean(dim=2).transpose(1, 2).contiguous()
    return DecodeImportanceOutput(
        output=output,
        lse=torch.where(live, total, 0.0),
        importance=per_kv.mean(dim=-1),
        importance_per_kv_head=per_kv,
    )
