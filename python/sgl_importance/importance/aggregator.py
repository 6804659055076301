"""The importance aggregator: the page importance table folded into radix-tree nodes.

Persistent importance is what a node keeps *across* decode steps; this module holds
the fold that builds it (:class:`ImportanceAggregator`) and the reads it needs.

The page importance table (``page_importance.py``) knows how much attention each *physical* page got
in the last recorded decode step, and forgets it when the allocator frees the page.
Eviction decides over *tree nodes*, which outlive their pages (a node demoted to the
host tier keeps its identity and gets new pages on load-back). This module carries
the signal over: after each decode batch, the scheduler hands the aggregator the
tree nodes its running requests attend (each request's ``last_node`` and its
ancestors), and the aggregator updates the node's :class:`NodeState`
(``node_state.py``, the one object the plugin keeps on a node):

- ``importance``: an exponential moving average, over the decode steps in which the
  node was attended, of its *density* — attention mass per page, averaged over the
  node's pages. It starts at zero, so a node attended for one step stays far below
  one attended for hundreds: sustained attention, over many steps or many
  requests, is what earns importance (H2O's "heavy hitters"). A page shared by
  several running requests receives the sum of their masses from the page importance table, so
  a shared system prompt or document becomes a hot spot.
- ``pinned``: the node lies entirely inside the first ``sink_pages``
  pages of its sequence — the attention sinks every later token attends to
  whatever the content. Sink pages are left out of every node's density (their mass
  says "position 0", not "useful content"), and the strategy evicts pinned nodes
  last.
- ``step``: the aggregator's clock (recorded decode steps) when the node
  was last attended — recency of *attention*, kept beside SGLang's own
  ``last_access_time`` (recency of *matching*); ``steps`` counts them, ``start``
  is the node's token offset in its sequence.

Density rather than total mass, because the radix tree cuts sequences wherever two
requests diverge: a node's density does not depend on where the cuts fell, a split
gives both halves the parent's value (:meth:`ImportanceAggregator.split`), and
evicting a leaf forfeits ``density x pages`` of attention — the quantity a greedy
evictor should minimise per page freed.

Plain Python and torch over duck-typed nodes (any object that accepts one
attribute); nothing here imports SGLang, so it is tested without a server.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import torch

from sgl_importance.importance.ema import ema_fold

# The config checks live beside the priority they configure (torch-free).
from sgl_importance.importance.priority import validate_decay, validate_sink_pages
from sgl_importance.node_state import has_importance, node_importance, node_state

if TYPE_CHECKING:
    from sgl_importance.importance.page_importance import PageImportanceTable
    from sgl_importance.sglang_types.tree import TreeNode


class Observation(NamedTuple):
    """One tree node attended in the step being folded.

    Attributes:
        node: the tree node; the aggregator updates its ``NodeState``.
        start: token offset of the node's first token in its sequence (the sum of
            its ancestors' key lengths), which tells which of its pages are sinks.
        pages: physical page ids of the node's device KV, in sequence order, on
            the page importance table's device.
    """

    node: TreeNode
    start: int
    pages: torch.Tensor


def read_last_step(
    table: PageImportanceTable, pages: torch.Tensor, group: Optional[torch.distributed.ProcessGroup] = None
) -> tuple[list[float], int]:
    """``table.last`` at ``pages`` and the table's recorded-step count, in one copy.

    Adapter over ``PageImportanceTable``: its public ``recorded_steps`` reads the
    device counter with a separate ``.item()``; on a GPU that is a second sync per
    fold, so the counter (``_recorded``) rides along with the gathered values
    (float64 holds a step count exactly up to 2**53).

    Args:
        table: a ``PageImportanceTable``.
        pages: physical page ids to read.
        group: the tree-cache process group when several ranks share the tree
            (tensor parallelism), else None; with a group, the values and the
            count returned are the ranks' agreement (:func:`agree_across_ranks`).
    """
    gathered = table.last.index_select(0, pages.to(table.last.device)).to(torch.float64)
    count = table._recorded.reshape(1).to(torch.float64)
    flat = torch.cat((gathered, count))
    if group is not None:
        flat = agree_across_ranks(flat, group)
    values = flat.tolist()
    return values[:-1], int(values[-1])


def agree_across_ranks(flat: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """One rank's ``[page values..., step count]`` -> the same tensor on every rank.

    Each tensor-parallel rank attends with its own heads, so its page importance table holds
    the mean over *its* KV heads; the mean over ranks is then the mean over all
    heads, the value a single rank would have recorded (a sum would scale node
    importance with ``--tp-size``). The step count is the minimum: under overlap
    scheduling a rank's table may already hold the next batch's step.

    One collective: the ranks' tensors are gathered and reduced here, in rank
    order, so every rank computes bit-identical floats whatever algorithm the
    backend uses. Every rank of ``group`` must call this the same number of times
    with tensors of the same length (the tree, hence the observed pages, is the
    same on every rank). ``group`` is a CPU (gloo) group: SGLang's cache groups are.

    Returns:
        A CPU float64 tensor: the mean of the values, the minimum of the counts.
    """
    flat = flat.to("cpu", torch.float64)
    world = torch.distributed.get_world_size(group=group)
    parts = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(parts, flat, group=group)
    total = parts[0].clone()
    count = total[-1].item()
    for part in parts[1:]:
        total += part
        count = min(count, part[-1].item())
    total /= world
    total[-1] = count
    return total


class ImportanceAggregator:
    """Folds per-step page importance into per-node persistent importance.

    Args:
        decay: EMA factor per attended decode step, in (0, 1); the node's history
            has an effective length of ``1 / (1 - decay)`` steps.
        sink_pages: leading pages of every sequence treated as attention sinks
            (pinned, left out of densities); 0 disables sink handling.
    """

    def __init__(self, *, decay: float = 0.98, sink_pages: int = 1) -> None:
        self.decay = validate_decay(decay)
        self.sink_pages = validate_sink_pages(sink_pages)
        # Recorded decode steps folded so far: the clock of ``importance_step``.
        self.clock = 0
        # Normaliser for the strategy: the largest importance among recently
        # attended nodes, decaying like the EMA so one old outlier fades.
        self.scale = 0.0
        self._table_key: Optional[int] = None
        self._seen_recorded = 0

    # -- folding -------------------------------------------------------------------

    def fold(
        self,
        table: PageImportanceTable,
        observations: Sequence[Observation],
        group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> int:
        """Fold the table's latest recorded step into the observed nodes.

        Reads the table once (one host copy for all nodes). Steps recorded since
        the previous fold count as that many steps of the latest value (the table
        keeps only the last one), so a sample interval or a skipped fold does not
        change the EMA's time constant.

        Args:
            table: a ``PageImportanceTable`` (``last``, ``page_size``, the counter).
            observations: the nodes to update, each once.
            group: the tree-cache process group when several ranks share the tree,
                else None. With a group, every rank of it must call ``fold`` for
                the same batches with the same observations: the ranks agree on
                the page values and step count before anything is updated, so
                every rank's tree gets identical importance (eviction decisions
                must not diverge).

        Returns:
            The number of newly recorded steps folded (0: nothing changed).
        """
        pages = (
            torch.cat([o.pages for o in observations])
            if observations
            else torch.zeros(0, dtype=torch.int64, device=table.last.device)
        )
        values, recorded = read_last_step(table, pages, group)
        if self._table_key != id(table):
            # A new table (start-up, or a backend rebuilt it): its history before
            # now is not ours to attribute; count at most the latest step.
            self._table_key = id(table)
            self._seen_recorded = max(recorded - 1, 0)
        new_steps = recorded - self._seen_recorded
        self._seen_recorded = recorded
        if new_steps <= 0:
            return 0
        self.clock += new_steps
        keep = self.decay**new_steps
        sink_pages = self.sink_pages
        page_size = table.page_size
        fold_max = 0.0
        offset = 0
        for node, start, node_pages in observations:
            n = int(node_pages.numel())
            page_values = values[offset : offset + n]
            offset += n
            if n == 0:
                continue
            sinks = min(n, max(0, sink_pages - start // page_size))
            pinned = sinks == n
            content = page_values if pinned else page_values[sinks:]
            density = math.fsum(content) / len(content)
            state = node_state(node)
            old = state.importance
            value = ema_fold(0.0 if old is None else old, density, keep)
            state.importance = value
            state.pinned = pinned
            state.step = self.clock
            state.steps += new_steps
            state.start = start
            if not pinned and value > fold_max:
                fold_max = value
        self.scale = max(fold_max, self.scale * keep)
        return new_steps

    # -- tree events ---------------------------------------------------------------

    def split(self, prefix: TreeNode, suffix: TreeNode, split_len: int, page_size: int) -> None:
        """The tree cut ``suffix`` after ``split_len`` tokens into a new ``prefix``.

        Both halves keep the node's density (nothing records how attention was
        spread inside it), its step count and its clock. Sink pinning follows
        positions: the prefix is pinned if it now lies inside the sink pages.
        """
        if not has_importance(suffix):
            return
        whole, half = node_state(suffix), node_state(prefix)
        half.importance = whole.importance
        half.step = whole.step
        half.steps = whole.steps
        start = whole.start
        if start is None:
            half.pinned = whole.pinned
            return
        half.start = start
        whole.start = start + split_len
        half.pinned = whole.pinned or start + split_len <= self.sink_pages * page_size

    def normalised(self, node: TreeNode) -> float:
        """``importance / scale`` clipped to [0, 1]; 0 before anything was attended."""
        scale = self.scale
        if scale <= 0.0:
            return 0.0
        value = node_importance(node) / scale
        return value if value < 1.0 else 1.0
