"""The guard: a hot set may not silently miss the attention it needs.

After attending over the selected pages ``S`` the decode knows, per query head, the
exact softmax denominator of those pages ``Z_S = exp(lse_S)``. The page summaries
bound every logit of a page ``p`` outside ``S`` by ``b_p``, so its unnormalised mass
is at most ``n_p exp(b_p)`` (``n_p`` tokens). With ``U = sum_{p not in S} n_p exp(b_p)``
the mass the request's full attention would put outside ``S`` is

    Z_out / (Z_S + Z_out) <= U / (Z_S + U)

(increasing in ``Z_out`` and ``Z_out <= U``). That is a bound, not an estimate: when
it is below the threshold the hot set provably holds the rest. When it is above,
the guard adds the fewest pages, highest bound first, that bring it below for
every head, and the step attends over them too (with a loose bound that is every
page: dense attention). Each such step is counted; nothing degrades unseen.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

import torch

# exp() of a float64 overflows past ~709; a page bounded that far above the
# attended denominator is needed whatever the exact number.
_MAX_LOG_RATIO = 700.0


def outside_mass_bound(bounds: torch.Tensor, page_tokens: torch.Tensor, lse_selected: torch.Tensor) -> torch.Tensor:
    """Upper bound, per query head, of the attention mass outside the selected pages.

    Args:
        bounds: ``[P, q_heads]`` logit bounds of the pages *not* attended.
        page_tokens: ``[P]`` tokens each of those pages holds.
        lse_selected: ``[q_heads]`` natural-log denominator of the attended pages.

    Returns:
        float64 ``[q_heads]`` in [0, 1]; zeros when ``P == 0``.
    """
    if bounds.shape[0] == 0:
        return torch.zeros(lse_selected.shape, dtype=torch.float64, device=lse_selected.device)
    log_u = torch.logsumexp(bounds.double() + page_tokens.double().log()[:, None], dim=0)
    # U / (Z_S + U), computed without forming either sum.
    return torch.sigmoid(log_u - lse_selected.double())


def pages_to_add(
    bounds: torch.Tensor,
    page_tokens: torch.Tensor,
    lse_selected: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """The fewest outside pages whose addition bounds the remaining mass by ``threshold``.

    Pages are taken in order of their largest per-head bound mass; the remaining
    bound uses ``Z_S`` of the pages already attended (adding pages only grows the
    denominator, so the guarantee holds after attending them).

    Args:
        bounds, page_tokens, lse_selected: as in :func:`outside_mass_bound`.
        threshold: allowed outside mass, in (0, 1].

    Returns:
        int64 indices into ``bounds``' rows, empty when the bound already holds.
    """
    num = bounds.shape[0]
    empty = torch.zeros(0, dtype=torch.int64, device=bounds.device)
    if num == 0 or threshold >= 1.0:
        return empty
    # Per page and head, the page's bound relative to Z_S: U / Z_S is their sum.
    log_ratio = bounds.double() + page_tokens.double().log()[:, None] - lse_selected.double()[None, :]
    ratio = log_ratio.clamp(max=_MAX_LOG_RATIO).exp()
    order = torch.argsort(ratio.amax(dim=1), descending=True)
    ratio = ratio[order]
    # rest[k] = sum of the pages left outside after adding the first k (suffix sums,
    # so nothing is subtracted from a huge total).
    suffix = torch.flip(torch.cumsum(torch.flip(ratio, [0]), 0), [0])
    rest = torch.cat((suffix, torch.zeros_like(suffix[:1])))
    # U / (Z_S + U) <= t  <=>  U / Z_S <= t / (1 - t).
    limit = threshold / (1.0 - threshold)
    holds = (rest <= limit).all(dim=1)
    k = int(torch.nonzero(holds)[0, 0])
    return order[:k] if k else empty
