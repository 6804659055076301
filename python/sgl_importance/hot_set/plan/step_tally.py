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

from sgl_importance.hot_set.guard.estimate import OutsidePlan, on_device
from sgl_importance.hot_set.guard.key_ranges import KeyRanges, key_bound
from sgl_importance.hot_set.guard.layer import GuardOutcome, top_p_mask
from sgl_importance.hot_set.plan.page_lists import ExactPlan
from sgl_importance.hot_set.plan.request_state import LiveRequest, released_among
from sgl_kernel_ext import DecodeImportanceOutput

# The most the step's end gathers and computes at once for one request's bounds: a block of
# pages and layers (a Llama-8B shape: every layer of 512 pages, 32 MiB of bf16 ranges).
BOUND_CHUNK_BYTES = 32 << 20


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
    outside_wanted: Optional[torch.Tensor] = None  # bool [n, P] wanted by the selection in some layer
    outside_needed: Optional[torch.Tensor] = None  # bool [n, P] wanted by a flagged layer while released
    guard_reads: Optional[torch.Tensor] = None  # int64 [n] layers in which the selection read
    flagged: Optional[torch.Tensor] = None  # bool [n, L] layers whose bound exceeded the threshold
    wanted: Optional[torch.Tensor] = None  # int64 [n, L] rest pages each layer's selection wanted
    pages_sampled: Optional[torch.Tensor] = None  # int64 [n], over layers
    pages_guard_read: Optional[torch.Tensor] = None  # int64 [n], over layers
    pages_estimated: Optional[torch.Tensor] = None  # int64 [n], over layers
    pages_missed: Optional[torch.Tensor] = None  # int64 [n], over layers: wanted while released
    pages_guard_from_host: Optional[torch.Tensor] = None  # int64 [n], over layers: read from their host copies
    bound_mass: Optional[torch.Tensor] = None  # float64 [m, Pmax] guard-off rows: largest key-bound mass
    bound_rows: Optional[torch.Tensor] = None  # int64 [m] the guard-off rows of the batch
    bound_log_tokens: Optional[torch.Tensor] = None  # float64 [m, Pmax] log of each page's tokens
    # What each layer hands the tally, kept until the step's end and reduced there in one
    # pass over the layers (a per-layer reduction was ~34 device launches a layer: an
    # eager GPU step is launch-bound). Set to None once reduced (never read back).
    layer_importance: Optional[torch.Tensor] = None  # [L, bs, W, kv] part 1's per-KV-head masses
    layer_share: Optional[torch.Tensor] = None  # [L, bs, Hq] exact pages' share (None: all 1)
    bound_q: Optional[torch.Tensor] = None  # [L, m, Hq, D] guard-off rows' queries
    bound_lse: Optional[torch.Tensor] = None  # [L, m, Hq] their attended log denominators
    bound_layer_ids: Optional[list] = None  # the layer of each kept slot
    num_layers: int = 1  # the most layers a step adds (the buffers' first dimension)
    kept: int = 0  # layers kept in layer_importance
    warm: Optional[torch.Tensor] = None  # bool [bs] rows in their dense warm-up step (guarded)
    warm_p: Optional[torch.Tensor] = None  # float64 [bs] their top-p
    warm_wanted: Optional[torch.Tensor] = None  # int64 [L, bs] pages each layer's exact top-p needed
    run: Optional[dict] = None  # the layers' sm_scale and logit_cap (the bounds need them)

    @classmethod
    def for_step(
        cls,
        live: Sequence[LiveRequest],
        exact: ExactPlan,
        outside: OutsidePlan,
        device: torch.device,
        num_layers: int = 1,
    ) -> "StepTally":
        """An empty tally for the step's fixed lists, on the layers' device
        (``num_layers``: the most layers the step will add)."""
        # On the layers' device: folded into the requests (on the host) once per step.
        width = exact.plan.max_pages
        bs = len(live)
        by_max = torch.tensor(
            [req.tracked is not None and req.tracked.state.params.ranks_by_max for req in live],
            device=device,
        )
        tally = cls(torch.zeros(bs, width, dtype=torch.float64, device=device), by_max)
        tally.num_layers = num_layers
        warm = [req.guard_on and req.tracked.state.step == 0 for req in live]
        if any(warm):
            # The dense warm-up's exact masses say how many pages each layer's top-p needs:
            # the first guarded step's read caps start there (TrackedRequest.seed_caps).
            tally.warm = torch.tensor(warm, device=device)
            p = [req.tracked.state.params.top_p if w else 1.0 for req, w in zip(live, warm)]
            tally.warm_p = torch.tensor(p, dtype=torch.float64, device=device)
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
    def for_outside(cls, outside: OutsidePlan, device: torch.device, num_layers: int) -> "StepTally":
        """An empty tally of one layer's guard alone (lists that change per layer)."""
        empty = dict(device=device)  # on the layers' device with the rest: on_host reads them back as one
        tally = cls(torch.zeros(0, 0, dtype=torch.float64, **empty), torch.zeros(0, dtype=torch.bool, **empty))
        tally.num_layers = num_layers
        tally._zero_outside(outside, device)
        return tally

    def _zero_outside(self, outside: OutsidePlan, device: torch.device) -> None:
        n, width = outside.codes.shape
        self.outside_mass = torch.zeros(n, width, dtype=torch.float64, device=device)
        self.outside_wanted = torch.zeros(n, width, dtype=torch.bool, device=device)
        self.outside_needed = torch.zeros(n, width, dtype=torch.bool, device=device)
        self.guard_reads = torch.zeros(n, dtype=torch.int64, device=device)
        self.pages_guard_read = torch.zeros(n, dtype=torch.int64, device=device)
        self.pages_estimated = torch.zeros(n, dtype=torch.int64, device=device)
        self.flagged = torch.zeros(n, self.num_layers, dtype=torch.bool, device=device)
        self.wanted = torch.zeros(n, self.num_layers, dtype=torch.int64, device=device)
        self.pages_sampled = torch.zeros(n, dtype=torch.int64, device=device)
        self.pages_missed = torch.zeros(n, dtype=torch.int64, device=device)
        self.pages_guard_from_host = torch.zeros(n, dtype=torch.int64, device=device)

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
        """One layer's guard: the largest estimated masses, what its selection wanted and
        read (``released``: bool ``[n, P]``, the pages it read from their host copies), its
        misses and whether its bound was flagged."""
        torch.maximum(self.outside_mass, outcome.mass, out=self.outside_mass)
        self.outside_wanted |= outcome.wanted
        self.outside_needed |= outcome.missed & outcome.flagged[:, None]
        self.guard_reads += outcome.read.any(dim=1)
        self.flagged[:, layer_id % self.num_layers] |= outcome.flagged
        self.wanted[:, layer_id % self.num_layers] = outcome.wanted.sum(dim=1)
        self.pages_guard_read += outcome.read.sum(dim=1)
        self.pages_estimated += outcome.estimated.sum(dim=1)
        self.pages_missed += outcome.missed.sum(dim=1)
        self.pages_guard_from_host += (outcome.read & released).sum(dim=1)
        self.pages_sampled += (outcome.estimated & on_device(outside.sampled, outcome.read.device)).sum(dim=1)

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
    ) -> None:
        """Keep one layer's exact masses for the step's end (or, when the lists change per
        layer — the quest baseline — fold them straight into each request).

        Args:
            share: ``[bs, q_heads]`` the exact pages' share of the combined denominator
                (None: all of it, no guard combined).
            run: the layer's ``sm_scale`` and ``logit_cap``.
        """
        if per_layer:
            per_kv = result.importance_per_kv_head.double()  # [bs, W, kv]
            masses = per_kv
            if share is not None:
                masses = per_kv * kv_group_share(share, per_kv.shape[-1]).double()[:, None, :]
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
            self._keep_exact(result.importance_per_kv_head, share)
        if self.bound_mass is not None:
            self._keep_bound_inputs(layer_id, q, result)
        self.run = run

    def _keep_exact(self, per_kv: torch.Tensor, share: Optional[torch.Tensor]) -> None:
        """One layer's part-1 masses (and the exact share, where a guard combined),
        copied into the step's buffers; reduced over the layers in ``_reduce_layers``."""
        self.layers += 1
        if per_kv.shape[1] != self.exact_mass.shape[1]:
            return  # a layer whose lists differ (never with the step's fixed ones): not tallied
        slot = self.kept
        self.layer_importance = _room(self.layer_importance, slot, per_kv, per_kv.shape, self.num_layers)
        self.layer_importance[slot].copy_(per_kv)
        if share is not None:
            self.layer_share = _room(self.layer_share, slot, share, share.shape, self.num_layers, fill=1.0)
            self.layer_share[slot].copy_(share)
        self.kept += 1

    def _keep_bound_inputs(self, layer_id: int, q: torch.Tensor, result: DecodeImportanceOutput) -> None:
        """Guard off: the rows' query and attended denominator of one layer, kept for the
        key-bound ranking of their unread pages at the step's end."""
        index = self.bound_rows
        self.bound_layer_ids = self.bound_layer_ids or []
        slot = len(self.bound_layer_ids)
        m = index.shape[0]
        self.bound_q = _room(self.bound_q, slot, q, (m, *q.shape[1:]), self.num_layers)
        self.bound_lse = _room(self.bound_lse, slot, result.lse, (m, result.lse.shape[1]), self.num_layers)
        torch.index_select(q, 0, index, out=self.bound_q[slot])
        self.bound_lse[slot].copy_(result.lse.index_select(0, index))
        self.bound_layer_ids.append(layer_id)

    def _reduce_layers(self, live: Sequence[LiveRequest], ranges: Optional[KeyRanges]) -> None:
        """The kept layers into ``exact_mass`` and ``bound_mass``: for each page, the sum
        (or, for rows that rank by max, the largest) over layers of its mass, and the
        largest over layers and heads of its key-bound mass. Then the buffers go."""
        if self.layer_importance is not None:
            n = self.kept
            per_kv = self.layer_importance[:n].double()  # [L, bs, W, kv]
            if self.layer_share is not None:
                group_share = kv_group_share(self.layer_share[:n], per_kv.shape[-1]).double()  # [L, bs, kv]
                per_kv = per_kv * group_share[:, :, None, :]
            by_max = self.by_max[:, None]
            reduced = torch.where(by_max, per_kv.amax(dim=3), per_kv.mean(dim=3))  # [L, bs, W]
            self.exact_mass = torch.where(by_max, reduced.amax(dim=0).clamp_min(0.0), reduced.sum(dim=0))
            if self.warm is not None:
                self.warm_wanted = top_p_counts(per_kv, self.warm_p)
        if self.bound_layer_ids:
            self._reduce_bounds(live, ranges)
        self.layer_importance = self.layer_share = self.bound_q = self.bound_lse = None
        self.bound_layer_ids = None

    def _reduce_bounds(self, live: Sequence[LiveRequest], ranges: KeyRanges) -> None:
        """Guard off, nothing estimated: rank unread full pages by their key min/max bound
        (Quest's), as a mass against the attended denominator, largest over layers and
        heads. Per request, a block of pages and a few layers at a time: what a block gathers
        from the range pool and computes stays under ``BOUND_CHUNK_BYTES`` whatever the
        context (at least one page and one layer), so no allocation grows with it."""
        ids = torch.tensor(self.bound_layer_ids)
        rows = [b for b, req in enumerate(live) if req.bounds_unread]
        page_bytes = ranges.row_bytes // ranges.num_layers
        block = max(1, BOUND_CHUNK_BYTES // (page_bytes * ids.numel()))  # pages, every layer at once
        for i, b in enumerate(rows):
            tracked = live[b].tracked
            pages = min(live[b].tokens.numel(), tracked.ranges.numel())
            for p0 in range(0, pages, block):
                p1 = min(p0 + block, pages)
                chunk = max(1, BOUND_CHUNK_BYTES // ((p1 - p0) * page_bytes))  # layers
                best = None
                for c0 in range(0, ids.numel(), chunk):
                    slots = slice(c0, c0 + chunk)
                    kmin, kmax = ranges.gather(ids[slots], tracked.ranges[p0:p1])  # [l, P, kv, D]
                    bounds = key_bound(self.bound_q[slots, i], kmin, kmax, **self.run).double()  # [l, P, Hq]
                    lse = self.bound_lse[slots, i].double()[:, None]
                    log_mass = bounds + self.bound_log_tokens[i, p0:p1, None] - lse
                    # Largest over heads per layer, then over layers. A layer's NaN (a page with
                    # no keys) counts as nothing there, as -inf does: exp(min(v, 0)) is monotone.
                    per_layer = log_mass.amax(dim=2)
                    per_layer = torch.where(per_layer.isnan(), float("-inf"), per_layer).amax(dim=0)
                    best = per_layer if best is None else torch.maximum(best, per_layer)
                page_bound = best.clamp(max=0.0).exp().nan_to_num(0.0)
                torch.maximum(self.bound_mass[i, p0:p1], page_bound, out=self.bound_mass[i, p0:p1])

    # -- into the requests ---------------------------------------------------------

    def fold_outside(self, live: Sequence[LiveRequest], outside: OutsidePlan, layers: int) -> None:
        """The outside plan's part into its requests (``layers``: how many it covers)."""
        tally = self.on_host()
        for i, row in enumerate(outside.rows.tolist()):
            cols = outside.valid[i]
            live[row].take_guard(
                outside.logical[i][cols],
                tally.outside_mass[i][cols],
                tally.outside_wanted[i][cols],
                tally.flagged[i],
                tally.wanted[i],
                tally.outside_needed[i][cols],
                layers=layers,
                reads=int(tally.guard_reads[i]),
                pages_read=int(tally.pages_guard_read[i]),
                pages_estimated=int(tally.pages_estimated[i]),
                pages_sampled=int(tally.pages_sampled[i]),
                pages_missed=int(tally.pages_missed[i]),
                pages_guard_from_host=int(tally.pages_guard_from_host[i]),
            )

    def fold(
        self,
        live: Sequence[LiveRequest],
        exact: ExactPlan,
        outside: OutsidePlan,
        step_layers: int,
        ranges: Optional[KeyRanges] = None,
    ) -> None:
        """Once per step: the tally into each request's accumulators.

        Args:
            exact, outside: the step's fixed lists (part 1 and part 2).
            step_layers: layers attended in the step.
            ranges: the key-range pool the guard-off rows' bounds read.
        """
        self._reduce_layers(live, ranges)
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
            if tally.warm_wanted is not None and bool(tally.warm[b]):
                req.tracked.seed_caps(tally.warm_wanted[:, b], req.tokens.numel())
            listed = exact.logical[b]
            req.take_exact(listed, tally.exact_mass[b, : listed.numel()], tally.layers)
            req.counts.pages_read_from_host += int(released_among(req.pages, listed).sum()) * tally.layers
        if tally.layers and not outside.empty:
            tally.fold_outside(live, outside, layers=tally.layers)


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
    them: of the combined denominator (``share``: the exact pages' share per query head;
    None: all of it), mean over KV heads."""
    if share is None:
        return per_kv.mean(-1)
    return (per_kv * kv_group_share(share, per_kv.shape[-1])[:, None, :]).mean(-1)


def _room(
    buffer: Optional[torch.Tensor],
    slot: int,
    like: torch.Tensor,
    shape: tuple,
    layers: int,
    fill: Optional[float] = None,
) -> torch.Tensor:
    """``buffer`` (``[slots, *shape]``, ``like``'s dtype and device) with room for ``slot``:
    made for ``layers`` slots at first, doubled past them (a step that asks more layers
    than the model has: tests)."""
    if buffer is not None and slot < buffer.shape[0]:
        return buffer
    size = layers if buffer is None else 2 * buffer.shape[0]
    shape = (max(size, slot + 1), *shape)
    grown = like.new_empty(shape) if fill is None else like.new_full(shape, fill)
    if buffer is not None:
        grown[: buffer.shape[0]] = buffer
    return grown
