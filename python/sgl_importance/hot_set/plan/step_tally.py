"""What the layers of a hot-set step found, kept as tensors and folded once per step.

Each layer adds to a ``StepTally`` on the layers' device: part 1's masses and, for requests
with the guard off, the key min/max bound of each full page, through the captured step's own
tally (``sgl_kernel_ext.page_tally``: one launch a layer, Triton on a GPU), so an eager and a
captured step rank pages by the same numbers; and, for guarded requests, the estimated masses
of unread pages and the guard's reads (the outside plan's table). ``fold`` copies the tally to
the host once, at the end of the step, and adds it into each request's accumulators
(``request_state.LiveRequest``; ``fold_pages``, a captured step's fold too): no Python loop per
request per layer. The ``quest`` baseline's lists change per layer, so its layers' masses fold
straight into the requests instead.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch

from sgl_importance.hot_set.guard.estimate import OutsidePlan, on_device
from sgl_importance.hot_set.guard.key_ranges import KeyRanges
from sgl_importance.hot_set.guard.layer import GuardOutcome, top_p_mask
from sgl_importance.hot_set.plan.page_lists import ExactPlan
from sgl_importance.hot_set.plan.request_state import LiveRequest, released_among
from sgl_kernel_ext import DecodeImportanceOutput
from sgl_kernel_ext.page_tally import BOUND, MAX, SUM, tally_pages


@dataclass
class StepTally:
    """What the layers of a step found, as tensors (folded into each request once, at
    the end of the step).

    ``pages`` follows part 1's padded table ``[bs, W]`` for the masses and each request's
    pages for the bounds (``page_tally``'s layout, as wide as the longer); ``outside_*`` the
    outside plan's ``[n, P]``.
    """

    pages: torch.Tensor  # float32 [3, bs, width]: page_tally's SUM, MAX (listed columns), BOUND (pages)
    page_size: int
    layers: int = 0  # layers read with part 1's fixed lists
    ids: Optional[torch.Tensor] = None  # int64 [bs, width] guard-off rows' range ids (None: no such row)
    padded: Optional[torch.Tensor] = None  # [bs, width, kv] a layer's part-1 masses, padded to the width
    use_triton: bool = False  # page_tally's Triton kernel (a GPU's, or a Triton reader's)
    guard: Optional[torch.Tensor] = None  # float64 [n, 2P + 5 + 2L]: the guard's rows (guard_rows)
    guard_from_host: Optional[torch.Tensor] = None  # int64 [n], over layers: pages read from their host copies
    num_layers: int = 1  # the most layers a step adds
    warm: Optional[torch.Tensor] = None  # bool [bs] rows in their dense warm-up step (guarded)
    warm_p: Optional[torch.Tensor] = None  # float64 [bs] their top-p
    warm_layers: Optional[list] = None  # int64 [bs] per tallied layer: pages its exact top-p needed
    warm_wanted: Optional[torch.Tensor] = None  # int64 [L, bs] the same, stacked where the step ends

    @classmethod
    def for_step(
        cls,
        live: Sequence[LiveRequest],
        exact: ExactPlan,
        outside: OutsidePlan,
        device: torch.device,
        num_layers: int = 1,
        *,
        page_size: int,
        kv_heads: int,
        use_triton: bool = False,
    ) -> "StepTally":
        """An empty tally for the step's fixed lists, on the layers' device
        (``num_layers``: the most layers the step will add)."""
        bounded = [b for b, req in enumerate(live) if req.bounds_unread]
        # Part 1's columns; with guard-off rows, each of their full pages (their bounds).
        width = max([exact.plan.max_pages] + [live[b].tokens.numel() for b in bounded])
        pages = torch.zeros(3, len(live), width, dtype=torch.float32, device=device)
        pages[BOUND].fill_(float("-inf"))
        tally = cls(pages, page_size, use_triton=use_triton)
        tally.num_layers = num_layers
        if bounded:
            # Each full page's range id (0: none), written on the host, put on the device once.
            ids = torch.zeros(len(live), width, dtype=torch.int64)
            for b in bounded:
                ranges = live[b].tracked.ranges
                n = min(live[b].tokens.numel(), ranges.numel())
                ids[b, :n] = ranges[:n]
            tally.ids = ids.to(device)
        if bounded:  # a layer's masses padded to the bounds' width (quest's: none), made here: no layer allocates
            tally.padded = torch.zeros(len(live), width, kv_heads, dtype=torch.float32, device=device)
        warm = [req.guard_on and req.tracked.state.step == 0 for req in live]
        if any(warm):
            # The dense warm-up's exact masses say how many pages each layer's top-p needs:
            # the first guarded step's read caps start there (TrackedRequest.seed_caps).
            tally.warm = torch.tensor(warm, device=device)
            p = [req.tracked.state.params.top_p if w else 1.0 for req, w in zip(live, warm)]
            tally.warm_p = torch.tensor(p, dtype=torch.float64, device=device)
            tally.warm_layers = []
        tally._zero_outside(outside, device)
        return tally

    @classmethod
    def for_outside(cls, outside: OutsidePlan, device: torch.device, num_layers: int) -> "StepTally":
        """An empty tally of one layer's guard alone (lists that change per layer)."""
        # On the layers' device with the rest: on_host reads them back as one.
        tally = cls(torch.zeros(3, 0, 0, dtype=torch.float32, device=device), 1)
        tally.num_layers = num_layers
        tally._zero_outside(outside, device)
        return tally

    def _zero_outside(self, outside: OutsidePlan, device: torch.device) -> None:
        n, width = outside.codes.shape
        self.guard = guard_rows(n, width, self.num_layers, device)
        self.guard_from_host = torch.zeros(n, dtype=torch.int64, device=device)

    def on_host(self) -> "StepTally":
        """The tally with its tensors on the host, where the requests' state lives: one
        read back (every field packed into one float64 buffer, then cut apart)."""
        names = [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        tensors = [getattr(self, name) for name in names]
        if not tensors:
            return replace(self)
        packed = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        packed = packed.cpu()  # the step's one read back
        host, start = {}, 0
        for name, t in zip(names, tensors):
            # float64 holds these exactly: masses, bools and counts far below 2**53.
            host[name] = packed[start : start + t.numel()].view(t.shape).to(t.dtype)
            start += t.numel()
        return replace(self, **host)

    # -- one layer -----------------------------------------------------------------

    def add_guard(self, outcome: GuardOutcome, outside: OutsidePlan, layer_id: int, released: torch.Tensor) -> None:
        """One layer's guard into its rows (``keep_in_tally``, as a captured step keeps it), and
        the pages it read from their host copies (``released``: bool ``[n, P]``)."""
        sampled = on_device(outside.sampled, outcome.read.device)
        keep_in_tally(self.guard, outcome, sampled, layer_id % self.num_layers, self.num_layers)
        self.guard_from_host += (outcome.read & released).sum(dim=1)

    def add_exact(
        self,
        live: Sequence[LiveRequest],
        layer_id: int,
        q: torch.Tensor,
        result: DecodeImportanceOutput,
        exact: ExactPlan,
        share: Optional[torch.Tensor],
        run: dict,
        per_layer: bool,
        ranges: KeyRanges,
    ) -> None:
        """One layer's exact masses and the guard-off rows' key bounds into the tally (or,
        when the lists change per layer — the quest baseline — its masses folded straight into
        each request, its bounds tallied).

        Args:
            share: ``[bs, q_heads]`` part 1's share of the combined denominator (``guard.layer.part_share``)
                (None: all of it, no guard combined).
            run: the layer's ``sm_scale`` and ``logit_cap``.
            ranges: the key-range pool (the bounds read this layer's ranges by id).
        """
        per_kv = result.importance_per_kv_head
        if share is not None:
            per_kv = per_kv * kv_group_share(share, per_kv.shape[-1])[:, None, :]
        if per_layer:
            _fold_layer(live, per_kv.double(), exact)
            per_kv = None  # the tally takes the bounds alone
        elif per_kv.shape[1] > self.pages.shape[2]:
            return  # a layer whose lists differ (never with the step's fixed ones): not tallied
        else:
            self.layers += 1
            if self.warm_layers is not None:
                self.warm_layers.append(top_p_counts(per_kv[None].double(), self.warm_p)[0])
        if per_kv is None and self.ids is None:
            return
        if per_kv is None or per_kv.shape[1] != self.pages.shape[2]:
            if per_kv is not None:  # (quest's layers: their bounds alone, against no mass)
                self.padded[:, : per_kv.shape[1]].copy_(per_kv)
            per_kv = self.padded
        key_min, key_max = ranges.key_min[layer_id], ranges.key_max[layer_id]
        run = dict(sm_scale=run["sm_scale"], logit_cap=run["logit_cap"], page_size=self.page_size)
        tally_pages(per_kv, q, result.lse, key_min, key_max, self.ids, self.pages, **run, use_triton=self.use_triton)

    # -- into the requests ---------------------------------------------------------

    def fold_outside(self, live: Sequence[LiveRequest], outside: OutsidePlan, layers: int) -> None:
        """The outside plan's part into its requests (``layers``: how many it covers)."""
        tally = self.on_host()
        width = outside.codes.shape[1]
        for i, row in enumerate(outside.rows.tolist()):
            cols = outside.valid[i]
            from_host = int(tally.guard_from_host[i])
            fold_guard(live[row], tally.guard[i], outside.logical[i][cols], cols, width, layers, from_host)

    def fold(
        self,
        live: Sequence[LiveRequest],
        exact: ExactPlan,
        outside: OutsidePlan,
        step_layers: int,
    ) -> None:
        """Once per step: the tally into each request's accumulators.

        Args:
            exact, outside: the step's fixed lists (part 1 and part 2).
            step_layers: layers attended in the step.
        """
        if self.warm_layers:
            self.warm_wanted = torch.stack(self.warm_layers)
        self.ids = self.padded = self.warm_layers = None  # the device's own: not read back
        tally = self.on_host()  # one copy per step from the layers' device
        for b, req in enumerate(live):
            if req.tracked is None:
                continue
            listed = exact.logical[b]
            fold_pages(req, tally.pages[:, b], listed, tally.layers, step_layers)
            if tally.layers == 0:
                continue
            if tally.warm_wanted is not None and bool(tally.warm[b]):
                req.tracked.seed_caps(tally.warm_wanted[:, b], req.tokens.numel())
            req.counts.pages_read_from_host += int(released_among(req.pages, listed).sum()) * tally.layers
        if tally.layers and not outside.empty:
            tally.fold_outside(live, outside, layers=tally.layers)


def fold_pages(req: LiveRequest, tally: torch.Tensor, listed: torch.Tensor, layers: int, step_layers: int) -> None:
    """One request's row of a step's page tally (``[3, width]`` on the host, ``page_tally``'s
    layout) into its accumulators: its listed pages' exact masses, read in ``layers`` layers
    (none: nothing read with the step's lists), and, guard off, its pages' key bounds; the
    eager and the captured step alike."""
    num = req.tokens.numel()
    req.counts.pages_dense += num * step_layers
    if req.bounds_unread:
        bound = tally[BOUND, :num].double().clamp(max=0.0).exp().nan_to_num(0.0)
        torch.maximum(req.outside_mass, bound, out=req.outside_mass)
    if layers:
        n = listed.numel()
        mass = tally[MAX, :n].clamp_min(0.0) if req.tracked.state.params.ranks_by_max else tally[SUM, :n]
        req.take_exact(listed, mass.double(), layers)


# Counts in a guard row, after its masses and wanted marks (sgl_kernel_ext.guard_finish's layout).
GUARD_READS, PAGES_READ, PAGES_ESTIMATED, PAGES_MISSED, PAGES_SAMPLED = range(5)
COUNTS = 5


def guard_rows(n: int, pages: int, layers: int, device: torch.device) -> torch.Tensor:
    """A step's guard rows, zeros: float64 ``[n, 2P + 5 + 2L]``, per guarded request its rest
    pages' largest estimated masses, their wanted marks, the counts, the flagged layers and
    each layer's wanted count (``keep_in_tally``; ``guard_finish_triton`` in a captured step)."""
    return torch.zeros(n, 2 * pages + COUNTS + 2 * layers, dtype=torch.float64, device=device)


def keep_in_tally(tally: torch.Tensor, outcome: GuardOutcome, sampled: torch.Tensor, layer: int, layers: int) -> None:
    """One guarded layer's outcome into the guard's rows (``guard_rows``): the eager step's, and
    a captured step's torch path (``sgl_kernel_ext.guard_finish`` writes the same rows on a GPU)."""
    p = outcome.read.shape[1]
    t = tally
    torch.maximum(t[:, :p], outcome.mass, out=t[:, :p])
    # 1: some layer wanted the page; 2: a flagged layer wanted it while it was released.
    wanted = outcome.wanted.double() + (outcome.missed & outcome.flagged[:, None]).double()
    torch.maximum(t[:, p : 2 * p], wanted, out=t[:, p : 2 * p])
    counts = torch.stack(
        (
            outcome.read.any(dim=1),
            outcome.read.sum(dim=1),
            outcome.estimated.sum(dim=1),
            outcome.missed.sum(dim=1),
            (outcome.estimated & sampled).sum(dim=1),
        ),
        dim=1,
    )
    t[:, 2 * p : 2 * p + COUNTS].add_(counts.double())
    flagged = t[:, 2 * p + COUNTS + layer]
    torch.maximum(flagged, outcome.flagged.double(), out=flagged)
    t[:, 2 * p + COUNTS + layers + layer].copy_(outcome.wanted.sum(dim=1).double())


def fold_guard(
    req: LiveRequest,
    row: torch.Tensor,
    logical: torch.Tensor,
    cols: torch.Tensor | slice,
    pages: int,
    layers: int,
    from_host: int = 0,
) -> None:
    """One request's guard row (``guard_rows``' layout, on the host) into its accumulators: the
    rest pages ``logical`` in its columns ``cols``, over ``layers`` layers; the eager and the
    captured step alike."""
    counts = row[2 * pages : 2 * pages + COUNTS].long().tolist()
    marks = row[pages : 2 * pages][cols]
    flags = row[2 * pages + COUNTS :]
    req.take_guard(
        logical,
        row[:pages][cols],
        marks > 0,
        flags[: flags.numel() // 2] > 0,
        flags[flags.numel() // 2 :].long(),
        marks > 1,
        layers=layers,
        reads=counts[GUARD_READS],
        pages_read=counts[PAGES_READ],
        pages_estimated=counts[PAGES_ESTIMATED],
        pages_sampled=counts[PAGES_SAMPLED],
        pages_missed=counts[PAGES_MISSED],
        pages_guard_from_host=from_host,
    )


def _fold_layer(live: Sequence[LiveRequest], masses: torch.Tensor, exact: ExactPlan) -> None:
    """One layer's masses ``[bs, W, kv]`` straight into its requests (lists that change per layer)."""
    for b, req in enumerate(live):
        if req.tracked is None:
            continue
        listed = exact.logical[b]
        m = masses[b, : listed.numel()].cpu()
        if req.tracked.state.params.ranks_by_max:
            req.mass_over_layers[listed] = torch.maximum(req.mass_over_layers[listed], m.amax(dim=1))
        else:
            req.mass_over_layers[listed] += m.mean(dim=1)
        req.layers[listed] += 1
        req.counts.pages_attended += listed.numel()
        req.counts.pages_read_from_host += int(released_among(req.pages, listed).sum())


def top_p_counts(per_kv: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """int64 ``[L, bs]``: per layer and row, the pages some KV head needs, largest exact mass
    first, to reach ``top_p`` ``[bs]`` of its mass (the union over KV heads).

    Args:
        per_kv: ``[L, bs, W, kv]`` each listed page's exact mass per KV head.
    """
    mass = per_kv.clamp_min(0.0).transpose(2, 3)  # [L, bs, kv, W]
    share = mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    chosen = top_p_mask(share, share.new_zeros(share.shape[:-1]), top_p[None, :, None].to(share.dtype))
    return chosen.any(dim=2).sum(dim=-1)


def kv_group_share(share: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[..., Hq]`` the exact pages' share per query head as ``[..., kv_heads]``: the mean
    over each KV head's group of query heads (what per-KV-head masses are scaled by)."""
    return share.unflatten(-1, (kv_heads, -1)).mean(-1)


def shared_masses(per_kv: torch.Tensor, share: Optional[torch.Tensor]) -> torch.Tensor:
    """Part 1's masses per KV head ``[bs, pages, kv]`` as the page importance table takes
    them: of the combined denominator (``share``: part 1's share of it per query head;
    None: all of it), mean over KV heads."""
    if share is None:
        return per_kv.mean(-1)
    return (per_kv * kv_group_share(share, per_kv.shape[-1])[:, None, :]).mean(-1)
