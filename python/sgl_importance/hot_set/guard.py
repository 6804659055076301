"""Part 2 of a guarded layer: account for the rest pages, read what cannot be vouched for.

The exact part (part 1, the planned pages) comes in; then, per guarded request:

1. the rest pages whose key codes say they could be heavy are read exactly
   (``estimate.heavy_pages``; deterministic) and merged into the exact part;
2. the remaining rest is estimated from its sampled pages (``estimate.combine``),
   with a statistical bound on the layer's output error; where that bound is too wide
   but the rest's upper mass is so small that leaving it out is within the threshold
   (``estimate.negligible_rest``, deterministic), the rest is left out;
3. where that bound exceeds the request's ``guard_threshold``, the heaviest quarter of
   the remaining rest (by its key codes) is read exactly and the bound computed again,
   up to ``GUARD_ROUNDS`` times; then every remaining rest page is read (the
   *fallback*; the output is then exact).

No step of it waits on the host: every round runs for every request, whatever the
bounds say (a request with nothing to read chooses no page, and an empty read merges
as nothing: lse -inf, output 0), so what a layer queues does not depend on device
values. The results are those of stopping where no bound is over: a request under its
threshold chooses nothing in the later rounds, and its estimate, computed again from
the same inputs, is the same. ``read_exactly`` is called ``GUARD_ROUNDS + 2`` times a
layer and must take an all-false mask.

Plain torch, but for the merge of two softmax parts (``sgl_kernel_ext.merge_parts``:
a Triton kernel on a GPU, torch elsewhere); nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from sgl_importance.hot_set.estimate import Combined, Outside, Sampled, combine, heavy_pages, negligible_rest
from sgl_kernel_ext import merge_parts

NEG_INF = float("-inf")
# Rounds that read the heaviest READ_SHARE of the rest before the guard reads all of it.
GUARD_ROUNDS = 2
READ_SHARE = 0.25


class GuardOutcome(NamedTuple):
    """One guarded layer over the outside plan's ``[n, P]`` rest pages.

    Attributes:
        combined: the output, lse and bound with the guard's reads merged in.
        read: bool ``[n, P]``: rest pages read exactly (heavy or fallback) in this layer.
        estimated: bool ``[n, P]``: rest pages left to the sampled estimate.
        fallback: bool ``[n]``: requests whose remaining rest was read whole.
        negligible: bool ``[n]``: requests whose rest was left out under the
            deterministic bound (``estimate.negligible_rest``).
        mass: float64 ``[n, P]``: each rest page's estimated share of the combined
            denominator, largest over query heads (ranks unread pages for promotion).
    """

    combined: Combined
    read: torch.Tensor
    estimated: torch.Tensor
    fallback: torch.Tensor
    negligible: torch.Tensor
    mass: torch.Tensor


def guard_layer(
    lse: torch.Tensor,
    out: torch.Tensor,
    outside: Outside,
    sampled: Sampled,
    valid: torch.Tensor,
    in_sample: torch.Tensor,
    inclusion: torch.Tensor,
    thresholds: torch.Tensor,
    read_exactly: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> GuardOutcome:
    """Heavy pages exactly, the rest from the sample, a fallback where the bound is too wide.

    Args:
        lse, out: the exact part's ``[n, Hq]`` lse and ``[n, Hq, Dv]`` output.
        outside: the rest pages' logit intervals.
        sampled: the sampled rest pages: the plan's first columns (each request lists
            its sampled pages first), read where ``in_sample``.
        valid, in_sample: bool ``[n, P]``: the plan's real entries, and those sampled.
        inclusion: ``[n]`` each request's ``pi``.
        thresholds: ``[n]`` each request's ``guard_threshold``.
        read_exactly: bool ``[n, P]`` chosen pages -> their exact ``(lse, output)``; a
            row with no page chosen gets lse -inf and output 0.
    """
    read = heavy_pages(lse, outside, valid)
    lse_a, out_a = read_exactly(read)
    lse, out = merge_parts(lse, out, lse_a, out_a)
    combined = _account(lse, out, outside, sampled, valid & ~read, in_sample, inclusion, thresholds)
    fallback = torch.zeros_like(thresholds, dtype=torch.bool)
    for round_ in range(GUARD_ROUNDS + 1):
        # Every round runs (no host test of ``over``): requests under their threshold
        # choose nothing, and their estimate comes out as it was.
        over = combined.relative > thresholds
        remaining = valid & ~read & over[:, None]
        if round_ < GUARD_ROUNDS:
            # The heaviest part of the rest by its key codes (chosen without looking at
            # the sample, so what is left is still sampled uniformly): a lighter rest
            # leaves the estimate less to be wrong about.
            chosen = _heaviest(outside, remaining, READ_SHARE)
        else:
            chosen, fallback = remaining, over
        lse_b, out_b = read_exactly(chosen)
        lse, out = merge_parts(lse, out, lse_b, out_b)
        read = read | chosen
        combined = _account(lse, out, outside, sampled, valid & ~read, in_sample, inclusion, thresholds)
    estimated = valid & ~read
    # Estimated masses (of the combined denominator) rank unread pages for promotion.
    share = torch.exp(outside.page_lse - combined.lse[..., None]).nan_to_num(0.0)
    mass = share.amax(dim=1).double().masked_fill(~valid, 0.0)
    negligible = (combined.exact_share == 1.0).all(dim=1) & estimated.any(dim=1)
    return GuardOutcome(combined, read, estimated, fallback, negligible, mass)


def _account(lse, out, outside, sampled, keep, in_sample, inclusion, thresholds) -> Combined:
    """The rest ``keep`` from the sample, or left out where it is too light to matter."""
    combined = _combine(lse, out, outside, sampled, keep, in_sample, inclusion)
    light = negligible_rest(lse, out, outside, keep)
    use_light = (combined.relative > thresholds) & (light.relative <= thresholds)
    return _choose(use_light, light, combined)


def _heaviest(outside: Outside, remaining: torch.Tensor, share: float) -> torch.Tensor:
    """bool ``[n, P]``: per row, the ``share`` of ``remaining`` pages (rounded up) with the
    largest estimated mass in any query head."""
    weight = outside.page_lse.amax(dim=1).masked_fill(~remaining, NEG_INF)  # [n, P]
    count = remaining.sum(dim=1)
    take = torch.ceil(count.to(torch.float32) * share).to(torch.int64)
    order = torch.argsort(weight, dim=1, descending=True)
    ranks = torch.arange(order.shape[1], device=order.device)[None, :]
    chosen = torch.zeros_like(remaining)
    chosen.scatter_(1, order, ranks < take[:, None])
    return chosen & remaining


def _combine(
    lse: torch.Tensor,
    out: torch.Tensor,
    outside: Outside,
    sampled: Sampled,
    keep: torch.Tensor,
    in_sample: torch.Tensor,
    inclusion: torch.Tensor,
) -> Combined:
    """``combine`` over the sampled pages still estimated (``keep``); the plan lists each
    request's sampled pages first, so ``sampled`` covers its first columns only."""
    width = sampled.lse.shape[-1]
    kept = (keep & in_sample)[:, :width]
    lse_pages = sampled.lse.masked_fill(~kept[:, None, :], NEG_INF)
    uncovered = keep.any(dim=1) & ~kept.any(dim=1)
    rest_codes = outside.page_lse.masked_fill(~keep[:, None, :], NEG_INF)
    codes = (rest_codes, rest_codes[..., :width].masked_fill(~kept[:, None, :], NEG_INF))
    return combine(lse, out, Sampled(lse_pages, sampled.output), inclusion, uncovered, codes)


def _choose(which: torch.Tensor, a: Combined, b: Combined) -> Combined:
    """Per request, ``a`` where ``which`` else ``b``."""
    pick = lambda x, y: torch.where(which.view(-1, *([1] * (x.dim() - 1))), x, y)  # noqa: E731
    return Combined(*(pick(x, y) for x, y in zip(a.__dict__.values(), b.__dict__.values())))
