"""SGLang's decode graph runner as it treats the plugin's backend, on a hot-set world.

Per step: the plugin's hook around ``can_run_graph`` plans the batch into the captured
step's buffers or refuses (the step then runs eagerly); the batch's variant (``dense`` /
``hot``) is captured once per batch size when first needed (SGLang captures them all at
start-up, before any request: here always before the step is planned), with the buffers
listing nothing; then the step runs as a replay does: the variant's
``init_forward_metadata_out_graph``, the in-graph prologue, every layer's ``forward_decode``,
and the plugin's hook after ``execute`` (the fold). The layers' Python runs at every
"replay" (the backend's SGLang stand-ins make fresh tensors each step; ``graph_twin.py``
replays the step itself without its Python).

Shared by ``test/kernels/test_hot_set_graph_backend.py`` and
``benchmark/long_context/bench_graph_step.py``.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Optional

import torch
from sglang.srt.model_executor.runner_utils import capture_mode

from sgl_importance.attention.hot_set_graphs import (
    HotSetGraphVariants,
    eager_with_hot_set_requests,
)
from sgl_importance.hot_set import HotSetParams
from support.graph_twin import plan_put_aside
from support.hot_set_world import THRESHOLD, World

MAX_BS = 4  # the largest batch SGLang captured graphs for


class GraphRunner:
    """SGLang's decode graph runner as it treats the plugin's backend (see the module docstring)."""

    def __init__(self, world: World, params: HotSetParams, rows: int = 3) -> None:
        self.world = world
        policy = params.policy
        self.config = SimpleNamespace(hot_set_policy=policy, hot_set_threshold=THRESHOLD, hot_set_graph_rows=rows)
        self.attn_backend = world.backend
        self.require_mlp_sync = False
        self.capture_bs = list(range(1, MAX_BS + 1))  # every size, as SGLang captures small ones
        self.variants = HotSetGraphVariants(THRESHOLD, SimpleNamespace(hot_set_attention=world.backend.hot_set))
        self.captured: set[tuple[int, str]] = set()
        self.replayed = 0
        self.variants_run: list[Optional[str]] = []  # per step: the variant replayed, None eager
        world.backend.hot_set.graph_rows = self.config.hot_set_graph_rows
        world.backend.init_cuda_graph_state(MAX_BS, MAX_BS)

    def step(self, k_new, v_new, q, counter=None) -> list[torch.Tensor]:
        world, backend = self.world, self.world.backend
        batch = world.next_batch()
        if not eager_with_hot_set_requests(self.config, lambda r, b: b.batch_size <= MAX_BS, self, batch):
            backend.init_forward_metadata(batch)
            outs = world.layers_forward(batch, k_new, v_new, q)
            world.residency.apply(backend.hot_set.end_batch())  # after the batch, as the scheduler
            self.variants_run.append(None)
            return outs
        variant = self.variants.select(batch)  # after the plan, as the runner's load_batch picks it
        if (batch.batch_size, variant) not in self.captured:
            self._capture(batch, variant, k_new, v_new, q)
        # The variant keys the graph replayed; SGLang names it to the backend only while capturing
        # (its replay prep sets it for DSV4.1's early verify metadata alone): none here.
        assert capture_mode.get_capture_attention_variant() is None
        with counter.where("prep") if counter is not None else nullcontext():
            backend.init_forward_metadata_out_graph(batch)
        # What the graph holds: the prologue, then each layer under its id.
        with counter.where("prologue") if counter is not None else nullcontext():
            backend.init_forward_metadata_in_graph(batch)
        outs = world.layers_forward(batch, k_new, v_new, q, **({"where": counter.where} if counter else {}))
        self.replayed += 1
        self.variants_run.append(variant)
        world.residency.apply(backend.hot_set.end_batch())  # after the batch, as the scheduler
        return outs

    def _capture(self, batch, variant: str, k_new, v_new, q) -> None:
        """Capture ``variant`` at the batch's size. SGLang captures every size and variant at
        start-up, before any request; here a shape is captured when first needed, after the
        step was planned, so the plan is put aside while the capture empties the buffers."""
        backend = self.world.backend
        capture_mode._set_capture_attention_variant(variant)
        try:
            with plan_put_aside(backend.hot_set.graph):
                backend.init_forward_metadata_out_graph(batch, in_capture=True)
                backend.init_forward_metadata_in_graph(batch)
                self.world.layers_forward(batch, k_new, v_new, q)  # the capture's run: nothing listed
        finally:
            capture_mode._set_capture_attention_variant(None)
        self.captured.add((batch.batch_size, variant))
