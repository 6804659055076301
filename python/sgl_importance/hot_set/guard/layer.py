"""Part 2 of a guarded layer: choose the rest pages to read, read them once, bound the rest.

The exact part (part 1: sinks, window and the pages not coded yet) comes in; then, per
guarded request, with fixed shapes and no host in the loop:

1. **selection** (``wanted_pages``): each query head wants the fewest rest pages whose
   masses estimated from their key codes, with the exact part's, reach ``top_p`` of its
   total (top-p); a page any head wants is wanted. Of the wanted pages still on the device
   the ``cap`` with the largest share in any head are read exactly, in one read. Where the
   reader reaches the host pool (``from_host``: the CPU's, ``guard_reads.py``) a released
   page is read from its host copy like any other; elsewhere a wanted page that was
   released is a *miss*: not read, counted, and promoted for later steps through the
   residency owner;
2. **the rest** (every page not read) is estimated from the request's page sample
   (Horvitz-Thompson, ``estimate.combine``; bound ``B_stat``) or left out under the
   deterministic bound (``estimate.negligible_rest``; ``B_det``), whichever bound is
   smaller: the layer's output comes with ``min(B_det, B_stat)``;
3. **a flag**: where that bound exceeds the request's ``guard_threshold`` the layer-step is
   flagged (counted, and the request's cap for that layer rises for its later steps:
   ``decode.py``). Nothing is read again: what a layer reads never exceeds its cap.

``read_exactly`` is called once a layer and must take an all-false mask (lse -inf,
output 0). The selection's inputs are the key codes (``estimate.estimate_outside``), which
never look at the sample, so the pages left unread keep the sample uniform over them.

Torch (``guard_layer``: the CPU's step, and the kernels' reference), but on a GPU (CUDA
tensors) the selection (``select_pages``: three Triton launches) and the merge with the
sampled estimate (``_combine``: two). The Triton backend's guarded layer, eager or captured,
is ``read_rest`` with those launches and ``weigh_bounds_triton``: the layer's end in three.
Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from sgl_importance.hot_set.guard.estimate import (
    MIN_SAMPLED,
    T_QUANTILES,
    Combined,
    Outside,
    Sampled,
    Z,
    combine,
    negligible_rest,
)
from sgl_kernel_ext import HAS_TRITON, merge_parts

if HAS_TRITON:
    from sgl_kernel_ext import combine_rest_triton, guard_finish_triton, guard_select_triton

NEG_INF = float("-inf")


class GuardOutcome(NamedTuple):
    """One guarded layer over the outside plan's ``[n, P]`` rest pages.

    Attributes:
        combined: the output, lse and bound with the selection's reads merged in.
        read: bool ``[n, P]``: rest pages read exactly in this layer (at most the cap).
        wanted: bool ``[n, P]``: rest pages the top-p selection wanted (read or missed).
        missed: bool ``[n, P]``: wanted pages that were released and not read (none
            ``from_host``: a released page is read from its host copy there).
        estimated: bool ``[n, P]``: rest pages left to the estimate.
        flagged: bool ``[n]``: requests whose bound exceeds their threshold.
        mass: float64 ``[n, P]``: each rest page's estimated share of the combined
            denominator, largest over query heads (ranks unread pages for promotion).
        deterministic: the read pages alone with the deterministic bound (never exceeded).
        statistical: the sampled estimate of the rest with its bound (exceeded with
            probability at most ``estimate.DELTA`` over the request's sample);
            ``combined`` is whichever has the smaller bound.
    """

    combined: Combined
    read: torch.Tensor
    wanted: torch.Tensor
    missed: torch.Tensor
    estimated: torch.Tensor
    flagged: torch.Tensor
    mass: torch.Tensor
    deterministic: Combined
    statistical: Combined


def wanted_pages(lse: torch.Tensor, page_lse: torch.Tensor, valid: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool ``[n, P]``: the rest pages some query head needs to reach ``top_p`` of its mass.

    Per query head, the rest pages by estimated mass, largest first, are wanted while the
    exact part's mass and the larger pages' fall short of ``top_p`` of the total (the
    exact part plus every rest page's estimate); a page any head wants is wanted.

    Args:
        lse: ``[n, Hq]`` the exact part's log denominator.
        page_lse: ``[n, Hq, P]`` the rest pages' estimated log masses.
        valid: bool ``[n, P]``; top_p: ``[n]``.
    """
    rest = page_lse.masked_fill(~valid[:, None, :], NEG_INF)
    total = torch.logaddexp(lse, torch.logsumexp(rest, dim=-1))  # [n, Hq]
    total = torch.where(torch.isfinite(total), total, 0.0)
    share = torch.exp(rest - total[..., None])  # [n, Hq, P], 0 off the rest
    exact = torch.exp(lse - total).nan_to_num(0.0)  # [n, Hq]
    return top_p_mask(share, exact, top_p[:, None].to(share.dtype)).any(dim=1)


def top_p_mask(share: torch.Tensor, held: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool, ``share``'s shape ``[..., P]``: the fewest pages, largest share first, that with
    the share already ``held`` ``[...]`` reach ``top_p`` (broadcast against ``held``); a
    fixed-shape sort, nothing read on the host."""
    ordered, order = torch.sort(share, dim=-1, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered  # the larger pages' share
    need = (held[..., None] + before < top_p[..., None]) & (ordered > 0)
    return torch.zeros_like(need).scatter_(-1, order, need)


def capped(weight: torch.Tensor, chosen: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """bool ``[n, P]``: per row, at most ``cap`` of the ``chosen`` pages, the largest
    ``weight`` first, ties to the lower column (a fixed-shape sort; no row's count is read
    on the host)."""
    key = weight.masked_fill(~chosen, NEG_INF)
    order = torch.argsort(key, dim=1, descending=True, stable=True)
    ranks = torch.arange(order.shape[1], device=order.device)[None, :]
    keep = torch.zeros_like(chosen).scatter_(1, order, ranks < cap[:, None])  # cap on the device already
    return keep & chosen


def select_pages(
    lse: torch.Tensor,
    page_lse: torch.Tensor,
    valid: torch.Tensor,
    released: torch.Tensor,
    top_p: torch.Tensor,
    cap: torch.Tensor,
    *,
    use_triton: Optional[bool] = None,
    from_host: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(wanted, missed, read)``, bool ``[n, P]``: the pages top-p wants, those of them
    released (none ``from_host``, where a released page is read from its host copy), and
    the readable rest of them read, at most ``cap``, the heaviest first.

    ``use_triton`` None: three Triton launches for CUDA tensors
    (``sgl_kernel_ext.guard_select_triton``: top-p by bisection, no sort), the torch
    code below otherwise (its reference)."""
    if from_host:
        # Every page can be read: none is missed, and the selection is the one with every
        # page on the device.
        released = torch.zeros_like(released)
    if use_triton is None:
        use_triton = HAS_TRITON and page_lse.is_cuda
    if use_triton:
        return guard_select_triton(lse, page_lse, valid, released, top_p, cap)
    wanted = wanted_pages(lse, page_lse, valid, top_p)
    weight = page_lse.amax(dim=1)  # [n, P] the page's largest log mass in any head
    return wanted, wanted & released, capped(weight, wanted & ~released, cap)


class GuardReads(NamedTuple):
    """A guarded layer's selection and reads, before its bounds are weighed (``read_rest``).

    Attributes:
        wanted, missed, read: bool ``[n, P]`` (``GuardOutcome``'s).
        lse, out: the exact part with the read pages merged in.
        statistical: the sampled estimate of the unread rest with its bound.
    """

    wanted: torch.Tensor
    missed: torch.Tensor
    read: torch.Tensor
    lse: torch.Tensor
    out: torch.Tensor
    statistical: Combined


def read_rest(
    lse: torch.Tensor,
    out: torch.Tensor,
    outside: Outside,
    sampled: Sampled,
    valid: torch.Tensor,
    in_sample: torch.Tensor,
    inclusion: torch.Tensor,
    released: torch.Tensor,
    top_p: torch.Tensor,
    cap: torch.Tensor,
    read_exactly: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    *,
    use_triton: Optional[bool] = None,
    from_host: bool = False,
) -> GuardReads:
    """Steps 1 and 2 of ``guard_layer`` (its arguments): the selection, its one read, the
    sampled estimate of the rest. ``use_triton`` None: the Triton kernels for CUDA tensors;
    True: them whatever the device (under the interpreter on a CPU). A captured step ends
    the layer in three launches (``sgl_kernel_ext.guard_finish_triton``); ``guard_layer`` in torch."""
    select = dict(use_triton=use_triton, from_host=from_host)
    wanted, missed, read = select_pages(lse, outside.page_lse, valid, released, top_p, cap, **select)
    masks = (valid, read, in_sample)
    lse, out, statistical = _combine(lse, out, read_exactly(read), outside, sampled, masks, inclusion, use_triton)
    return GuardReads(wanted, missed, read, lse, out, statistical)


def guard_layer(
    lse: torch.Tensor,
    out: torch.Tensor,
    outside: Outside,
    sampled: Sampled,
    valid: torch.Tensor,
    in_sample: torch.Tensor,
    inclusion: torch.Tensor,
    thresholds: torch.Tensor,
    released: torch.Tensor,
    top_p: torch.Tensor,
    cap: torch.Tensor,
    read_exactly: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    *,
    from_host: bool = False,
) -> GuardOutcome:
    """Top-p of the rest by its key codes, at most ``cap`` pages read, the rest estimated.

    Args:
        lse, out: the exact part's ``[n, Hq]`` lse and ``[n, Hq, Dv]`` output.
        outside: the rest pages' logit intervals.
        sampled: the sampled rest pages: the plan's first columns (each request lists
            its sampled pages first), read where ``in_sample``.
        valid, in_sample: bool ``[n, P]``: the plan's real entries, and those sampled.
        inclusion: ``[n]`` each request's ``pi``.
        thresholds: ``[n]`` each request's ``guard_threshold``.
        released: bool ``[n, P]`` rest pages with no device page (read only ``from_host``).
        top_p: ``[n]``; cap: int64 ``[n]`` the most rest pages read in this layer.
        read_exactly: bool ``[n, P]`` chosen pages -> their exact ``(lse, output)``; a
            row with no page chosen gets lse -inf and output 0.
        from_host: ``read_exactly`` reads a released page from its host copy, so the
            selection may choose it.
    """
    reads = read_rest(
        lse, out, outside, sampled, valid, in_sample, inclusion, released, top_p, cap, read_exactly, from_host=from_host
    )
    return weigh_bounds(reads, outside, valid, thresholds)


def weigh_bounds_triton(
    reads: GuardReads,
    outside: Outside,
    valid: torch.Tensor,
    in_sample: torch.Tensor,
    thresholds: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    *,
    tally: torch.Tensor,
    output: torch.Tensor,
    per_kv: torch.Tensor,
    layer: int,
    layers: int,
) -> torch.Tensor:
    """``weigh_bounds`` as the Triton backend runs it after ``read_rest(..., use_triton=True)``,
    in a CUDA graph or not: three launches (``sgl_kernel_ext.guard_finish_triton``) that write the
    layer's output into ``output``, the guard's tally row into ``tally`` (``step_tally.guard_rows``;
    ``layer`` of ``layers``) and scales part 1's per-KV-head masses ``per_kv`` in place into
    shares of the chosen denominator. ``lse``, ``out``: part 1 as it came (the output of a row
    with no rest). Returns ``per_kv``'s mean over KV heads."""
    intervals = (outside.page_lse, outside.logit_error, outside.value_norm)
    masks = (valid, reads.read, reads.wanted, reads.missed, in_sample)
    statistical = tuple(vars(reads.statistical).values())
    finish = (thresholds, out, lse, tally, output, per_kv)
    ends = guard_finish_triton(reads.lse, reads.out, statistical, intervals, masks, *finish, layer=layer, layers=layers)
    return ends[2]


def weigh_bounds(reads: GuardReads, outside: Outside, valid: torch.Tensor, thresholds: torch.Tensor) -> GuardOutcome:
    """Step 3 of ``guard_layer``: the deterministic bound, the smaller bound's output, the
    flag, the estimated masses (torch; ``sgl_kernel_ext.guard_finish_triton`` in a
    captured step on a GPU)."""
    wanted, missed, read, lse, out, statistical = reads
    deterministic = negligible_rest(lse, out, outside, valid & ~read)
    # min(B_det, B_stat): the output that comes with the smaller bound.
    combined = _choose(deterministic.relative <= statistical.relative, deterministic, statistical)
    flagged = combined.relative > thresholds
    estimated = valid & ~read
    # Estimated masses (of the combined denominator) rank unread pages for promotion.
    share = torch.exp(outside.page_lse - combined.lse[..., None]).nan_to_num(0.0)
    mass = share.amax(dim=1).double().masked_fill(~valid, 0.0)
    return GuardOutcome(combined, read, wanted, missed, estimated, flagged, mass, deterministic, statistical)


def part_share(part_lse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The share ``exp(part_lse - lse)`` of a layer's chosen denominator (``Combined.lse``)
    one part of its exact pages holds (part 1's: its pages' masses, shares of its own
    denominator, times this are shares of the chosen one). Not ``Combined.exact_share``,
    which counts the selection's reads too. 0 where the part is empty, at most 1."""
    own = torch.exp(part_lse - lse).clamp(max=1.0)
    return torch.where(torch.isfinite(part_lse), own, 0.0)


def _combine(
    lse: torch.Tensor,
    out: torch.Tensor,
    read_part: tuple[torch.Tensor, torch.Tensor],
    outside: Outside,
    sampled: Sampled,
    masks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    inclusion: torch.Tensor,
    use_triton: Optional[bool],
) -> tuple[torch.Tensor, torch.Tensor, Combined]:
    """The read pages' part merged into the exact part, and ``combine`` over the sampled
    pages still estimated: ``(lse, out)`` of the merged exact part and the estimate.

    ``masks``: ``(valid, read, in_sample)``, bool ``[n, P]``; a page listed and not read is
    still estimated. The plan lists each request's sampled pages first, so ``sampled``
    covers its first columns only. On the Triton path the merge and the masks are done
    inside the estimate's two launches (``combine_rest_triton``)."""
    if use_triton is None:
        use_triton = HAS_TRITON and out.is_cuda
    if use_triton:
        parts = (sampled.lse, sampled.output, inclusion, outside.page_lse, *masks)
        (lse, out), results = combine_rest_triton(
            lse, out, read_part, *parts, quantiles=T_QUANTILES, z=Z, min_sampled=MIN_SAMPLED
        )
        return lse, out, Combined(*results)
    lse, out = merge_parts(lse, out, *read_part, use_triton=False)
    valid, read, in_sample = masks
    keep = valid & ~read
    width = sampled.lse.shape[-1]
    kept = (keep & in_sample)[:, :width]
    lse_pages = sampled.lse.masked_fill(~kept[:, None, :], NEG_INF)
    uncovered = keep.any(dim=1) & ~kept.any(dim=1)
    rest_codes = outside.page_lse.masked_fill(~keep[:, None, :], NEG_INF)
    codes = (rest_codes, rest_codes[..., :width].masked_fill(~kept[:, None, :], NEG_INF))
    estimate = combine(lse, out, Sampled(lse_pages, sampled.output), inclusion, uncovered, codes, use_triton=False)
    return lse, out, estimate


def _choose(which: torch.Tensor, a: Combined, b: Combined) -> Combined:
    """Per request, ``a`` where ``which`` else ``b``."""
    pick = lambda x, y: torch.where(which.view(-1, *([1] * (x.dim() - 1))), x, y)  # noqa: E731
    return Combined(*(pick(x, y) for x, y in zip(a.__dict__.values(), b.__dict__.values())))
