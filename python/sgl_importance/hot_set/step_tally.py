"""What the layers of a hot-set step found, kept as tensors and folded once per step.

Each layer adds to a ``StepTally`` on the layers' device: the exact masses of the
pages it read (part 1's padded table), and for guarded requests the estimated masses
of unread pages and the guard's reads (the outside plan's table), or for requests with
the guard off the key min/max bound of their unread pages. ``fold`` copies the tally
to the host once, at the end of the step, and adds it into each request's
accumulators (``request_state.LiveRequest``): no Python loop per request per layer.
The ``quest`` baseline's lists change per layer, so its layers fold straight into the
requests instead.

Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch

from sgl_importance.hot_set.estimate import OutsidePlan, on_device
from sgl_importance.hot_set.guard import GuardOutcome
from sgl_importance.hot_set.page_lists import ExactPlan
from sgl_importance.hot_set.request_state import LiveRequest, released_among
from sgl_importance.hot_set.summaries import key_bound
from sgl_kernel_ext import DecodeImportanceOutput


@dataclass
class StepTally:
    """What the layers of a step found, as tensors (folded into each request once, at
    the end of the step).

    ``exact_*`` follow part 1's padded table ``[bs, W]``; ``outside_*`` the outside plan's
    ``[n, P]``.
    """

    exact_mass: torch.Tensor  # float64, summed over layers or the largest (rows that rank by max)
    by_max: torch.Tensor  # bool [bs]
    layers: int = 0  # layers read with part 1's fixed lists
    outside_mass: Optional[torch.Tensor] = None  # float64 [n, P] largest estimated mass
    outside_read: Optional[torch.Tensor] = None  # bool [n, P] read by the guard in some layer
    guard_reads: Optional[torch.Tensor] = None  # int64 [n] layers in which the guard read
    guard_full_reads: Optional[torch.Tensor] = None  # int64 [n] layers in which it read the whole rest
    pages_sampled: Optional[torch.Tensor] = None  # int64 [n], over layers
    pages_guard_read: Optional[torch.Tensor] = None  # int64 [n], over layers
    pages_estimated: Optional[torch.Tensor] = None  # int64 [n], over layers
    pages_host_read: Optional[torch.Tensor] = None  # int64 [n], over layers: read from their host copy
    bound_mass: Optional[torch.Tensor] = None  # float64 [m, Pmax] guard-off rows: largest key-bound mass
    bound_rows: Optional[torch.Tensor] = None  # int64 [m] the guard-off rows of the batch
    bound_log_tokens: Optional[torch.Tensor] = None  # float64 [m, Pmax] log of each page's tokens

    @classmethod
    def for_step(
        cls, live: Sequence[LiveRequest], exact: ExactPlan, outside: OutsidePlan, device: torch.device
    ) -> "StepTally":
        """An empty tally for the step's fixed lists, on the layers' device."""
        # On the layers' device: folded into the requests (on the host) once per step.
        width = exact.plan.max_pages
        bs = len(live)
        by_max = torch.tensor(
            [req.tracked is not None and req.tracked.state.params.ranks_by_max for req in live],
            device=device,
        )
        tally = cls(torch.zeros(bs, width, dtype=torch.float64, device=device), by_max)
        tally._zero_outside(outside, device)
        guard_off = [b for b, req in enumerate(live) if req.bounds_unread]
        if guard_off:
            # What every layer's bound needs of the step, on the device once: the rows and
            # each page's token count (log), padded to the longest request.
            pad = torch.nn.utils.rnn.pad_sequence
            tokens = pad([live[b].tokens for b in guard_off], batch_first=True).to(device, torch.float64)
            tally.bound_rows = torch.tensor(guard_off).to(device)
            tally.bound_log_tokens = tokens.log()
            tally.bound_mass = torch.zeros(tokens.shape, dtype=torch.float64, device=device)
        return tally

    @classmethod
    def for_outside(cls, outside: OutsidePlan, device: torch.device) -> "StepTally":
        """An empty tally of one layer's guard alone (lists that change per layer)."""
        empty = dict(device=device)  # on the layers' device with the rest: on_host reads them back as one
        tally = cls(torch.zeros(0, 0, dtype=torch.float64, **empty), torch.zeros(0, dtype=torch.bool, **empty))
        tally._zero_outside(outside, device)
        return tally

    def _zero_outside(self, outside: OutsidePlan, device: torch.device) -> None:
        n, width = outside.codes.shape
        self.outside_mass = torch.zeros(n, width, dtype=torch.float64, device=device)
        self.outside_read = torch.zeros(n, width, dtype=torch.bool, device=device)
        self.guard_reads = torch.zeros(n, dtype=torch.int64, device=device)
        self.pages_guard_read = torch.zeros(n, dtype=torch.int64, device=device)
        self.pages_estimated = torch.zeros(n, dtype=torch.int64, device=device)
        self.guard_full_reads = torch.zeros(n, dtype=torch.int64, device=device)
        self.pages_sampled = torch.zeros(n, dtype=torch.int64, device=device)
        self.pages_host_read = torch.zeros(n, dtype=torch.int64, device=device)

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

    def add_guard(self, outcome: GuardOutcome, outside: OutsidePlan, released: Optional[torch.Tensor] = None) -> None:
        """One layer's guard: the largest estimated masses, the pages it read.

        Args:
            released: bool ``[n, P]`` rest pages read from their host copy when read.
        """
        torch.maximum(self.outside_mass, outcome.mass, out=self.outside_mass)
        self.outside_read |= outcome.read
        self.guard_reads += outcome.read.any(dim=1)
        self.guard_full_reads += outcome.fallback
        self.pages_guard_read += outcome.read.sum(dim=1)
        self.pages_estimated += outcome.estimated.sum(dim=1)
        self.pages_sampled += (outcome.estimated & on_device(outside.sampled, outcome.read.device)).sum(dim=1)
        if released is not None:
            self.pages_host_read += (outcome.read & released).sum(dim=1)

    def add_exact(
        self,
        live: Sequence[LiveRequest],
        layer_id: int,
        q: torch.Tensor,
        result: DecodeImportanceOutput,
        exact: ExactPlan,
        share: torch.Tensor,
        run: dict,
        per_layer: bool,
    ) -> None:
        """Fold one layer's exact masses into the tally (or, when the lists change per
        layer — the quest baseline — straight into each request).

        Args:
            share: ``[bs, q_heads]`` the exact pages' share of the combined denominator.
            run: the layer's ``sm_scale`` and ``logit_cap``.
        """
        per_kv = result.importance_per_kv_head.double()  # [bs, W, kv]
        kv = per_kv.shape[-1]
        group_share = share.view(share.shape[0], kv, -1).mean(-1).double()  # [bs, kv]
        masses = per_kv * group_share[:, None, :]
        if per_layer:
            for b, req in enumerate(live):
                if req.tracked is None:
                    continue
                listed = exact.logical[b]
                m = masses[b, : listed.numel()].cpu()
                if bool(self.by_max[b]):
                    req.mass_over_layers[listed] = torch.maximum(req.mass_over_layers[listed], m.amax(dim=1))
                else:
                    req.mass_over_layers[listed] += m.mean(dim=1)
                req.layers[listed] += 1
                req.counts.pages_attended += listed.numel()
                req.counts.pages_read_from_host += int(released_among(req.pages, listed).sum())
        else:
            reduced = torch.where(self.by_max[:, None], masses.amax(dim=2), masses.mean(dim=2))
            if reduced.shape[1] == self.exact_mass.shape[1]:
                summed = self.exact_mass + reduced
                self.exact_mass = torch.where(self.by_max[:, None], torch.maximum(self.exact_mass, reduced), summed)
            self.layers += 1
        if self.bound_mass is not None:
            self._add_bounds(live, layer_id, q, result, run)

    def _add_bounds(
        self, live: Sequence[LiveRequest], layer_id: int, q: torch.Tensor, result: DecodeImportanceOutput, run: dict
    ) -> None:
        """Guard off, nothing estimated: rank unread pages by their key min/max bound
        (Quest's), as a mass against the attended denominator, largest over heads."""
        rows = [b for b, req in enumerate(live) if req.bounds_unread]
        mins = [live[b].tracked.key_min[layer_id] for b in rows]
        maxs = [live[b].tracked.key_max[layer_id] for b in rows]
        pad = torch.nn.utils.rnn.pad_sequence
        kmin = pad(mins, batch_first=True, padding_value=float("inf"))  # [m, Pmax, kv, D]
        kmax = pad(maxs, batch_first=True, padding_value=float("-inf"))
        index = self.bound_rows
        bounds = key_bound(q[index], kmin, kmax, **run).double()  # [m, Pmax, Hq]
        log_mass = bounds + self.bound_log_tokens[..., None] - result.lse[index].double()[:, None, :]
        page_bound = log_mass.amax(dim=2).clamp(max=0.0).exp().nan_to_num(0.0)
        width = page_bound.shape[1]
        bound_mass = self.bound_mass
        bound_mass[:, :width] = torch.maximum(bound_mass[:, :width], page_bound)

    # -- into the requests ---------------------------------------------------------

    def fold_outside(self, live: Sequence[LiveRequest], outside: OutsidePlan, layers: int) -> None:
        """The outside plan's part into its requests (``layers``: how many it covers)."""
        tally = self.on_host()
        for i, row in enumerate(outside.rows.tolist()):
            req = live[row]
            cols = outside.valid[i]
            logical = outside.logical[i][cols]
            req.outside_mass[logical] = torch.maximum(req.outside_mass[logical], tally.outside_mass[i][cols])
            read = tally.outside_read[i][cols]
            req.guarded[logical[read]] = True
            reads = int(tally.pages_guard_read[i])
            req.counts.guard_checks += layers
            req.counts.guard_reads += int(tally.guard_reads[i])
            req.counts.pages_guard_read += reads
            req.counts.pages_attended += reads
            req.counts.pages_estimated += int(tally.pages_estimated[i])
            req.counts.guard_full_reads += int(tally.guard_full_reads[i])
            req.counts.pages_sampled += int(tally.pages_sampled[i])
            req.counts.pages_read_from_host += int(tally.pages_host_read[i])
            req.counts.pages_attended += int(tally.pages_sampled[i])  # read exactly, each page on its own

    def fold(self, live: Sequence[LiveRequest], exact: ExactPlan, outside: OutsidePlan, step_layers: int) -> None:
        """Once per step: the tally into each request's accumulators.

        Args:
            exact, outside: the step's fixed lists (part 1 and part 2).
            step_layers: layers attended in the step.
        """
        tally = self.on_host()  # one copy per step from the layers' device
        guard_off = 0
        for b, req in enumerate(live):
            if req.tracked is None:
                continue
            req.counts.pages_dense += req.tokens.numel() * step_layers
            if tally.bound_mass is not None and req.bounds_unread:
                num = req.tokens.numel()
                torch.maximum(req.outside_mass, tally.bound_mass[guard_off, :num], out=req.outside_mass)
                guard_off += 1
            if tally.layers == 0:
                continue
            listed = exact.logical[b]
            req.mass_over_layers[listed] = tally.exact_mass[b, : listed.numel()]
            req.layers[listed] += tally.layers
            req.counts.pages_attended += listed.numel() * tally.layers
            req.counts.pages_read_from_host += int(released_among(req.pages, listed).sum()) * tally.layers
        if tally.layers and not outside.empty:
            tally.fold_outside(live, outside, layers=tally.layers)
