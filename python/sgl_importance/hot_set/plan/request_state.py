"""The hot-set decoder's records of its requests, by logical page.

``TrackedRequest`` is what a long request keeps across decode steps: its hot set
(``selection.RequestHotSet``), the range ids of its full pages' key ranges
(``key_ranges.py``), the guard ids of their key codes (``key_codes.py``), its page
sample's draws (``sample.py``), its read cap per layer (raised where a layer's bound
was flagged, lowered back where it held) and the plan made one step ahead. ``LiveRequest`` is a
request of the step in progress, with what the step's layers found about its pages (exact
masses, estimated masses of unread pages, the guard's reads, the step's counts).
``page_slots`` and ``released_among`` map logical pages to token slots and to the pages
the request has given back to the allocator (``residency.RequestPages``).

Plain torch; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Optional

import torch

from sgl_importance.hot_set.pages.state import RequestMoves, RequestPages, page_offsets
from sgl_importance.hot_set.params import HotSetParams
from sgl_importance.hot_set.plan.sample import PageDraw
from sgl_importance.hot_set.plan.sample import inclusion as sample_inclusion
from sgl_importance.hot_set.plan.sample import reserve as sample_reserve
from sgl_importance.hot_set.plan.selection import HotSetCounts, RequestHotSet, fixed_mask


def _no_ids() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


class StepPlan(NamedTuple):
    """One request's plan for a step (logical pages, ascending): ``read`` in part 1 by
    every layer, ``sample`` the sampled rest pages, ``keep`` the policy's hot set; all
    three stay on the device (the rest may be released)."""

    read: torch.Tensor
    sample: torch.Tensor
    keep: torch.Tensor


@dataclass
class Seed:
    """What a request's last prefill token attended, per page, over the layers seen so far."""

    mass: torch.Tensor  # float64 [pages]: largest over layers and KV heads, or summed (policy's reduce)
    last_layer: int
    layers: int
    wanted: torch.Tensor  # int64 [num_layers]: pages each layer's top-p needs (guarded: its first read cap)


@dataclass
class TrackedRequest:
    """A long request's state kept across steps (ids on the host, by full logical page)."""

    state: RequestHotSet
    ranges: torch.Tensor = field(default_factory=_no_ids)  # range id per full page (key_ranges.KeyRanges)
    draw: Optional[PageDraw] = None  # the page sample's draws (guarded requests)
    codes: torch.Tensor = field(default_factory=_no_ids)  # guard id per full page
    sample_pi: float = 1.0  # the sample's inclusion probability in the current plan
    guard_refused: bool = False  # the guard pool had no room for its codes: decodes unguarded
    ranges_refused: bool = False  # the range pool had no room: decodes dense, every page kept
    refused_params: Optional[HotSetParams] = None  # its settings before that refusal (coding.regain_ranges)
    next_plan: Optional[tuple] = None  # (pages, StepPlan, counts), made one step ahead
    caps: Optional[torch.Tensor] = None  # float64 [L] read cap per layer (a share of its pages)
    kept: Optional[float] = None  # share of its pages kept on the device past the budget (None: the budget)
    grows: bool = True  # False once a decode step short of room put it back to its budget (it stays there)
    seeded: bool = False  # its first decode step is planned from the prefill's seed (prefill.apply_seed)

    def kept_pages(self, num_pages: int) -> int:
        """Pages its hot set may hold: the policy's budget, or more where the guard raised it."""
        return self.state.params.budget_pages(num_pages, self.kept)

    def take_plan(self, num_pages: int) -> tuple[StepPlan, HotSetCounts]:
        """Its step's plan: the one made ahead where it was made for ``num_pages``, else made now."""
        ahead, self.next_plan = self.next_plan, None
        if ahead is not None and ahead[0] == num_pages:
            return ahead[1], ahead[2]
        return self.plan_pages(num_pages)

    def plan_pages(self, num_pages: int) -> tuple[StepPlan, HotSetCounts]:
        """What its step reads in part 1, its sampled rest pages and the pages kept on the
        device, with the plan's counts. Guarded, part 1 is the sinks, the window and the pages
        not coded yet; every other page is the rest, chosen from per layer by top-p on its key
        codes (``guard.layer.guard_layer``). What stays on the device is the policy's hot set (the
        budget, with room kept for the expected sample) and the sample, drawn without looking
        at the plan or any query (the estimate needs that)."""
        state, coded = self.state, self.codes.numel()
        guarded = coded > 0 and not self.guard_refused and state.params.guard_threshold < 1.0
        self.sample_pi = 1.0
        if not guarded or state.step == 0 or state.params.policy in ("dense", "quest"):
            planned, counts = state.plan(num_pages)
            return StepPlan(planned, _no_ids(), planned), counts
        p = state.params
        budget = self.kept_pages(num_pages)
        always = fixed_mask(num_pages, p.sinks, p.window)
        room = budget - int(always.sum())
        fixed = always.clone()
        fixed[coded:] = True  # pages without key codes yet are read exactly
        pi = self.sample_pi = sample_inclusion(coded, room)
        kept, counts = state.plan(num_pages, reserve=sample_reserve(pi, num_pages, budget), budget=budget)
        if self.seeded:  # the first step, seeded: its hot set is not promoted yet, so read exactly
            fixed[kept] = True
        members = self.draw.members(coded, pi) & ~fixed[:coded]
        return StepPlan(torch.nonzero(fixed).flatten(), torch.nonzero(members).flatten(), kept), counts

    def rest_caps(self, num_pages: int, part1: int, sampled: int, num_layers: int) -> torch.Tensor:
        """int64 ``[num_layers]``: the most rest pages each layer reads exactly, its read cap
        less what it reads anyway (part 1's pages and the sample)."""
        if self.caps is None or self.caps.numel() != num_layers:
            self.caps = torch.full((num_layers,), float(self.state.params.read_cap), dtype=torch.float64)
        pages = torch.ceil(self.caps * num_pages).to(torch.int64)
        return (pages - part1 - sampled).clamp_min(0)

    def seed_caps(self, wanted: torch.Tensor, num_pages: int) -> None:
        """After the dense warm-up: each layer's cap starts at what its exact top-p needed
        (``wanted`` pages of ``num_pages``), never below the request's ``read_cap``."""
        share = wanted.double() / max(1, num_pages)
        self.caps = share.clamp(min=float(self.state.params.read_cap), max=1.0)

    def follow_flags(self, flagged: torch.Tensor, wanted: torch.Tensor, num_pages: int, missed: int = 0) -> None:
        """After a step: a layer whose bound was flagged raises its read cap to at least
        twice what it was and at least what its selection wanted (``wanted`` pages of
        ``num_pages``), up to every page (dense); one whose bound held lowers it by a tenth,
        back toward the request's ``read_cap`` (slowly: a cap that drops at once flags again).

        Residency follows: where flagged layers ``missed`` pages (wanted, not on the device:
        ``LiveRequest.missed``), the hot set grows by them, up to every page, so they are promoted and
        kept (a raised cap is worth nothing if what it would read was released); a step
        whose every layer held its bound gives a tenth of the growth back, toward the budget.
        A request put back to its budget for want of room (``grows`` False) no longer grows:
        it would take the same room again at once."""
        budget, now = self.state.params.budget_pages(num_pages), self.kept_pages(num_pages)
        if self.grows and missed and bool(flagged.any()):
            now = min(num_pages, now + missed)
        elif not bool(flagged.any()):
            now += (budget - now) // 10
        self.kept = now / num_pages if now > budget else None
        if self.caps is None or flagged.numel() != self.caps.numel():
            return
        base = float(self.state.params.read_cap)
        share = wanted.double() / max(1, num_pages)
        raised = torch.maximum(self.caps * 2, share + base).clamp_max(1.0)
        lowered = (self.caps * 0.9).clamp_min(base)
        self.caps = torch.where(flagged.to(torch.bool), raised, lowered)


@dataclass
class LiveRequest:
    """A request of the step in progress."""

    slots: torch.Tensor  # the request's token slots, in sequence order, where they live (the device's row)
    tracked: Optional[TrackedRequest]  # None: short request, attends densely
    pages: Optional[RequestPages] = None  # None: nothing of it can be released
    planned: Optional[torch.Tensor] = None  # logical pages part 1 reads exactly in every layer, ascending
    kept: Optional[torch.Tensor] = None  # the policy's hot set (kept on the device), ascending
    sample: Optional[torch.Tensor] = None  # sampled rest pages (guarded): kept resident, read per page
    tokens: Optional[torch.Tensor] = None  # tokens in each logical page
    mass_over_layers: Optional[torch.Tensor] = None  # exact mass: summed over layers, or the largest (ranks_by_max)
    layers: Optional[torch.Tensor] = None  # layers that read each page exactly
    outside_mass: Optional[torch.Tensor] = None  # largest estimated (or bound) mass of unread pages
    guarded: Optional[torch.Tensor] = None  # pages the selection wanted in some layer (read or missed)
    needed: Optional[torch.Tensor] = None  # pages a flagged layer wanted while they were released
    flagged: Optional[torch.Tensor] = None  # bool [L] layers whose bound was flagged this step
    wanted: Optional[torch.Tensor] = None  # int64 [L] rest pages each layer's selection wanted this step
    counts: HotSetCounts = field(default_factory=HotSetCounts)

    @classmethod
    def begin(
        cls,
        slots: torch.Tensor,
        tracked: TrackedRequest,
        pages: Optional[RequestPages],
        plan: StepPlan,
        counts: HotSetCounts,
        page_size: int,
    ) -> "LiveRequest":
        """A tracked request entering a step with its ``plan``, nothing found yet."""
        num_pages = -(-slots.numel() // page_size)
        tokens = torch.full((num_pages,), page_size, dtype=torch.int64)
        tokens[-1] = slots.numel() - (num_pages - 1) * page_size
        f64 = dict(dtype=torch.float64)
        return cls(
            slots,
            tracked,
            pages=pages,
            planned=plan.read,
            sample=plan.sample,
            kept=plan.keep,
            tokens=tokens,
            mass_over_layers=torch.zeros(num_pages, **f64),
            layers=torch.zeros(num_pages, dtype=torch.int64),
            outside_mass=torch.zeros(num_pages, **f64),
            guarded=torch.zeros(num_pages, dtype=torch.bool),
            counts=counts,
        )

    def take_exact(self, listed: torch.Tensor, mass: torch.Tensor, layers: int) -> None:
        """A step's exact masses ``mass`` of the ``listed`` pages, read in ``layers`` layers."""
        self.mass_over_layers[listed] = mass
        self.layers[listed] += layers
        self.counts.pages_attended += listed.numel() * layers

    def take_guard(
        self,
        logical: torch.Tensor,
        mass: torch.Tensor,
        wanted: torch.Tensor,
        flagged: torch.Tensor,
        wanted_per_layer: torch.Tensor,
        needed: torch.Tensor,
        *,
        layers: int,
        reads: int,
        pages_read: int,
        pages_estimated: int,
        pages_sampled: int,
        pages_missed: int,
        pages_guard_from_host: int = 0,
    ) -> None:
        """A step's guard over the rest pages ``logical``: their largest estimated ``mass``,
        those some layer ``wanted``, the ``flagged`` layers and what each wanted, those a
        flagged layer wanted while released (``needed``), its counts over ``layers`` layers
        (``reads``: layers in which the selection read)."""
        self.outside_mass[logical] = torch.maximum(self.outside_mass[logical], mass)
        self.guarded[logical[wanted]] = True
        if self.needed is None:
            self.needed = torch.zeros_like(self.guarded)
        self.needed[logical[needed]] = True
        c = self.counts
        c.guard_checks += layers
        c.guard_reads += reads
        c.pages_guard_read += pages_read
        c.pages_attended += pages_read + pages_sampled  # sampled pages are read exactly, each on its own
        c.pages_estimated += pages_estimated
        c.guard_flagged += int(flagged.sum())
        c.pages_sampled += pages_sampled
        c.pages_missed += pages_missed
        c.pages_guard_from_host += pages_guard_from_host
        self.flagged = flagged if self.flagged is None else self.flagged | flagged
        self.wanted = wanted_per_layer if self.wanted is None else torch.maximum(self.wanted, wanted_per_layer)

    def missed(self) -> int:
        """Pages a flagged layer's selection wanted that are off the device (released): a
        layer whose bound held did without them this step."""
        if self.pages is None or self.needed is None:
            return 0
        return int(self.pages.off_device(torch.nonzero(self.needed).flatten()).sum())

    @property
    def guard_on(self) -> bool:
        """Whether unread pages are estimated and the error bounded (dense reads everything)."""
        if self.tracked is None or self.tracked.guard_refused:
            return False
        params = self.tracked.state.params
        return params.guard_threshold < 1.0 and params.policy != "dense"

    @property
    def bounds_unread(self) -> bool:
        """Guard off: unread pages are ranked by their key min/max bound each layer. A
        dense request reads every page, so there is nothing to rank (and the bound over
        all its pages cost a dense hot-set step ~15 % at 4 x 7.5K)."""
        return self.tracked is not None and not self.guard_on and self.tracked.state.params.policy != "dense"


def kept_share(tracked: Mapping[str, TrackedRequest], rid: str) -> Optional[float]:
    """The share of its pages request ``rid``'s hot set holds past the budget (None: the
    budget): its own where it decodes, else (a request being admitted) the mean over those
    that decode, a budget-sized one counting 0: what the guard has been growing hot sets to."""
    own = tracked.get(rid)
    if own is not None:
        return own.kept
    mean = sum(t.kept or 0.0 for t in tracked.values()) / max(1, len(tracked))
    return mean or None


def ranges_refused(tracked: Mapping[str, TrackedRequest], rid: str) -> bool:
    """Whether request ``rid`` was refused key ranges (it decodes dense and keeps every page)."""
    own = tracked.get(rid)
    return own is not None and own.ranges_refused


def plan_moves(owner: str, plan: StepPlan, num_pages: int, full: int) -> RequestMoves:
    """What ``plan`` (for a request of ``num_pages``) wants moved: its ``full`` pages
    outside it released (the page being written never leaves), every page it holds kept
    (promoted where it is off the device)."""
    keep = torch.zeros(num_pages, dtype=torch.bool)
    keep[torch.cat([plan.read, plan.keep, plan.sample])] = True
    outside = (torch.arange(num_pages) < full) & ~keep
    return RequestMoves(owner, torch.nonzero(outside).flatten(), torch.nonzero(keep).flatten())


def page_slots(slots: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots of logical ``pages`` (ascending, on the host) of a request holding
    ``slots`` (wherever they live: gathered there)."""
    offsets = page_offsets(pages, page_size)
    return slots[offsets[offsets < slots.numel()].to(slots.device)]


def released_among(pages: Optional[RequestPages], wanted: torch.Tensor) -> torch.Tensor:
    """Which of the logical pages ``wanted`` have no device page (bool, same order)."""
    if pages is None:
        return torch.zeros(wanted.numel(), dtype=torch.bool)
    return pages.off_device(wanted)
