"""Which pages of a long request the next decode step attends: the hot set.

Every policy picks, per request and step, sink pages (the first ``sinks``), a
recent window (the last ``window``, which holds the token being decoded) and, up to
the budget, further pages; they differ only in how the further pages are chosen, so
baselines and the importance hot set run the same code:

- ``dense``: every page (the reference the others are measured against);
- ``window``: StreamingLLM (Xiao et al. 2023): sinks and the most recent pages,
  as many as the budget holds (at least ``window``);
- ``quest``: Quest (Tang et al. 2024): every layer attends the pages whose key
  min/max bound is largest for *that layer's current query* (``quest_layer_pages``,
  called by the decoder per layer); all KV stays on the device, so the step's plan is
  every page (nothing is released);
- ``lru``: a resident set kept across steps; residents that the last step did not
  use (mass below the uniform share ``1 / pages``) are demoted first;
- ``importance``: the same resident set, demoted by persistent importance: the
  exact masses the decode returns for resident pages — by default a page's largest
  over layers and KV heads in the step (``HotSetParams.reduce``) — folded with the
  EMA radix nodes use (``importance.ema.ema_fold``), read bias-corrected so
  a page observed for few steps is comparable with one observed for many.

``lru`` and ``importance`` promote a non-resident page when its *outside mass* says it
may matter (at least the uniform share) and, with the guard on, some layer's selection
wanted it while it was released (a *miss*: the estimate vouches for the others, so they
need no copy), and it beats the weakest resident; at most an eighth of the free budget is swapped per step, which
keeps a loose bound from churning the set (a released page costs a host→device copy per
promotion). The first decode step of a request attends densely: right after
prefill its whole KV is on the device, and that step's exact masses seed the state.

Counting: a *promotion* is a page the plan adds that the previous step did not
attend (pages that did not exist yet are not); a *hit* is a planned page the
previous step attended. Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F

from sgl_importance.choices import HOT_SET_POLICIES as POLICIES
from sgl_importance.choices import REDUCTIONS
from sgl_importance.hot_set.pages.state import ReleaseCounts
from sgl_importance.hot_set.params import HotSetParams
from sgl_importance.importance.ema import ema_fold

# Share of the free budget a resident set may swap per step (see module docstring).
SWAP_FRACTION = 1 / 8


def fixed_mask(num_pages: int, sinks: int, window: int) -> torch.Tensor:
    """Pages every policy attends: the first ``sinks`` and the last ``window``."""
    mask = torch.zeros(num_pages, dtype=torch.bool)
    mask[: min(sinks, num_pages)] = True
    mask[max(0, num_pages - window) :] = True
    return mask


@dataclass
class HotSetCounts(ReleaseCounts):
    """What the hot set did, summed over requests and steps (the ``/metrics`` series):
    the page moves of released requests (the fields of ``ReleaseCounts``) and these."""

    steps: int = 0  # request-steps decoded on the hot set
    warmups: int = 0  # request-steps attended densely as a request's first
    promotions: int = 0
    hits: int = 0
    late_arrivals: int = 0  # pages some layer wanted that the hot set had left out (promotion candidates)
    guard_checks: int = 0  # request-layer-steps whose output error the guard bounded
    guard_reads: int = 0  # ... of which the selection read rest pages exactly
    guard_flagged: int = 0  # ... of which the bound exceeded the threshold (flagged; the cap rises)
    guard_refused: int = 0  # requests refused a guard: no room for their key codes (decoded unguarded)
    ranges_refused: int = 0  # requests refused key ranges: no room in the pool (decoded dense, nothing released)
    ranges_regained: int = 0  # ... of them given their rows once the pool had room again (back on their hot set)
    pages_attended: int = 0  # pages read exactly, summed over layers (the guard's reads included)
    pages_guard_read: int = 0  # pages the guard read exactly, summed over layers
    pages_estimated: int = 0  # rest pages left to the sampled estimate, summed over layers
    pages_sampled: int = 0  # sampled rest pages read (each on its own), summed over layers
    pages_dense: int = 0  # pages dense attention would have read, over layers
    pages_read_from_host: int = 0  # attended pages read from their host copy, over layers (planned, not promoted)
    pages_guard_from_host: int = 0  # released pages a guarded layer chose, read from their host copy (CPU), over layers
    pages_missed: int = 0  # rest pages a layer wanted that were released (not read: misses), over layers
    graph_steps: int = 0  # decode batches that replayed the captured hot-set step
    graph_eager: int = 0  # hot-set decode batches its buffers refused (run eagerly)

    def add(self, other: ReleaseCounts) -> None:
        """Add another ``HotSetCounts``, or only the page moves of a ``ReleaseCounts``."""
        for f in fields(other):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RequestHotSet:
    """One request's hot-set state across decode steps (logical page indices)."""

    def __init__(self, params: HotSetParams) -> None:
        if params.policy not in POLICIES[1:]:
            raise ValueError(f"hot-set policy {params.policy!r}; allowed: {', '.join(POLICIES[1:])}")
        if params.reduce not in REDUCTIONS:
            raise ValueError(f"hot-set reduce {params.reduce!r}; allowed: {', '.join(REDUCTIONS)}")
        self.params = params
        self.resident = torch.zeros(0, dtype=torch.bool)
        self.ema = torch.zeros(0, dtype=torch.float64)
        self.observed = torch.zeros(0, dtype=torch.int64)
        self.last_use = torch.full((0,), -1, dtype=torch.int64)
        self.outside_mass = torch.zeros(0, dtype=torch.float64)
        # Pages the guard had to read exactly last step: with the guard on, the only
        # promotion candidates (the estimate vouches for the rest).
        self.needed = torch.zeros(0, dtype=torch.bool)
        self.step = 0  # observed steps

    @property
    def num_pages(self) -> int:
        return self.resident.numel()

    def _grow(self, num_pages: int, *, shrink: bool = False) -> None:
        extra = num_pages - self.num_pages
        if extra < 0 and shrink:
            # A plan made a step ahead for one more page than the step has (the
            # request did not grow): forget the page that does not exist.
            for name in ("resident", "ema", "observed", "last_use", "outside_mass", "needed"):
                setattr(self, name, getattr(self, name)[:num_pages])
        if extra <= 0:
            return
        self.resident = torch.cat((self.resident, torch.zeros(extra, dtype=torch.bool)))
        self.ema = torch.cat((self.ema, torch.zeros(extra, dtype=torch.float64)))
        self.observed = torch.cat((self.observed, torch.zeros(extra, dtype=torch.int64)))
        self.last_use = torch.cat((self.last_use, torch.full((extra,), -1, dtype=torch.int64)))
        self.outside_mass = torch.cat((self.outside_mass, torch.zeros(extra, dtype=torch.float64)))
        self.needed = torch.cat((self.needed, torch.zeros(extra, dtype=torch.bool)))

    def importance(self) -> torch.Tensor:
        """Persistent importance per page: the EMA, bias-corrected (0 if never observed)."""
        seen = self.observed > 0
        value = torch.zeros_like(self.ema)
        value[seen] = self.ema[seen] / (1.0 - self.params.decay ** self.observed[seen].double())
        return value

    def plan(self, num_pages: int, reserve: int = 0, budget: Optional[int] = None) -> tuple[torch.Tensor, HotSetCounts]:
        """The logical pages the next step attends, ascending, and what the plan cost.

        Args:
            num_pages: the request's pages now (its last one holds the token decoded).
            reserve: budget pages kept for others (the guard's page sample), chosen
                without looking at them.
            budget: pages the hot set may hold (default the policy's budget; a guarded
                request's grows where its selection missed: ``TrackedRequest.kept_pages``).
        """
        previous = min(self.num_pages, num_pages)
        self._grow(num_pages, shrink=True)
        counts = HotSetCounts()
        p = self.params
        if self.step == 0 or p.policy == "dense":
            selected = torch.ones(num_pages, dtype=torch.bool)
            counts.warmups = int(self.step == 0)
        else:
            fixed = fixed_mask(num_pages, p.sinks, p.window)
            budget = p.budget_pages(num_pages) if budget is None else budget
            slots = max(0, budget - int(fixed.sum()) - reserve)
            if p.policy == "quest":
                # Chosen per layer from the current query (quest_layer_pages); the
                # step keeps every page on the device.
                selected = torch.ones(num_pages, dtype=torch.bool)
            elif p.policy == "window":
                # StreamingLLM at the same budget: the recent window grows into the slots.
                selected = fixed_mask(num_pages, p.sinks, p.window + slots)
            elif slots == 0:
                selected = fixed
            else:
                selected = fixed | self._resident_set(fixed, slots, num_pages)
        existed = torch.arange(num_pages) < previous
        was = self.resident
        counts.promotions = int((selected & ~was & existed).sum()) if self.step else 0
        counts.hits = int((selected & was).sum())
        self.resident = selected.clone()
        return torch.nonzero(selected).flatten(), counts

    def _resident_set(self, fixed: torch.Tensor, slots: int, num_pages: int) -> torch.Tensor:
        importance = self.params.policy == "importance"
        key = self.importance() if importance else self.last_use.double()
        residents = torch.nonzero(self.resident & ~fixed).flatten()
        # Demotion: residents beyond the budget, lowest key first.
        residents = residents[torch.argsort(key[residents], descending=True, stable=True)]
        kept = residents[:slots]
        eligible = ~self.resident & ~fixed
        if self.params.guard_threshold < 1.0:
            # Guarded: a page is copied to the device once a layer's selection wanted it
            # (a miss), whatever its estimated share (top-p wants diffuse heads' small
            # pages too), and only then: promotions stay within what the selection asked for.
            eligible &= self.needed
        else:
            eligible &= self.outside_mass >= 1.0 / num_pages
        candidates = torch.nonzero(eligible).flatten()
        candidates = candidates[torch.argsort(self.outside_mass[candidates], descending=True, stable=True)]
        free = slots - kept.numel()
        promoted = [candidates[:free]]
        candidates = candidates[free:]
        # Swaps: the strongest candidates against the weakest residents, pair by pair, while
        # the candidate beats the resident (the first that does not ends the swaps).
        weakest = kept.flip(0)
        kept_mask = torch.zeros(num_pages, dtype=torch.bool)
        kept_mask[kept] = True
        swaps = min(weakest.numel(), candidates.numel(), max(1, int(slots * SWAP_FRACTION)))
        cand, res = candidates[:swaps], weakest[:swaps]
        if importance:
            beats = self.outside_mass[cand] > key[res]
        else:
            beats = self.last_use[res] < self.step
        swapped = int(beats.long().cumprod(0).sum())  # the leading run of pairs that beat
        kept_mask[res[:swapped]] = False
        promoted.append(cand[:swapped])
        for extra in promoted:
            kept_mask[extra] = True
        return kept_mask

    def observe(
        self,
        attended: torch.Tensor,
        masses: torch.Tensor,
        outside_mass: torch.Tensor,
        needed: Optional[torch.Tensor] = None,
    ) -> None:
        """Fold one finished step into the state.

        Args:
            attended: bool ``[pages]``, pages attended in at least one layer (plan and
                guard additions, the latter possibly read from their host copy).
            masses: ``[pages]`` exact mass of each attended page, reduced over the
                layers that attended it and the heads as ``params.reduce`` says.
            outside_mass: ``[pages]`` mass of each page the step did not read exactly,
                largest over layers and heads: estimated from its key codes when the guard is
                on, else the upper bound its key min/max gives; ranks pages for promotion.
            needed: bool ``[pages]``, pages a layer's selection wanted outside the plan
                (misses: the promotion candidates when the guard is on); None: none.
        """
        n = max(attended.numel(), self.num_pages)
        self._grow(n)
        if attended.numel() < n:  # a step ended late (--hot-set-plan-ahead): a later plan grew the state
            pad = (0, n - attended.numel())  # zeros (False) for the pages it did not have
            attended, masses, outside_mass = (F.pad(t, pad) for t in (attended, masses, outside_mass))
            needed = F.pad(needed, pad) if needed is not None else None
        masses = masses.double()
        keep = self.params.decay
        self.ema[attended] = ema_fold(self.ema[attended], masses[attended], keep)
        self.observed[attended] += 1
        self.step += 1
        used = attended & (masses >= 1.0 / attended.numel())
        self.last_use[used] = self.step
        self.outside_mass = outside_mass.double().clone()
        self.needed = needed.clone() if needed is not None else torch.zeros_like(attended)
        self.resident |= attended


def quest_layer_pages(bounds: torch.Tensor, params: HotSetParams) -> torch.Tensor:
    """Quest's pages for one layer: sinks, window and the largest bounds for the current query.

    Args:
        bounds: ``[pages, q_heads]`` logit bounds of the request's pages for this layer's
            query (``key_ranges.key_bound``); a page's rank is its largest over heads
            (a page any head may need).
        params: the request's policy settings (budget, sinks, window).

    Returns:
        Logical pages, ascending.
    """
    num_pages = bounds.shape[0]
    fixed = fixed_mask(num_pages, params.sinks, params.window)
    slots = max(0, params.budget_pages(num_pages) - int(fixed.sum()))
    rank = bounds.amax(dim=1).masked_fill(fixed, float("-inf"))
    chosen = fixed.clone()
    if slots:
        chosen[torch.topk(rank, min(slots, int((~fixed).sum())), sorted=False).indices] = True
    return torch.nonzero(chosen).flatten()
