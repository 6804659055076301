"""The pages a step does not read: estimated from the shadow, with a bound on the error.

A hot-set step reads its planned pages exactly. For every other full page it reads the
page's 8-bit shadow (``shadow.py``) and folds the estimate into the same softmax, so
the estimate also corrects the output. The guard (``guard.py``) then bounds the error
of the layer's attention output and reads exactly, most suspect first, the pages it
cannot vouch for.

The bound, per query head, for the outside tokens ``t`` with exact logit ``l_t``,
estimated logit ``m_t`` (shadow keys), shadow value ``u_t`` and exact value ``v_t``:

- ``|l_t - m_t| <= e_p = sm_scale * sum_d |q_d| dk_{p,d}`` with ``dk`` the key
  rounding error of page ``p`` (a soft cap is 1-Lipschitz and keeps it);
- ``||v_t - u_t|| <= dv_p`` (the value rounding error, L2 over channels).

With ``W`` and ``Ŵ`` the exact and estimated softmax denominators (over every token,
the attended ones exact in both), the estimated output ``ô`` satisfies
``W (o - ô) = sum_t [(e^l_t - e^m_t)(u_t - ô) + e^l_t (v_t - u_t)]``, so

    ||o - ô|| <= sum_p e^{m} [(e^{e_p} - 1)(||u_t|| + ||ô||) + e^{e_p} dv_p] / W_lo,
    W_lo = Ŵ - sum_t e^m_t (1 - e^{-e_p}) <= W,

summed over the tokens of each outside page. Every term is known after the step:
deterministic, no sampling. Per layer the guard combines the heads (L2 over every
query head's output, the vector ``o_proj`` reads) and bounds the relative error
``||o - ô|| / ||o|| <= B / (||ô|| - B)``.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sgl_importance.hot_set.shadow import ShadowPages, ShadowPool
from sgl_kernel_ext import PagedDecodeWorkspace

NEG_INF = float("-inf")


@dataclass
class OutsidePlan:
    """The shadow pages each long request of a step estimates, padded to one table.

    Attributes:
        rows: int64 ``[n]``: each request's row in the decode batch.
        shadow: int64 ``[n, P]`` shadow ids (0 on padding).
        logical: int64 ``[n, P]`` the request's logical page of each column (-1 on padding).
        valid: bool ``[n, P]``.
    """

    rows: torch.Tensor
    shadow: torch.Tensor
    logical: torch.Tensor
    valid: torch.Tensor

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0 or not bool(self.valid.any())

    @staticmethod
    def build(rows: list[int], shadow: list[torch.Tensor], logical: list[torch.Tensor]) -> "OutsidePlan":
        """Pad per-request lists (``shadow[i]`` and ``logical[i]`` for batch row ``rows[i]``)."""
        n = len(rows)
        width = max([s.numel() for s in shadow] + [1])
        table = torch.zeros(n, width, dtype=torch.int64)
        pages = torch.full((n, width), -1, dtype=torch.int64)
        for i, (s, p) in enumerate(zip(shadow, logical)):
            table[i, : s.numel()] = s
            pages[i, : p.numel()] = p
        return OutsidePlan(torch.tensor(rows, dtype=torch.int64), table, pages, pages >= 0)


@dataclass
class Outside:
    """One layer's estimate of the outside pages of each planned request.

    Attributes (``n`` requests, ``P`` columns of the plan, ``Hq`` query heads):
        lse: ``[n, Hq]`` log of the estimated outside denominator (-inf: nothing outside).
        output: ``[n, Hq, Dv]`` estimated outside output (normalised by its own denominator).
        page_share: ``[n, Hq, P]`` each page's share of that denominator.
        page_norm: ``[n, Hq, P]`` softmax-weighted mean of ``||u_t||`` over the page.
        logit_error: ``[n, Hq, P]`` ``e_p``.
        value_error: ``[n, Hq, P]`` ``dv_p``.
    """

    lse: torch.Tensor
    output: torch.Tensor
    page_share: torch.Tensor
    page_norm: torch.Tensor
    logit_error: torch.Tensor
    value_error: torch.Tensor
    # Kept to compute the estimated numerator of pages the guard reads exactly.
    _weights: torch.Tensor  # [Hkv, n, g, P, ps], exp(m_t - peak)
    _values: torch.Tensor  # [Hkv, n, P, ps, Dv]
    _peak: torch.Tensor  # [Hkv, n, g]

    def page_numerators(self, row: int, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log denominator ``[Hq, k]``, numerator/denominator ``[Hq, k, Dv]``) of pages ``cols`` of ``row``."""
        w = self._weights[:, row][:, :, cols]  # [Hkv, g, k, ps]
        v = self._values[:, row][:, cols]  # [Hkv, k, ps, Dv]
        z = w.sum(-1)
        num = torch.einsum("hgkt,hktd->hgkd", w, v) / z.clamp_min(1e-30)[..., None]
        lse = z.log() + self._peak[:, row][:, :, None]
        hkv, g = w.shape[:2]
        return lse.reshape(hkv * g, -1), num.reshape(hkv * g, cols.numel(), -1)


def estimate_outside(
    q: torch.Tensor,
    pool: ShadowPool,
    layer: int,
    plan: OutsidePlan,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
    workspace: Optional[PagedDecodeWorkspace] = None,
) -> Outside:
    """Attend the plan's shadow pages of one layer: the estimate and its error terms.

    Args:
        q: ``[n, Hq, D]`` the planned requests' queries (rows of the batch, in plan order).
        workspace: buffers to reuse across layers (on a CPU a fresh tensor of a step's
            size costs page faults); the result holds views of them until the next call.
    """
    workspace = workspace or PagedDecodeWorkspace()
    n, num_q_heads, head_dim = q.shape
    num_pages = plan.shadow.shape[1]
    ps = pool.page_size
    hkv = pool.num_kv_heads
    g = num_q_heads // hkv
    tokens = num_pages * ps
    dev, f32 = q.device, torch.float32
    pages: ShadowPages = pool.pages(layer, plan.shadow)
    # [Hkv, n, g, D]: a KV head's query heads share one matrix per request.
    qf = (q.float() * sm_scale).view(n, hkv, g, head_dim).transpose(0, 1)
    keys = pages.keys(workspace.get("shadow_keys", pages.k_codes.shape, f32, dev)).view(hkv, n, tokens, head_dim)
    logits = torch.matmul(qf, keys.transpose(-1, -2), out=workspace.get("shadow_logits", (hkv, n, g, tokens), f32, dev))
    if logit_cap > 0:
        logits.div_(logit_cap).tanh_().mul_(logit_cap)
    pad = (~plan.valid).to(dev).repeat_interleave(ps, dim=1)  # [n, P*ps]
    logits.masked_fill_(pad[None, :, None, :], NEG_INF)
    peak = logits.amax(dim=-1)  # [Hkv, n, g]
    safe_peak = torch.where(torch.isfinite(peak), peak, 0.0)
    weights = logits.sub_(safe_peak[..., None]).exp_()  # in place: the logits are not needed again
    values = pages.values(workspace.get("shadow_values", pages.v_codes.shape, f32, dev)).view(hkv, n, tokens, -1)
    numerator = torch.matmul(weights, values)  # [Hkv, n, g, Dv]
    z_pages = weights.view(hkv, n, g, num_pages, ps).sum(-1)  # [Hkv, n, g, P]
    z = z_pages.sum(-1)  # [Hkv, n, g]
    lse = torch.where(z > 0, z.log() + safe_peak, NEG_INF)
    inv = torch.where(z > 0, 1.0 / z, 0.0)
    output = numerator * inv[..., None]
    norms = pages.v_norm.view(hkv, n, 1, num_pages, ps)
    weighted_norm = (weights.view(hkv, n, g, num_pages, ps) * norms).sum(-1)
    page_norm = weighted_norm / z_pages.clamp_min(1e-30)
    logit_error = pages.logit_error(qf)  # [Hkv, n, g, P]
    value_error = pages.v_error.view(hkv, n, 1, num_pages).expand(hkv, n, g, num_pages)

    def per_q_head(x: torch.Tensor) -> torch.Tensor:  # [Hkv, n, g, ...] -> [n, Hq, ...]
        return x.transpose(0, 1).reshape(n, num_q_heads, *x.shape[3:])

    return Outside(
        lse=per_q_head(lse),
        output=per_q_head(output),
        page_share=per_q_head(z_pages * inv[..., None]),
        page_norm=per_q_head(page_norm),
        logit_error=per_q_head(logit_error),
        value_error=per_q_head(value_error),
        _weights=weights.view(hkv, n, g, num_pages, ps),
        _values=values.view(hkv, n, num_pages, ps, -1),
        _peak=safe_peak,
    )


@dataclass
class Combined:
    """Exact pages and the outside estimate in one softmax, with the error bound.

    Attributes (``n`` requests):
        output: ``[n, Hq, Dv]`` the step's output ``ô``.
        lse: ``[n, Hq]`` log of the combined denominator.
        exact_share: ``[n, Hq]`` share of that denominator the exact pages hold.
        contribution: ``[n, Hq, P]`` each outside page's term of the bound, already
            divided by ``W_lo`` (the bound per head is their sum).
        bound: ``[n]`` upper bound of ``||o - ô||`` (L2 over the query heads).
        relative: ``[n]`` upper bound of ``||o - ô|| / ||o||`` (inf when vacuous).
    """

    output: torch.Tensor
    lse: torch.Tensor
    exact_share: torch.Tensor
    contribution: torch.Tensor
    bound: torch.Tensor
    relative: torch.Tensor


def combine(
    lse_exact: torch.Tensor,
    out_exact: torch.Tensor,
    outside: Outside,
    keep: Optional[torch.Tensor] = None,
) -> Combined:
    """Fold the estimate into the exact pages' softmax and bound the result's error.

    Args:
        lse_exact: ``[n, Hq]`` log denominator of the exactly read tokens (sinks included).
        out_exact: ``[n, Hq, Dv]`` their output.
        outside: the estimate of the remaining pages.
        keep: bool ``[n, P]``: outside pages still estimated (default: every valid one);
            the others were read exactly and are part of ``lse_exact``/``out_exact``.
    """
    share = outside.page_share
    if keep is not None:
        share = share * keep[:, None, :]
    kept = share.sum(-1)  # [n, Hq] share of the outside denominator still estimated
    lse_out = torch.where(kept > 0, outside.lse + kept.clamp_min(1e-38).log(), NEG_INF)
    # The kept pages' output: the full estimate minus what the dropped pages gave.
    out_out = outside.output
    if keep is not None:
        dropped = outside.page_share * (~keep)[:, None, :]
        if bool(dropped.any()):
            out_out = _without_pages(outside, keep, kept)
    lse = torch.logaddexp(lse_exact, lse_out)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    exact_share = torch.where(torch.isfinite(lse_exact), torch.exp(lse_exact - lse), 0.0)
    out_share = torch.where(torch.isfinite(lse_out), torch.exp(lse_out - lse), 0.0)
    output = exact_share[..., None] * out_exact + out_share[..., None] * out_out
    # Each page's share of the combined denominator, and the bound's terms.
    rho = torch.where(torch.isfinite(outside.lse), torch.exp(outside.lse - lse), 0.0)[..., None] * share
    grow = torch.expm1(outside.logit_error)
    head_norm = output.norm(dim=-1)  # [n, Hq]
    terms = rho * (grow * (outside.page_norm + head_norm[..., None]) + (grow + 1.0) * outside.value_error)
    w_lo = 1.0 - (rho * -torch.expm1(-outside.logit_error)).sum(-1)  # [n, Hq], W_lo / Ŵ
    contribution = terms / w_lo.clamp_min(1e-30)[..., None]
    contribution = torch.where(w_lo[..., None] > 0, contribution, float("inf"))
    bound = contribution.sum(-1).norm(dim=-1)  # [n]
    size = output.flatten(1).norm(dim=-1)
    relative = torch.where(bound < size, bound / (size - bound), float("inf"))
    return Combined(output, lse, exact_share, contribution, bound, relative)


def _without_pages(outside: Outside, keep: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The outside output over the kept pages only (rows with dropped pages recomputed)."""
    out = outside.output.clone()
    for row in torch.nonzero((~keep & (outside.page_share.sum(1) > 0)).any(dim=1)).flatten().tolist():
        cols = torch.nonzero(~keep[row] & (outside.page_share[row].sum(0) > 0)).flatten()
        _, num = outside.page_numerators(row, cols)  # [Hq, k, Dv] normalised per page
        share = outside.page_share[row][:, cols]  # [Hq, k]
        dropped = (share[..., None] * num).sum(1)
        remain = kept[row].clamp_min(1e-38)[:, None]
        out[row] = torch.where(kept[row][:, None] > 0, (outside.output[row] - dropped) / remain, 0.0)
    return out


def pages_to_read(combined: Combined, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """The fewest outside pages, most suspect first, whose exact reading brings each
    request's relative bound to at most ``threshold``.

    A page's suspicion is its summed term of the bound over query heads. Reading a page
    removes its term; it also raises ``W_lo``, which is ignored here (the selection is
    conservative), and moves ``ô`` a little, so the caller recombines and checks again.

    Args:
        valid: bool ``[n, P]`` pages that may be read.
        threshold: allowed relative error, > 0.

    Returns:
        bool ``[n, P]``, all False where the bound already holds.
    """
    contribution = combined.contribution.masked_fill(~valid[:, None, :], 0.0)
    need = combined.relative > threshold
    chosen = torch.zeros_like(valid)
    if not bool(need.any()):
        return chosen
    score = contribution.sum(1).masked_fill(~valid, -1.0)  # [n, P]
    order = torch.argsort(score, dim=1, descending=True)
    ordered = torch.gather(contribution, 2, order[:, None, :].expand_as(contribution))
    # rest[k]: the bound per head with the first k pages read (suffix sums).
    suffix = ordered.flip(-1).cumsum(-1).flip(-1)
    rest = torch.cat((suffix, torch.zeros_like(suffix[..., :1])), dim=-1).norm(dim=1)  # [n, P + 1]
    size = combined.output.flatten(1).norm(dim=-1)
    limit = threshold / (1.0 + threshold) * size
    fits = rest <= limit[:, None]
    fits[:, -1] = True
    k = fits.to(torch.int64).argmax(dim=1)  # first k that fits
    k = torch.where(need, k, 0)
    ranks = torch.arange(order.shape[1], device=order.device)[None, :]
    take = (ranks < k[:, None]) & torch.gather(valid, 1, order)
    chosen.scatter_(1, order, take)
    return chosen
