"""Which decode batches replay a CUDA graph with the hot set on, and which graph.

SGLang's decode graph runner asks ``can_run_graph`` for every decode batch and picks a graph
variant per batch (``create_attention_graph_variants``); the plugin wraps both (``plugin.py``):

- a batch holding no request longer than ``--hot-set-threshold`` is left to SGLang's check and
  replays the ``dense`` graphs SGLang captures anyway (every page read);
- a batch holding one replays the captured hot-set step (``hot``, or ``hot_guard`` where a row is
  guarded: ``hot_set/graph/step.py``) where ``--hot-set-graph-rows`` is set and the step's buffers
  take the plan made here (``plan_hot_set_graph_step`` on the backend), else runs eagerly;
- after the batch, the scheduler folds and ends a replayed hot-set step as it ends an eager one
  (``HotSetAttention.end_batch``).

Decided from the host's copy of the batch's lengths. Where ranks must agree on graph or eager
(``require_mlp_sync``: DP attention, gathered buffers), each rank would decide from its own batch:
every decode with the hot set on runs eagerly there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from sgl_importance.runtime import Runtime

if TYPE_CHECKING:
    from sgl_importance.config import ImportanceConfig
    from sgl_importance.sglang_types.model import AttentionGraphVariants, DecodeGraphRunner, ForwardBatch


def holds_hot_set_request(seq_lens_cpu: Optional[torch.Tensor], threshold: int) -> bool:
    """Whether a decode batch holds a request longer than ``threshold`` tokens (one the hot set
    decodes), from SGLang's host copy of the batch's lengths; without that copy, assume so."""
    if seq_lens_cpu is None:
        return True
    return seq_lens_cpu.numel() > 0 and int(seq_lens_cpu.max()) > threshold


DENSE_VARIANT, HOT_VARIANT, GUARD_VARIANT = "dense", "hot", "hot_guard"


class HotSetGraphVariants:
    """The decode graphs captured with ``--hot-set-graph-rows``, per batch size: ``dense``
    (every page, the graphs SGLang captures anyway), ``hot`` (the fixed-shape hot-set step,
    guard off) and ``hot_guard`` (the same with the guard's layers, ``hot_set/graph/guard.py``).
    A batch holding a request past the threshold selects ``hot``, or ``hot_guard`` where the
    step planned for it (``plan_graph_step``, just before) has a guarded row.

    Args:
        threshold: ``--hot-set-threshold``.
        runtime: the process's runtime (``hot_set_attention``: the decode backend's hot set).
    """

    capture_labels = (DENSE_VARIANT, HOT_VARIANT, GUARD_VARIANT)

    def __init__(self, threshold: int, runtime: Runtime) -> None:
        self.threshold = threshold
        self.runtime = runtime

    def select(self, forward_batch: ForwardBatch) -> str:
        """The batch's variant, kept on the hot set too: SGLang's replay keys its graph by it
        but tells the backend's metadata hook no variant (it does while capturing)."""
        hot_set = self.runtime.hot_set_attention
        variant = DENSE_VARIANT
        if holds_hot_set_request(forward_batch.seq_lens_cpu, self.threshold):
            guarded = hot_set is not None and hot_set.graph is not None and hot_set.graph.guarded
            variant = GUARD_VARIANT if guarded else HOT_VARIANT
        if hot_set is not None:
            hot_set.replay_variant = variant
        return variant


def graph_variants(
    runtime: Runtime, original: Callable[..., Optional[AttentionGraphVariants]], hf_config: object
) -> Optional[AttentionGraphVariants]:
    """Around SGLang's ``create_attention_graph_variants``: the hot set's, where a model has
    none of its own and ``--hot-set-graph-rows`` is set (``hf_config``: the model's, handed on as is)."""
    variants = original(hf_config)
    config = runtime.config
    if variants is not None or config.hot_set_policy == "off" or not config.hot_set_graph_rows:
        return variants
    return HotSetGraphVariants(config.hot_set_threshold, runtime)


def eager_with_hot_set_requests(
    config: ImportanceConfig, original: Callable[..., bool], runner: DecodeGraphRunner, forward_batch: ForwardBatch
) -> bool:
    """Around ``DecodeCudaGraphRunner.can_run_graph``: a batch holding a request the hot set
    decodes replays the captured hot-set step where its buffers take the planned step
    (``--hot-set-graph-rows``, ``plan_hot_set_graph_step``), else runs eagerly.

    The eager step picks its pages, their count, the guard's reads and host copies on the
    host from the step's data; a graph of it would replay the captured step's choices. A
    batch of short requests is left to SGLang's own check. Where ranks must agree on graph
    or eager (``require_mlp_sync``: DP attention, gathered buffers), each rank would decide
    from its own batch: every decode runs eagerly there.
    """
    if config.hot_set_policy == "off":
        return original(runner, forward_batch)
    if runner.require_mlp_sync:
        return False
    if not holds_hot_set_request(forward_batch.seq_lens_cpu, config.hot_set_threshold):
        return original(runner, forward_batch)
    plan = getattr(getattr(runner, "attn_backend", None), "plan_hot_set_graph_step", None)
    if plan is None or not original(runner, forward_batch):
        return False
    # SGLang pads the batch to the next size it captured: the hot graph of that size runs.
    bs = forward_batch.batch_size
    padded = min((b for b in getattr(runner, "capture_bs", ()) if b >= bs), default=bs)
    return plan(forward_batch, padded)
