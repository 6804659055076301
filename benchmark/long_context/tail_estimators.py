"""Issue 46's candidates, one layer-step at a time: which pages a KV head reads and how the rest is
estimated and bounded, at a fixed cap of pages read.

Plain torch in float64, no decoder and no SGLang: ``bench_selection.py`` feeds it the embedded
model's own queries, keys and values. For one layer and decode step (queries ``[Hq, D]``, the
context's keys and values ``[Hkv, n, D]``) it returns, per candidate, the pages read, the exact
relative error of the output over all query heads (and the worst head's), and the bound the
candidate would report:

- ``plan``: one page set for every layer and head (the request's importance plan, what the hot
  set reads today with the guard off), the rest left out; no bound.
- ``plan+ht`` (i): the plan with part of the cap spent on a uniform page sample and the rest
  estimated by Horvitz-Thompson: the current guard at equal bytes (no rounds, no full read).
- ``topp`` (ii): per KV head, top-p on the key codes' estimated page masses (union over the
  head's query heads), capped; the rest left out with the deterministic bound.
- ``topp+ht`` (iii): (ii) with part of the cap spent on a stratified sample, HT over the tail.
- ``topp+mean`` (iv): (ii) with the tail estimated from the codes' page masses times each page's
  value mean (a per-page summary), no sample.
- ``topp+diff`` (v): (iv) corrected by the stratified sample (a difference estimator).

The deterministic bound (valid for every estimator): the true output lies within
``a_hi (V_max + ||o_E||)`` of the exact part ``o_E``, with ``a_hi = D_hi / (D_E + D_hi)`` the
tail's largest possible share (every code logit raised by its page's radius) and ``V_max`` the
tail's largest value norm; so ``||o - o_hat|| <= ||o_hat - o_E|| + a_hi (V_max + ||o_E||)``.
The statistical bound (sampling candidates): the linearised ratio estimator's stratified
variance, ``t`` at ``1 - delta/2`` with one degree of freedom per stratum, one look. Reported:
the smaller of the two, relative to ``||o_hat||`` minus itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy.stats import t as student_t

LEVELS = 15  # 4-bit key codes, as key_codes.py stores them
CANDIDATES = ("plan", "plan+ht", "topp", "topp+ht", "topp+mean", "topp+diff")
SAMPLING = {"plan+ht", "topp+ht", "topp+diff"}


@dataclass(frozen=True)
class Setup:
    page: int = 16
    sinks: int = 1
    window: int = 4
    cap: float = 0.2  # pages read (sinks and window included), as a share of the context's pages
    p: float = 0.95  # top-p of the codes' estimated mass, per query head
    stratum: int = 32  # pages per stratum of the sample; 2 sampled in each
    delta: float = 0.05
    tau: float = 0.1  # a bound at or under it certifies the layer-step


@dataclass
class LayerStep:
    """One layer-step's exact per-page quantities, shared by every candidate and seed."""

    always: torch.Tensor  # [P] bool: sinks, window (and the partial page)
    d_page: torch.Tensor  # [Hq, P] exact mass per page (shifted by the head's max logit)
    n_page: torch.Tensor  # [Hq, P, Dv] exact mass-weighted value sums
    a_est: torch.Tensor  # [Hq, P] mass from the key codes
    a_hi: torch.Tensor  # [Hq, P] mass from the codes raised by the page's radius (an upper end)
    v_mean: torch.Tensor  # [Hq, P, Dv] each page's value mean, for its query heads
    v_max: torch.Tensor  # [Hq, P] each page's largest value norm
    exact: torch.Tensor  # [Hq, Dv] attention over every token
    group: int


def layer_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, setup: Setup) -> LayerStep:
    """Exact and code-estimated page masses of one layer-step.

    Args:
        q: ``[Hq, D]``; k, v: ``[Hkv, n, D]`` (the context, the decoded token last).
    """
    hq, hkv, n = q.shape[0], k.shape[0], k.shape[1]
    g, page = hq // hkv, setup.page
    full = n // page
    pages = -(-n // page)
    q, k, v = q.double(), k.double(), v.double()
    kq = k.repeat_interleave(g, dim=0)  # [Hq, n, D]
    vq = v.repeat_interleave(g, dim=0)
    logits = torch.einsum("hd,hnd->hn", q, kq) * scale
    top = logits.amax(dim=-1, keepdim=True)
    w = torch.exp(logits - top)
    exact = (w[..., None] * vq).sum(1) / w.sum(1, keepdim=True)
    pad = pages * page - n
    wp = torch.nn.functional.pad(w, (0, pad)).view(hq, pages, page)
    vp = torch.nn.functional.pad(vq, (0, 0, 0, pad)).view(hq, pages, page, -1)
    d_page = wp.sum(-1)
    n_page = (wp[..., None] * vp).sum(2)
    # Codes of full pages against their own per-channel range; the partial page is always read.
    kf = kq[:, : full * page].reshape(hq, full, page, -1)
    low, high = kf.amin(2, keepdim=True), kf.amax(2, keepdim=True)
    step = (high - low) / LEVELS
    codes = ((kf - low) / torch.where(step > 0, step, 1.0)).round().clamp(0, LEVELS)
    k_hat = low + codes * step
    m = torch.einsum("hd,hptd->hpt", q, k_hat) * scale - top[..., None]
    radius = (q.abs()[:, None, None, :] * step / 2).sum(-1) * scale  # [Hq, full, 1]
    a_est = torch.zeros(hq, pages, dtype=torch.float64)
    a_hi = torch.zeros_like(a_est)
    a_est[:, :full] = torch.exp(m).sum(-1)
    a_hi[:, :full] = torch.exp(m + radius).sum(-1)
    counts = torch.full((pages,), float(page), dtype=torch.float64)
    counts[-1] = n - (pages - 1) * page
    v_mean = vp.sum(2) / counts[None, :, None]
    v_max = vp.norm(dim=-1).amax(-1)
    always = torch.zeros(pages, dtype=torch.bool)
    always[: setup.sinks] = True
    always[max(0, pages - setup.window) :] = True
    always[full:] = True
    return LayerStep(always, d_page, n_page, a_est, a_hi, v_mean, v_max, exact, g)


def topp_pages(step: LayerStep, p: float, cap: int, mass: torch.Tensor | None = None) -> torch.Tensor:
    """Per KV head, the rest pages read: each query head's smallest set of pages, by ``mass``
    (the codes' estimate by default), whose mass with the always-read pages reaches ``p`` of
    the total; the union over the KV head's query heads, at most ``cap`` (the pages with the
    largest share in any of its query heads first). ``[Hkv, P]`` bool."""
    mass = step.a_est if mass is None else mass
    always = step.always
    rest_mass = torch.where(always, 0.0, mass)
    fixed = torch.where(always, step.d_page, 0.0).sum(-1)  # read exactly: their true mass is known
    total = fixed + rest_mass.sum(-1)  # [Hq]
    order = rest_mass.argsort(dim=-1, descending=True)
    sorted_mass = rest_mass.gather(-1, order)
    before = sorted_mass.cumsum(-1) - sorted_mass  # mass of the pages ranked above
    need = (fixed[:, None] + before) < p * total[:, None]  # still short of p before this page
    need &= sorted_mass > 0
    chosen = torch.zeros_like(need).scatter(-1, order, need)  # [Hq, P]
    g = step.group
    hkv = chosen.shape[0] // g
    union = chosen.view(hkv, g, -1).any(1)
    share = (rest_mass / total[:, None]).view(hkv, g, -1).amax(1)
    if cap >= 0:
        over = union.sum(-1) > cap
        if bool(over.any()):
            ranked = torch.where(union, share, -1.0).argsort(-1, descending=True)
            keep = torch.zeros_like(union).scatter(-1, ranked[:, :cap], True) & union
            union = torch.where(over[:, None], keep, union)
    return union


def strata_sample(rest: torch.Tensor, stratum: int, seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two pages per stratum of ``stratum`` consecutive rest pages, drawn without replacement, one
    draw per seed (a request's seed fixes its draw for every layer and step). Returns
    (``[S, strata, 2]`` page indices, ``[strata]`` stratum sizes)."""
    idx = rest.nonzero().flatten()
    keys = torch.stack([torch.rand(rest.numel(), generator=torch.Generator().manual_seed(int(s))) for s in seeds])
    sizes, picks = [], []
    for start in range(0, idx.numel(), stratum):
        members = idx[start : start + stratum]
        if members.numel() < 2:
            continue
        sizes.append(members.numel())
        picks.append(members[keys[:, members].argsort(-1)[:, :2]])
    if not picks:
        return torch.zeros(len(seeds), 0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
    return torch.stack(picks, 1), torch.tensor(sizes, dtype=torch.float64)


def _relative(out: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(relative L2 error over every query head, the worst head's relative error) per row."""
    err = out - exact
    overall = err.flatten(-2).norm(dim=-1) / exact.norm()
    head = (err.norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-30)).amax(-1)
    return overall, head


def _bound_relative(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """An absolute bound ``b`` (L2 over heads) as a bound of the relative error: b / (||o_hat|| - b)."""
    norm = out.flatten(-2).norm(dim=-1)
    return torch.where(norm > b, b / (norm - b).clamp_min(1e-30), torch.inf)


def evaluate(step: LayerStep, setup: Setup, importance: torch.Tensor, seeds: torch.Tensor) -> dict[str, dict]:
    """Every candidate on one layer-step, for every seed of the sample.

    Args:
        importance: ``[P]`` the request's page importance (the plan reads the rest pages it ranks
            highest, the same pages in every layer and head).
        seeds: ``[S]`` the sample's seeds (one per simulated request).

    Returns:
        candidate -> {"read": pages read (mean over KV heads, seeds), "pages": P, "error",
        "head_error", "bound": ``[S]`` tensors (the bound inf where the candidate has none),
        "bound_det" (relative, inf where ``||o_hat||`` is within it), "bound_det_abs" (on ``||o - o_hat||``,
        finite)}.
    """
    pages = step.always.numel()
    g = step.group
    hq = step.d_page.shape[0]
    hkv = hq // g
    rest = ~step.always
    cap_pages = max(0, math.ceil(setup.cap * pages) - int(step.always.sum()))
    picks, sizes = strata_sample(rest, setup.stratum, seeds)
    sample_pages = min(cap_pages, picks[0].numel())
    sampled = torch.zeros(len(seeds), pages, dtype=torch.bool)
    if picks.numel():
        sampled.scatter_(1, picks.flatten(1), True)
    out: dict[str, dict] = {}
    s = len(seeds)
    plan_k = _plan(importance, rest, cap_pages)
    plan_small = _plan(importance, rest, cap_pages - sample_pages)
    selections = {
        "plan": plan_k[None].expand(hkv, -1),
        "plan+ht": plan_small[None].expand(hkv, -1),
        "topp": topp_pages(step, setup.p, cap_pages),
        "topp+ht": topp_pages(step, setup.p, cap_pages - sample_pages),
        "topp+mean": topp_pages(step, setup.p, cap_pages),
        "topp+diff": topp_pages(step, setup.p, cap_pages - sample_pages),
    }
    for name, chosen in selections.items():
        read_q = chosen.repeat_interleave(g, 0) | step.always  # [Hq, P] read exactly
        uses_sample = name in SAMPLING
        if uses_sample:
            read_pages = (chosen[None] | sampled[:, None] | step.always).sum(-1).double().mean(-1)  # [S]
        else:
            read_pages = (chosen | step.always).sum(-1).double().mean().expand(s)
        d_e = (step.d_page * read_q).sum(-1)  # [Hq]
        n_e = (step.n_page * read_q[..., None]).sum(1)
        o_e = n_e / d_e[:, None]
        tail = ~read_q  # [Hq, P]
        d_hi = (step.a_hi * tail).sum(-1)
        alpha = d_hi / (d_e + d_hi)
        v_max = torch.where(tail, step.v_max, 0.0).amax(-1)
        radius = alpha * (v_max + o_e.norm(dim=-1))  # [Hq]
        model_d = (step.a_est * tail).sum(-1)
        model_n = (step.a_est[..., None] * step.v_mean * tail[..., None]).sum(1)
        if name in ("plan", "topp"):
            o_hat = o_e.expand(s, -1, -1)
        elif name == "topp+mean":
            o_hat = ((n_e + model_n) / (d_e + model_d)[:, None]).expand(s, -1, -1)
        else:
            o_hat, b_stat = _sampled(step, setup, name, picks, sizes, tail, d_e, n_e, model_d, model_n)
        b_det_abs = (o_hat - o_e).norm(dim=-1).add(radius).norm(dim=-1)  # [S], on ||o - o_hat||
        b_det = _bound_relative(b_det_abs, o_hat)
        bound = b_det if not uses_sample else torch.minimum(b_det, b_stat)
        if name == "plan":
            bound = torch.full((s,), torch.inf, dtype=torch.float64)
        error, head_error = _relative(o_hat, step.exact)
        out[name] = {"read": read_pages, "pages": pages, "error": error, "head_error": head_error, "bound": bound,
                     "bound_det": b_det, "bound_det_abs": b_det_abs,
                     "rest": int(rest.sum()), "tail": (tail.double().sum(-1).mean()).item()}  # fmt: skip
    return out


def _plan(importance: torch.Tensor, rest: torch.Tensor, cap: int) -> torch.Tensor:
    """The ``cap`` rest pages of highest importance, ``[P]`` bool."""
    chosen = torch.zeros_like(rest)
    if cap <= 0:
        return chosen
    ranked = torch.where(rest, importance.double(), -1.0).argsort(descending=True)[:cap]
    chosen[ranked] = True
    return chosen & rest


def _sampled(step, setup, name, picks, sizes, tail, d_e, n_e, model_d, model_n):
    """The sampling candidates' estimate ``[S, Hq, Dv]`` and statistical bound ``[S]``."""
    s = picks.shape[0]
    if picks.numel() == 0:
        o = ((n_e + model_n) / (d_e + model_d)[:, None]) if name == "topp+diff" else n_e / d_e[:, None]
        return o.expand(s, -1, -1), torch.full((s,), torch.inf, dtype=torch.float64)
    pi = (2.0 / sizes)[None, :, None]  # [1, strata, 1]
    in_tail = tail.T[picks]  # [S, strata, 2, Hq]
    d_p = step.d_page.T[picks] * in_tail
    n_p = step.n_page.permute(1, 0, 2)[picks] * in_tail[..., None]
    if name == "topp+diff":
        resid_d = d_p - step.a_est.T[picks] * in_tail
        resid_n = n_p - (step.a_est[..., None] * step.v_mean).permute(1, 0, 2)[picks] * in_tail[..., None]
        base_d, base_n = d_e + model_d, n_e + model_n
    else:
        resid_d, resid_n = d_p, n_p
        base_d, base_n = d_e.clone(), n_e.clone()
    est_d = base_d + (resid_d.sum(2) / pi).sum(1)  # [S, Hq]
    est_n = base_n + (resid_n.sum(2) / pi[..., None]).sum(1)  # [S, Hq, Dv]
    est_d = est_d.clamp_min(d_e)  # the tail's mass is never negative
    o_hat = est_n / est_d[..., None]
    # Linearised residual of the ratio; a stratum's two draws give its variance.
    y = resid_n - o_hat[:, None, None] * resid_d[..., None]  # [S, strata, 2, Hq, Dv]
    diff2 = (y[:, :, 0] - y[:, :, 1]).pow(2)  # [S, strata, Hq, Dv]
    m = sizes[None, :, None, None]
    var = (m * m * (1 - 2 / m) * diff2 / 4).sum(1)  # per stratum: M^2 (1 - 2/M) s^2 / 2, s^2 = d^2 / 2
    se = (var / est_d[..., None] ** 2).sum((-1, -2)).sqrt()  # [S]
    quantile = student_t.ppf(1 - setup.delta / 2, max(1, picks.shape[1]))
    return o_hat, _bound_relative(quantile * se, o_hat)
