"""The pages a step does not read: their logit intervals, a sampled estimate, its bound.

A guarded hot-set step reads its planned pages exactly (part 1). Every other full page
of the request (its *rest*) is accounted for in the same softmax:

- **Logit intervals** (``estimate_outside``): each rest page's 4-bit key codes
  (``key_codes.py``) give every token an estimated logit ``m_t`` and
  ``|l_t - m_t| <= e_p``; so a page's mass is within ``exp(+-e_p)`` of
  ``x_p = sum_t exp(m_t)``. The estimated masses choose which rest pages a layer reads
  (top-p, ``guard.layer.wanted_pages``); the upper masses give a deterministic bound on
  leaving the unread rest out (``negligible_rest``).
- **A sampled estimate** (``sampled_pages``, ``combine``): the rest pages in the
  request's uniform sample (``sample.py``, inclusion probability ``pi``; they are
  planned, so resident) are read exactly, each page's own numerator and
  denominator, and stand for the whole remaining rest with weight ``1 / pi``
  (Horvitz-Thompson): ``o_hat = (N_E + sum_S N_p / pi) / (D_E + sum_S D_p / pi)``.
  (A ratio estimate with the key codes' page masses as auxiliary was tried and
  measured worse on SmolLM2: ``benchmark/long_context/RESULTS.md``.)
- **The bound**: with ``y_p = N_p - o_hat D_p``, the estimate's error is, to first
  order, ``sum_p (Z_p / pi - 1) y_p / D`` over the remaining rest pages (``Z_p`` the
  sample indicator), of variance ``(1 - pi) / pi sum ||y_p||^2 / D^2``, estimated
  unbiasedly from the sample as ``V = (1 - pi) / pi^2 sum_S ||y_p||^2 / D_hat^2``
  (summed over query heads: the vector ``o_proj`` reads), and never below what the
  key codes' masses of *every* rest page imply (``code_variance``: a few sampled pages
  of a heavy-tailed rest mostly see its light pages, and the sample's own ``V`` then
  understates the error). The layer's bound is ``B = t * sqrt(V)``, ``t`` Student's
  quantile for the sampled pages' count (the variance comes from them), and
  ``||o - o_hat|| / ||o|| <= B / (||o_hat|| - B)``; under ``MIN_SAMPLED`` sampled pages
  the estimate does not vouch.

The guarantee, per layer and not end to end: *the deterministic bound is never
exceeded; with probability at least 1 - DELTA over the request's page sample, under the
normal approximation of the sampled estimate, the relative L2 error of the layer's
attention output (all query heads) is at most the statistical bound; the layer reports
the smaller of the two, and where it exceeds the request's threshold the layer-step is
flagged (counted), not read again.* ``benchmark/long_context/bench_bound.py`` counts how
often the exact error exceeds the bound.

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sgl_importance.hot_set.guard.key_codes import ROUNDING_MARGIN, GuardPool, steps
from sgl_kernel_ext import HAS_TRITON, key_code_pages, page_parts, t_quantile

if HAS_TRITON:
    from sgl_kernel_ext import combine_triton, key_code_pages_ranged

NEG_INF = float("-inf")
DELTA = 0.05  # the bound's failure probability per certified layer-step
# Quantiles of Student's t by degrees of freedom (the normal's past the last): the
# variance comes from the sampled pages themselves, often few, so their own count sets
# the quantile. They are the 1 - DELTA / 4 ones, not 1 - DELTA / 2: the guard certifies
# exactly where the estimated variance came out small, which on SmolLM2 made the
# 1 - DELTA / 2 bound fail on 6-11 % of certified layer-steps (about 2 % of all of them;
# bench_bound.py). A norm's tail over any dimension is within a scalar's quantile.
T_QUANTILES = {1: 25.452, 2: 6.205, 3: 4.177, 4: 3.495, 5: 3.163, 6: 2.969, 7: 2.841, 8: 2.752, 9: 2.685,
               10: 2.634, 12: 2.56, 15: 2.49, 20: 2.423, 30: 2.36, 60: 2.299, 120: 2.27}  # fmt: skip
Z = 2.2414
MIN_SAMPLED = 3  # fewer sampled pages than this cannot vouch for the rest


@dataclass
class OutsidePlan:
    """The rest pages of each guarded request of a step, padded to one table.

    Attributes (``n`` guarded requests, ``P`` columns):
        rows: int64 ``[n]``: each request's row in the decode batch.
        codes: int64 ``[n, P]`` guard ids of the pages' key codes (0 on padding).
        logical: int64 ``[n, P]`` the request's logical page (-1 on padding).
        valid: bool ``[n, P]``.
        sampled: bool ``[n, P]``: the page is in the request's sample.
        inclusion: float32 ``[n]``: each request's ``pi``.
    """

    rows: torch.Tensor
    codes: torch.Tensor
    logical: torch.Tensor
    valid: torch.Tensor
    sampled: torch.Tensor
    inclusion: torch.Tensor

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0 or not bool(self.valid.any())

    @staticmethod
    def build(
        rows: list[int],
        codes: list[torch.Tensor],
        logical: list[torch.Tensor],
        sampled: list[torch.Tensor],
        inclusion: list[float],
    ) -> "OutsidePlan":
        """Pad per-request lists (for batch row ``rows[i]``)."""
        n = len(rows)
        width = max([c.numel() for c in codes] + [1])
        table = torch.zeros(n, width, dtype=torch.int64)
        pages = torch.full((n, width), -1, dtype=torch.int64)
        in_sample = torch.zeros(n, width, dtype=torch.bool)
        for i, (c, p, s) in enumerate(zip(codes, logical, sampled)):
            table[i, : c.numel()] = c
            pages[i, : p.numel()] = p
            in_sample[i, : s.numel()] = s
        return OutsidePlan(
            torch.tensor(rows, dtype=torch.int64),
            table,
            pages,
            pages >= 0,
            in_sample,
            torch.tensor(inclusion, dtype=torch.float32),
        )


@dataclass
class Outside:
    """One layer's logit intervals of the rest pages.

    Attributes:
        page_lse: ``[n, Hq, P]`` log of each page's estimated mass, ``log sum_t exp(m_t)``
            (-inf on padding).
        logit_error: ``[n, Hq, P]`` ``e_p``: every token's logit within it of its estimate.
        value_norm: ``[n, Hkv, P]`` the page's largest value norm per KV head (query head
            ``h`` reads KV head ``h // (Hq / Hkv)``'s).
    """

    page_lse: torch.Tensor
    logit_error: torch.Tensor
    value_norm: torch.Tensor


def on_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``, moved only if it is elsewhere.

    A guarded layer's inputs are put on the layers' device once per step; a move on
    every call would be a no-op there, but ``.to(device)`` from a host plan is a copy
    each layer (and, on a CPU, reads as a trip to the host to the round-trip counter).
    """
    want = torch.device(device)
    here = t.device.type == want.type and want.index in (None, t.device.index)
    return t if here else t.to(want)


def _per_q_head(x: torch.Tensor, n: int, hq: int) -> torch.Tensor:
    """``[Hkv, n, g, ...]`` -> ``[n, Hq, ...]``."""
    return x.transpose(0, 1).reshape(n, hq, *x.shape[3:])


def estimate_outside(
    q: torch.Tensor,
    pool: GuardPool,
    layer: int,
    plan: OutsidePlan,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
    use_native: Optional[bool] = None,
) -> Outside:
    """Every rest page's estimated log-mass and logit error, from its key codes.

    Args:
        q: ``[n, Hq, D]`` the guarded requests' queries (plan order).
        key_min, key_max: ``[n, P, Hkv, D]``: the plan's pages' per-channel key range,
            the one their codes were written against.
        use_native: ``key_code_pages``' choice (False: its torch path).
    """
    n, hq, d = q.shape
    hkv = pool.num_kv_heads
    g = hq // hkv
    dev = q.device
    qf = (q.float() * sm_scale).view(n, hkv, g, d).transpose(0, 1)  # [Hkv, n, g, D]
    # The C kernel on a CPU reads the codes straight from the pool (D / 2 bytes a token).
    page_lse, error = key_code_pages(
        qf.contiguous(),
        pool.codes[layer],
        on_device(plan.codes, pool.device),
        on_device(key_min, dev).float(),
        on_device(steps(key_min, key_max), dev),
        on_device(plan.valid, dev),
        logit_cap=logit_cap,
        margin=ROUNDING_MARGIN,
        use_native=use_native,
    )  # [Hkv, n, P, g] each
    norms = pool.gather_norms(layer, plan.codes)  # [Hkv, n, P]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [Hkv, n, P, g] -> [n, Hq, P]
        return _per_q_head(on_device(x, dev).transpose(2, 3), n, hq)

    return Outside(heads(page_lse), heads(error), on_device(norms, dev).transpose(0, 1))


def estimate_outside_ranged(
    q: torch.Tensor,
    pool: GuardPool,
    layer: int,
    plan: OutsidePlan,
    tables: tuple[torch.Tensor, torch.Tensor],
    range_ids: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> Outside:
    """``estimate_outside`` in one Triton launch, for a captured step: the pages' ranges
    read from the range tables (``tables``: one layer's ``key_min``, ``key_max``) by their
    rows ``range_ids`` ``[n, P]`` inside the kernel (``sgl_kernel_ext.key_code_pages_ranged``),
    the queries scaled there, the results in query-head order, the pages' value norms read by
    their code rows in the same launch: no gathered ranges, steps, norms or per-head copies.
    The same numbers as ``estimate_outside`` on its Triton path."""
    page_lse, error, norms = key_code_pages_ranged(
        q,
        pool.codes[layer],
        plan.codes,
        *tables,
        range_ids,
        plan.valid,
        pool.norms[layer],
        pool.layout,
        sm_scale=sm_scale,
        logit_cap=logit_cap,
        margin=ROUNDING_MARGIN,
    )
    return Outside(page_lse, error, norms)


@dataclass
class Sampled:
    """The sampled rest pages of one layer, each read exactly on its own.

    Attributes (``S`` sampled columns):
        lse: ``[n, Hq, S]`` each page's log denominator (-inf on padding).
        output: ``[n, Hq, S, Dv]`` each page's own softmax output.
    """

    lse: torch.Tensor
    output: torch.Tensor


def sampled_pages(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    *,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> Sampled:
    """Per-page exact attention over sampled pages.

    Args:
        q: ``[n, Hq, D]``.
        keys, values: ``[n, S, page_size, Hkv, D]`` the pages' K and V.
        valid: bool ``[n, S]``.
    """
    parts = page_parts(q, keys, values, sm_scale=sm_scale, logit_cap=logit_cap)  # each page on its own
    return Sampled(parts.lse.masked_fill(~on_device(valid, q.device)[:, None, :], NEG_INF), parts.output)


@dataclass
class Combined:
    """The exact pages and the sampled estimate of the rest in one softmax, with the bound.

    Attributes (``n`` requests):
        output: ``[n, Hq, Dv]`` the layer's output ``o_hat``.
        lse: ``[n, Hq]`` log of the combined (estimated) denominator.
        exact_share: ``[n, Hq]`` share of that denominator the exact pages hold.
        bound: ``[n]`` ``B``, the bound of ``||o - o_hat||`` (L2 over the query heads).
        relative: ``[n]`` bound of ``||o - o_hat|| / ||o||`` (inf when it cannot vouch).
    """

    output: torch.Tensor
    lse: torch.Tensor
    exact_share: torch.Tensor
    bound: torch.Tensor
    relative: torch.Tensor


def combine(
    lse_exact: torch.Tensor,
    out_exact: torch.Tensor,
    sampled: Sampled,
    inclusion: torch.Tensor,
    uncovered: torch.Tensor,
    codes: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    *,
    use_triton: Optional[bool] = None,
) -> Combined:
    """The Horvitz-Thompson estimate of the rest folded into the exact pages' softmax.

    Args:
        lse_exact, out_exact: ``[n, Hq]``, ``[n, Hq, Dv]`` over every page read exactly.
        sampled: the rest's sampled pages still estimated (the others masked out).
        inclusion: ``[n]`` ``pi`` per request.
        uncovered: bool ``[n]``: rest pages remain but none of them is sampled (the
            estimate cannot vouch for them: ``relative`` is inf).
        codes: the key codes' log-masses ``([n, Hq, P]`` of every rest page still
            estimated, ``[n, Hq, S]`` of the sampled ones; -inf elsewhere``)``: the
            variance is then at least what the codes say the whole rest holds
            (``code_variance``).

    On CUDA tensors (or ``use_triton``) it runs as two Triton launches
    (``sgl_kernel_ext.combine_triton``, the same math); this torch code is its reference.
    """
    if use_triton is None:
        use_triton = HAS_TRITON and out_exact.is_cuda
    if use_triton:
        parts = (lse_exact, out_exact, sampled.lse, sampled.output, inclusion, uncovered, codes)
        return Combined(*combine_triton(*parts, quantiles=T_QUANTILES, z=Z, min_sampled=MIN_SAMPLED))
    pi = on_device(inclusion, lse_exact.device).to(torch.float32)
    lse_pages = sampled.lse
    live = torch.isfinite(lse_pages)
    any_sampled = live.any(dim=-1)  # [n, Hq]
    lse_s = torch.logsumexp(lse_pages, dim=-1)  # [n, Hq]
    safe_s = torch.where(any_sampled, lse_s, 0.0)
    within = torch.where(live, torch.exp(lse_pages - safe_s[..., None]), 0.0)
    out_s = (within[..., None] * sampled.output).sum(dim=2)  # [n, Hq, Dv]
    lse_s = torch.where(any_sampled, lse_s - pi.log()[:, None], NEG_INF)  # weighted by 1 / pi
    lse = torch.logaddexp(lse_exact, lse_s)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    a = torch.where(torch.isfinite(lse_exact), torch.exp(lse_exact - lse), 0.0)
    b = torch.where(torch.isfinite(lse_s), torch.exp(lse_s - lse), 0.0)
    output = a[..., None] * out_exact + b[..., None] * out_s
    # y_p / D_hat per sampled page, and the variance of the estimate from them.
    share = torch.where(live, torch.exp(lse_pages - lse[..., None]), 0.0)
    y = share[..., None] * (sampled.output - output[:, :, None])
    variance = (1.0 - pi) / pi.square() * y.square().sum(dim=(1, 2, 3))  # [n]
    if codes is not None:
        variance = torch.maximum(variance, code_variance(y, lse, pi, *codes))
    count = live.any(dim=1).sum(dim=-1)  # [n] sampled pages still estimated
    bound = quantile(count) * variance.clamp_min(0.0).sqrt()
    relative = _relative(bound, output)
    too_few = (count < MIN_SAMPLED) & (pi < 1.0) & any_sampled.any(dim=-1)
    relative = torch.where(uncovered | too_few, float("inf"), relative)
    return Combined(output, lse, a, bound, relative)


def code_variance(
    y: torch.Tensor, lse: torch.Tensor, pi: torch.Tensor, rest_lse: torch.Tensor, sampled_lse: torch.Tensor
) -> torch.Tensor:
    """``[n]`` the estimate's variance with the population's spread taken from the key codes.

    The sample's own variance estimate misses what the sample missed: a handful of
    sampled pages from a rest whose masses are heavy-tailed mostly sees the light ones,
    and the bound then fails far more often than ``DELTA`` (bench_bound.py). Every rest
    page has its key codes' estimated share ``x_p``, sampled or not, so
    ``sum ||y_p||^2`` over the rest is estimated as ``sum_rest x_p^2`` times the sampled
    pages' ``sum ||y_p||^2 / sum x_p^2`` (a ratio estimate, per query head): equal to the
    sample's own in expectation when the sample is typical, larger when it missed the
    heavy pages.

    Args:
        y: ``[n, Hq, S, Dv]`` the sampled pages' ``y_p / D_hat``.
        lse: ``[n, Hq]`` the combined log denominator ``D_hat``.
        rest_lse, sampled_lse: ``[n, Hq, P]``, ``[n, Hq, S]`` key-code log-masses.
    """
    x_rest = torch.exp(rest_lse - lse[..., None]).nan_to_num(0.0).square().sum(dim=-1)  # [n, Hq]
    x_sampled = torch.exp(sampled_lse - lse[..., None]).nan_to_num(0.0).square().sum(dim=-1)
    spread = y.square().sum(dim=(2, 3))  # [n, Hq]
    ratio = torch.where(x_sampled > 0, spread / x_sampled.clamp_min(1e-30), 0.0)
    return (1.0 - pi) / pi * (x_rest * ratio).sum(dim=-1)


def quantile(count: torch.Tensor) -> torch.Tensor:
    """``[n]`` the bound's quantile for estimates from ``count`` sampled pages (t, ``count - 1``
    degrees of freedom, the next smaller tabled one; the normal's past the table).

    One gather from a lookup over every degree of freedom (``sgl_kernel_ext.t_quantile``; a
    loop of ``torch.where`` over the table was ~190 launches a call)."""
    return t_quantile(count, T_QUANTILES, Z)


def negligible_rest(lse_exact: torch.Tensor, out_exact: torch.Tensor, outside: Outside, keep: torch.Tensor) -> Combined:
    """The exact pages alone, with a deterministic bound on leaving the rest out.

    With ``D_R`` the rest's mass, ``o - o_E = D_R / (D_E + D_R) (o_R - o_E)``, so per head
    ``||o - o_E|| <= a (V + ||o_E||)``, ``a = D_hi / (D_E + D_hi)`` for the rest's upper
    mass ``D_hi = sum_p exp(lse_p + e_p)`` and its largest value norm ``V``; L2 over heads.

    Args:
        keep: bool ``[n, P]``: the rest pages left out.
    """
    upper = (outside.page_lse + outside.logit_error).masked_fill(~keep[:, None, :], NEG_INF)
    lse_hi = torch.logsumexp(upper, dim=-1)  # [n, Hq]
    alpha = torch.where(torch.isfinite(lse_hi), torch.sigmoid(lse_hi - lse_exact), 0.0)
    largest = outside.value_norm.masked_fill(~keep[:, None, :], 0.0).amax(dim=-1)  # [n, Hkv]
    n, hkv = largest.shape
    largest = largest[:, :, None].expand(n, hkv, lse_exact.shape[1] // hkv).reshape(n, -1)  # [n, Hq]
    head = out_exact.norm(dim=-1)
    bound = (alpha * (largest + head)).norm(dim=-1)  # [n]
    relative = _relative(bound, out_exact)
    lse = torch.where(torch.isfinite(lse_exact), lse_exact, 0.0)
    return Combined(out_exact, lse, torch.ones_like(lse), bound, relative)


def _relative(bound: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``[n]`` bound of ``||o - o_hat|| / ||o||`` from ``bound`` on ``||o - o_hat||``:
    ``B / (||o_hat|| - B)``, 0 for an exact output, inf when the bound is vacuous."""
    size = output.flatten(1).norm(dim=-1)
    relative = torch.where(bound < size, bound / (size - bound), float("inf"))
    return torch.where(bound == 0, 0.0, relative)
