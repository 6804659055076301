"""Part 3 of a guarded layer: read exactly what the error bound cannot vouch for.

The exact part (part 1) and the estimate of every unread page (part 2,
``estimate.estimate_outside``) are folded into one softmax with a bound on the error
of the layer's output (``estimate.combine``). Where a request's bound exceeds its
``guard_threshold``, the most suspect outside pages are read exactly
(``estimate.pages_to_read``), merged into the exact part, and the bound is computed
again; after ``GUARD_ROUNDS`` such rounds, every outside page still estimated is read.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from sgl_importance.hot_set.estimate import Combined, Outside, combine, pages_to_read

# Re-reads of the guard before it reads every outside page of a layer.
GUARD_ROUNDS = 2


class GuardOutcome(NamedTuple):
    """One guarded layer over the outside plan's ``[n, P]`` pages.

    Attributes:
        combined: the output, lse and bound with the guard's reads merged in.
        read: bool ``[n, P]``: outside pages read exactly in this layer.
        estimated: bool ``[n, P]``: outside pages left to their estimate.
        mass: float64 ``[n, P]``: each outside page's estimated mass of the combined
            denominator, the largest over query heads (ranks unread pages for promotion).
    """

    combined: Combined
    read: torch.Tensor
    estimated: torch.Tensor
    mass: torch.Tensor


def guard_layer(
    lse: torch.Tensor,
    out: torch.Tensor,
    estimate: Outside,
    valid: torch.Tensor,
    thresholds: torch.Tensor,
    read_exactly: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> GuardOutcome:
    """Fold the estimate in; read exactly what the bound cannot vouch for.

    Args:
        lse, out: the exact part's ``[n, Hq]`` lse and ``[n, Hq, Dv]`` output of the
            guarded requests.
        estimate: the outside pages' estimate for the same requests.
        valid: bool ``[n, P]``: the outside plan's real (not padding) entries.
        thresholds: ``[n]`` each request's ``guard_threshold``.
        read_exactly: bool ``[n, P]`` chosen pages -> their exact ``(lse, output)``.
    """
    combined = combine(lse, out, estimate)
    keep = valid.clone()
    for round_ in range(GUARD_ROUNDS + 1):
        need = combined.relative > thresholds
        if not bool(need.any()):
            break
        chosen = keep & need[:, None]  # the last round: every outside page
        if round_ < GUARD_ROUNDS:
            picked = torch.zeros_like(valid)
            for t in thresholds[need].unique().tolist():
                picked |= pages_to_read(combined, keep, float(t)) & (need & (thresholds == t))[:, None]
            if bool(picked.any()):
                chosen = picked
        lse_a, out_a = read_exactly(chosen)
        lse, out = merge_parts(lse, out, lse_a, out_a)
        keep &= ~chosen
        combined = combine(lse, out, estimate, keep)
    read = valid & ~keep
    # Estimated masses (of the combined denominator) rank unread pages for promotion.
    ratio = torch.exp(estimate.lse - combined.lse).nan_to_num(0.0)  # [n, Hq]
    mass = (estimate.page_share * ratio[..., None]).amax(dim=1).double()  # [n, P]
    return GuardOutcome(combined, read, keep, mass)


def merge_parts(
    lse_a: torch.Tensor, out_a: torch.Tensor, lse_b: torch.Tensor, out_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax parts over disjoint tokens, as one."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    wa = torch.where(torch.isfinite(lse_a), torch.exp(lse_a - safe), 0.0)[..., None]
    wb = torch.where(torch.isfinite(lse_b), torch.exp(lse_b - safe), 0.0)[..., None]
    return lse, wa * out_a + wb * out_b
