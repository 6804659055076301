"""Tensor parallelism: every rank's tree gets the same importance.

Each rank attends with its own heads, so each rank's page table differs. Two real
processes joined by a torch.distributed gloo group (the kind of group SGLang gives
the radix cache) fold their own tables through ``fold_after_batch``; both must end
with bit-identical node importance equal to the fold of the ranks' mean table, and
must agree on the step count when one rank's table is a step ahead.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from sgl_importance.cache.components import use_importance_components
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.node_state import node_importance, node_state
from sgl_importance.scheduler.fold import fold_after_batch, tree_group
from support.fake_tree import FakeCache, FakeTreeCore, decode_batch, request, runtime_of, scheduler_of

PAGE = 4
NUM_PAGES = 32
DECAY = 0.9
WORLD = 2
# Per rank, per fold: the steps recorded since the previous fold, each a map
# page -> mass. In the second fold rank 1 is one step ahead (under overlap its
# table may already hold the next batch's step); in the third rank 0 catches up.
STEPS = [
    [[{3: 0.4, 4: 0.2, 7: 0.1}], [{3: 0.2, 4: 0.6, 7: 0.3}]],
    [[{3: 0.5, 4: 0.1, 7: 0.2}], [{3: 0.1, 4: 0.1, 7: 0.5}, {3: 0.3, 4: 0.3, 7: 0.1}]],
    [[{3: 0.6, 4: 0.3, 7: 0.0}], []],
]
# Nodes: 1 holds pages 3 and 4 (slots 12..19), 2 is its child holding page 7.
NODES = {1: (None, 8, 12), 2: (1, 4, 28)}


def _tree():
    from sgl_importance.cache.strategy import ImportanceStrategy

    core = FakeTreeCore(ImportanceStrategy(decay=DECAY, sink_pages=0), page_size=PAGE)
    for node_id, (parent, tokens, first_slot) in NODES.items():
        node = core.add(core.nodes[parent] if parent else None, tokens, first_slot=first_slot)
        assert node.id == node_id
    return core


def _record(table: PageImportanceTable, masses: dict[int, float]) -> None:
    slots = [s for page in masses for s in range(page * PAGE, (page + 1) * PAGE)]
    table.add_layer(
        torch.tensor([list(masses.values())], dtype=torch.float32),
        torch.tensor([0, len(slots)], dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
    )
    table.finish_step()


def _rank_main(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        # A separate CPU group, as SGLang's cache gets its tp_cache_group.
        group = dist.new_group(list(range(WORLD)), backend="gloo")
        core = _tree()
        table = PageImportanceTable(NUM_PAGES, page_size=PAGE)
        tree_cache = FakeCache(core)
        tree_cache.tp_group, tree_cache.tp_world_size = group, WORLD
        scheduler = scheduler_of(tree_cache)
        runtime = runtime_of(scheduler, table)
        decode = decode_batch([request(last_node=2)])
        folded = []
        for per_rank in STEPS:
            for masses in per_rank[rank]:
                _record(table, masses)
            folded.append(fold_after_batch(runtime, scheduler, decode))
        aggregator = core.eviction_strategy.state.aggregator
        result = {
            "folded": folded,
            "importance": [node_importance(core.nodes[i]) for i in sorted(core.nodes)],
            "steps": [node_state(core.nodes[i]).steps for i in sorted(core.nodes)],
            "clock": aggregator.clock,
            "scale": aggregator.scale,
        }
        # JSON keeps a float's every bit (shortest repr round-trips).
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _expected() -> dict:
    """The fold of the ranks' mean page values, agreeing on the minimum step count.

    The table keeps only its last recorded step, so each fold sees each rank's
    latest step (or the earlier one when nothing new was recorded).
    """
    last = [{}, {}]
    recorded = [0, 0]
    seen = 0
    importance = {1: 0.0, 2: 0.0}
    folded = []
    for per_rank in STEPS:
        for rank in range(WORLD):
            for masses in per_rank[rank]:
                last[rank] = masses
                recorded[rank] += 1
        agreed = min(recorded)
        new_steps, seen = agreed - seen, agreed
        folded.append(new_steps)
        keep = DECAY**new_steps

        def mean(page: int) -> float:
            return sum(last[r].get(page, 0.0) for r in range(WORLD)) / WORLD

        importance[1] = importance[1] * keep + (mean(3) + mean(4)) / 2 * (1 - keep)
        importance[2] = importance[2] * keep + mean(7) * (1 - keep)
    return {"folded": folded, "importance": [importance[1], importance[2]]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_ranks_fold_identical_importance_the_mean_of_their_tables(tmp_path):
    # Fork: the ranks inherit the imported modules (a spawned rank would spend
    # many seconds re-importing SGLang); each builds its own group and table.
    mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="fork")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = _expected()
    # Identical on every rank, bit for bit: eviction compares these floats.
    assert results[0] == results[1]
    assert results[0]["folded"] == expected["folded"] == [1, 1, 1]
    assert results[0]["importance"] == pytest.approx(expected["importance"], rel=1e-6)
    assert results[0]["steps"] == [3, 3]
    assert results[0]["clock"] == 3


def test_a_single_rank_tree_folds_without_any_collective():
    # No process group is initialised here: a collective would raise.
    assert not dist.is_initialized()
    cache = FakeCache(FakeTreeCore())
    cache.tp_group = object()
    assert tree_group(cache) is None
    group = object()
    cache.tp_world_size, cache.tp_group = 2, group
    assert tree_group(cache) is group


def _params(**kwargs):
    # SGLang's own dataclass: its field names are what the component override reads.
    return CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=PAGE,
        eviction_policy="importance", **kwargs,
    )  # fmt: skip


def test_tensor_parallelism_is_accepted_under_the_importance_policy():
    params = _params(tp_cache_group=object(), pp_size=1, attn_cp_size=1)
    use_importance_components(None, params)
    assert params.component_registry_override


@pytest.mark.parametrize("layout, flag", [({"pp_size": 2}, "--pp-size 2"), ({"attn_cp_size": 2}, "--attn-cp-size 2")])
def test_pipeline_and_context_parallelism_are_refused_naming_the_flag(layout, flag):
    with pytest.raises(ValueError, match=flag):
        use_importance_components(None, _params(**layout))
