"""PageImportanceTable: layers reduce into a step, steps are sampled, freed pages forget."""

import pytest
import torch

from sgl_importance.importance import page_importance as pt
from sgl_importance.importance.page_importance import PageImportanceTable

PAGE = 4


def one_request(slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_indptr / kv_indices of a single request reading these token slots."""
    return torch.tensor([0, len(slots)], dtype=torch.int32), torch.tensor(slots, dtype=torch.int64)


# Request pages: [8..11] is physical page 2, [20..23] page 5, [12, 13] page 3.
SLOTS = list(range(8, 12)) + list(range(20, 24)) + [12, 13]
INDPTR, INDICES = one_request(SLOTS)


def layer_importance(*masses: float) -> torch.Tensor:
    return torch.tensor([list(masses)], dtype=torch.float32)


def run_step(table: PageImportanceTable, *layers: tuple[float, ...]) -> None:
    for masses in layers:
        table.add_layer(layer_importance(*masses), INDPTR, INDICES)
    table.finish_step()


def test_mean_reduce_averages_a_steps_layers_onto_physical_pages():
    table = PageImportanceTable(8, page_size=PAGE, reduce="mean")
    run_step(table, (0.5, 0.3, 0.2), (0.1, 0.7, 0.2))
    expected = torch.zeros(8)
    expected[[2, 5, 3]] = torch.tensor([0.3, 0.5, 0.2])
    assert torch.allclose(table.last, expected)
    assert torch.allclose(table.accumulated, expected)
    assert table.steps == table.recorded_steps == 1


def test_max_reduce_keeps_each_pages_largest_layer():
    table = PageImportanceTable(8, page_size=PAGE, reduce="max")
    run_step(table, (0.5, 0.3, 0.2), (0.1, 0.7, 0.2))
    assert table.last[[2, 5, 3]].tolist() == pytest.approx([0.5, 0.7, 0.2])


def test_accumulated_sums_steps_while_last_holds_only_the_latest():
    table = PageImportanceTable(8, page_size=PAGE)
    run_step(table, (0.6, 0.4, 0.0))
    run_step(table, (0.2, 0.2, 0.6))
    assert table.last[[2, 5, 3]].tolist() == pytest.approx([0.2, 0.2, 0.6])
    assert table.accumulated[[2, 5, 3]].tolist() == pytest.approx([0.8, 0.6, 0.6])
    assert table.steps == 2


def test_a_page_shared_by_two_requests_gets_their_sum_in_mean_mode_and_the_larger_in_max():
    indptr = torch.tensor([0, 4, 8], dtype=torch.int32)
    indices = torch.tensor([8, 9, 10, 11, 8, 9, 10, 11], dtype=torch.int64)
    importance = torch.tensor([[0.25], [0.5]])
    for reduce, expected in (("mean", 0.75), ("max", 0.5)):
        table = PageImportanceTable(8, page_size=PAGE, reduce=reduce)
        table.add_layer(importance, indptr, indices)
        table.finish_step()
        assert table.last[2].item() == pytest.approx(expected)


def test_sample_interval_records_only_every_nth_step():
    table = PageImportanceTable(8, page_size=PAGE, sample_interval=3)
    for step in range(7):
        run_step(table, (float(step), 0.0, 0.0))
    # Steps 0, 3 and 6 are recorded.
    assert table.steps == 7
    assert table.recorded_steps == 3
    assert table.last[2].item() == pytest.approx(6.0)
    assert table.accumulated[2].item() == pytest.approx(0.0 + 3.0 + 6.0)


def test_unrecorded_steps_leave_last_untouched():
    table = PageImportanceTable(8, page_size=PAGE, sample_interval=2)
    run_step(table, (0.9, 0.1, 0.0))
    run_step(table, (0.0, 0.0, 1.0))
    assert table.last[[2, 5, 3]].tolist() == pytest.approx([0.9, 0.1, 0.0])


def test_reset_pages_zeroes_freed_pages_and_their_part_of_the_step_in_progress():
    table = PageImportanceTable(8, page_size=PAGE)
    run_step(table, (0.5, 0.3, 0.2))
    table.add_layer(layer_importance(0.5, 0.3, 0.2), INDPTR, INDICES)
    table.reset_pages(torch.tensor([2, 3]))
    table.finish_step()
    assert table.last[[2, 5, 3]].tolist() == pytest.approx([0.0, 0.3, 0.0])
    assert table.accumulated[[2, 5, 3]].tolist() == pytest.approx([0.0, 0.6, 0.0])


def test_reset_ignores_ids_outside_the_table():
    table = PageImportanceTable(8, page_size=PAGE)
    run_step(table, (0.5, 0.3, 0.2))
    table.reset_pages(torch.tensor([5, 99, -1]))
    assert table.accumulated[[2, 5, 3]].tolist() == pytest.approx([0.5, 0.0, 0.2])


def test_reset_all_forgets_every_page_but_keeps_counting_steps():
    table = PageImportanceTable(8, page_size=PAGE)
    run_step(table, (0.5, 0.3, 0.2))
    table.reset_all()
    assert not table.accumulated.any() and not table.last.any()
    assert table.steps == 1


def test_padding_page_zero_is_never_written():
    table = PageImportanceTable(8, page_size=PAGE)
    indptr, indices = one_request([0, 1, 2, 3, 8, 9])
    table.add_layer(layer_importance(0.4, 0.6), indptr, indices)
    table.finish_step()
    assert table.last[0].item() == 0.0
    assert table.last[2].item() == pytest.approx(0.6)


def test_table_is_sized_to_the_pool_plus_the_padding_page_and_never_reallocated():
    table = PageImportanceTable.for_pool(64, page_size=16)
    assert table.num_pages == 5
    addresses = (table.last.data_ptr(), table.accumulated.data_ptr())
    indptr, indices = one_request(list(range(16, 32)))
    for _ in range(3):
        table.add_layer(torch.ones(1, 1), indptr, indices)
        table.finish_step()
    table.reset_pages(torch.tensor([1]))
    assert (table.last.data_ptr(), table.accumulated.data_ptr()) == addresses


def test_invalid_settings_are_rejected():
    with pytest.raises(ValueError, match="reduce"):
        PageImportanceTable(8, page_size=PAGE, reduce="median")
    with pytest.raises(ValueError, match="sample_interval"):
        PageImportanceTable(8, page_size=PAGE, sample_interval=0)


def test_backends_of_one_process_share_one_table():
    tables = pt.PageImportanceHolder()  # the process's (its runtime owns one)
    first = tables.get_or_create(64, page_size=16)
    assert tables.get_or_create(64, page_size=16) is first
    assert tables.current is first


def test_dump_writes_a_snapshot_only_when_the_table_changed(tmp_path):
    tables = pt.PageImportanceHolder()
    table = tables.get_or_create(32, page_size=PAGE)
    run_step(table, (0.5, 0.3, 0.2))
    path = tables.dump(directory=str(tmp_path))
    state = torch.load(path)
    assert state["steps"] == 1 and state["accumulated"][2].item() == pytest.approx(0.5)
    assert tables.dump(directory=str(tmp_path)) is None
    table.reset_pages(torch.tensor([2]))
    assert tables.dump(directory=str(tmp_path)) == path
    assert torch.load(path)["accumulated"][2].item() == 0.0


# The plugin's hooks on SGLang's real allocators, in the hooked interpreter
# (``support.hooked``) so the patched classes do not leak into this session.
_ALLOCATOR_SCRIPT = r"""
import json, torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sgl_importance import runtime

tables = runtime.current().page_importance  # what the plugin's allocator hooks are handed

def zeroed(table):
    return [i for i, x in enumerate(table.accumulated.tolist()) if x == 0.0]

out = {}
cpu = dict(dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
paged = PagedTokenToKVPoolAllocator(64, page_size=4, **cpu)
table = tables.get_or_create(64, page_size=4)
table.accumulated.fill_(1.0)
slots = paged.alloc(12)
out["paged_pages"] = sorted(set((slots // 4).tolist()))
paged.free(slots[:4])
out["paged_free"] = zeroed(table)
paged.free_group_begin()
paged.free(slots[4:8])
out["paged_in_group"] = zeroed(table)
paged.free_group_end()
out["paged_group_end"] = zeroed(table)
paged.clear()
out["paged_clear"] = float(table.accumulated.sum())

tables.current = None
token = TokenToKVPoolAllocator(16, **cpu)
table = tables.get_or_create(16, page_size=1)
table.accumulated.fill_(1.0)
slots = token.alloc(3)
out["token_slots"] = slots.tolist()
token.free(slots[:1])
out["token_free"] = zeroed(table)
token.free_group_begin()
token.free(slots[1:])
out["token_in_group"] = zeroed(table)
token.free_group_end()
out["token_group_end"] = zeroed(table)
print("RESULT " + json.dumps(out))
"""


def test_plugin_hooks_zero_the_pages_sglang_allocators_free(hooked):
    out = hooked.run(_ALLOCATOR_SCRIPT).result
    first, second, _third = out["paged_pages"]
    assert out["paged_free"] == [first]
    assert out["paged_in_group"] == [first], "a free inside a group waits for the group's end"
    assert out["paged_group_end"] == sorted([first, second])
    assert out["paged_clear"] == 0.0
    s0, s1, s2 = out["token_slots"]
    assert out["token_free"] == [s0]
    assert out["token_in_group"] == [s0]
    assert out["token_group_end"] == sorted([s0, s1, s2])


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_layers_folded_per_mapping_give_the_table_a_scatter_per_layer_gives(reduce):
    # Same mapping objects layer after layer (folded, one scatter) vs a fresh copy of
    # the mapping every layer (one scatter each), with the mapping changing mid-step
    # and a page freed mid-step: the same table either way.
    gen = torch.Generator().manual_seed(0)
    other_indptr, other_indices = one_request(list(range(24, 28)) + list(range(8, 12)))
    folded = PageImportanceTable(8, page_size=PAGE, reduce=reduce)
    per_layer = PageImportanceTable(8, page_size=PAGE, reduce=reduce)
    for step in range(3):
        for layer in range(6):
            same = layer < 4
            indptr, indices = (INDPTR, INDICES) if same else (other_indptr, other_indices)
            imp = torch.rand(1, 3 if same else 2, generator=gen)
            folded.add_layer(imp, indptr, indices)
            per_layer.add_layer(imp, indptr.clone(), indices.clone())
            if step == 1 and layer == 2:
                for table in (folded, per_layer):
                    table.reset_pages(torch.tensor([5]))
        folded.finish_step()
        per_layer.finish_step()
    assert torch.allclose(folded.last, per_layer.last)
    assert torch.allclose(folded.accumulated, per_layer.accumulated)
    assert folded.accumulated[[2, 3, 5, 6]].gt(0).all()
