"""ImportanceAggregator: the page table folded into persistent per-node importance.

Steps are recorded through the real PageImportanceTable (``add_layer`` +
``finish_step``), so the fold reads what the decode backends write.
"""

from __future__ import annotations

import pytest
import torch

from sgl_importance.importance.aggregator import ImportanceAggregator, Observation
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_importance.node_state import (
    has_importance,
    node_importance,
    node_pinned,
    node_state,
    peek_state,
)
from support.fake_tree import detached_node as node

PAGE = 4
NUM_PAGES = 32


def new_table(**kwargs) -> PageImportanceTable:
    return PageImportanceTable(NUM_PAGES, page_size=PAGE, **kwargs)


def record_step(table: PageImportanceTable, *requests: dict[int, float]) -> None:
    """One decode step (one layer): each request reads its pages, in order, with these masses."""
    indptr, slots, rows = [0], [], []
    for masses in requests:
        for page in masses:
            slots.extend(range(page * PAGE, (page + 1) * PAGE))
        indptr.append(len(slots))
        rows.append(list(masses.values()))
    width = max(len(r) for r in rows)
    importance = torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)
    table.add_layer(importance, torch.tensor(indptr, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64))
    table.finish_step()


def obs(node, start: int, *pages: int) -> Observation:
    return Observation(node, start, torch.tensor(pages, dtype=torch.int64))


def test_ema_starts_at_zero_and_grows_with_attended_steps_toward_the_density():
    table, agg = new_table(), ImportanceAggregator(decay=0.9, sink_pages=0)
    a = node()
    history = []
    for _ in range(5):
        record_step(table, {3: 0.4, 4: 0.2})
        assert agg.fold(table, [obs(a, 0, 3, 4)]) == 1
        history.append(node_importance(a))
    # density 0.3 per page; after n steps the zero-started EMA is 0.3 * (1 - 0.9**n)
    assert history == pytest.approx([0.3 * (1 - 0.9**n) for n in range(1, 6)])
    assert node_state(a).steps == 5 and node_state(a).step == agg.clock == 5


def test_density_is_mass_per_page_without_the_sink_pages():
    table, agg = new_table(), ImportanceAggregator(decay=0.5, sink_pages=1)
    first, later = node(), node()
    # A sequence's first page (the sink) takes most of the mass.
    record_step(table, {1: 0.6, 2: 0.3, 3: 0.1, 5: 0.0})
    agg.fold(table, [obs(first, 0, 1, 2, 3), obs(later, 3 * PAGE, 5)])
    assert node_importance(first) == pytest.approx(0.5 * (0.3 + 0.1) / 2)
    assert not node_pinned(first) and not node_pinned(later)
    assert node_importance(later) == 0.0


def test_a_node_inside_the_sink_pages_is_pinned_and_nothing_after_it_is():
    table, agg = new_table(), ImportanceAggregator(decay=0.5, sink_pages=2)
    sink, straddling, after = node(), node(), node()
    record_step(table, {1: 0.5, 2: 0.2, 3: 0.2, 4: 0.1})
    agg.fold(table, [obs(sink, 0, 1), obs(straddling, PAGE, 2, 3), obs(after, 3 * PAGE, 4)])
    assert node_pinned(sink) and not node_pinned(straddling) and not node_pinned(after)
    # A pinned node keeps its own mass; the straddling one counts only its non-sink page.
    assert node_importance(sink) == pytest.approx(0.5 * 0.5)
    assert node_importance(straddling) == pytest.approx(0.5 * 0.2)


def test_a_page_shared_by_running_requests_gets_the_sum_of_their_attention():
    table, agg = new_table(), ImportanceAggregator(decay=0.5, sink_pages=0)
    shared, own_a, own_b = node(), node(), node()
    # Two requests with a common prefix page 6, each with a private page.
    record_step(table, {6: 0.4, 7: 0.6}, {6: 0.4, 8: 0.6})
    agg.fold(table, [obs(shared, 0, 6), obs(own_a, PAGE, 7), obs(own_b, PAGE, 8)])
    assert node_importance(shared) == pytest.approx(0.5 * 0.8)
    assert node_importance(own_a) == node_importance(own_b) == pytest.approx(0.5 * 0.6)


def test_a_node_reused_by_later_requests_keeps_accumulating():
    table, agg = new_table(), ImportanceAggregator(decay=0.9, sink_pages=0)
    document, one_off = node(), node()
    for _request in range(3):  # three requests over the document, four steps each
        for _ in range(4):
            record_step(table, {9: 0.5})
            agg.fold(table, [obs(document, 0, 9)])
    for _ in range(4):
        record_step(table, {10: 0.5})
        agg.fold(table, [obs(one_off, 0, 10)])
    assert node_importance(document) == pytest.approx(0.5 * (1 - 0.9**12))
    assert node_importance(document) > 2 * node_importance(one_off)


def test_steps_recorded_between_folds_count_as_that_many_steps():
    table, agg = new_table(sample_interval=2), ImportanceAggregator(decay=0.8, sink_pages=0)
    a = node()
    record_step(table, {3: 0.5})  # recorded
    assert agg.fold(table, [obs(a, 0, 3)]) == 1
    record_step(table, {3: 0.5})  # skipped by the sample interval
    assert agg.fold(table, [obs(a, 0, 3)]) == 0
    for _ in range(4):  # two more recorded, folded late at once
        record_step(table, {3: 0.5})
    assert agg.fold(table, [obs(a, 0, 3)]) == 2
    assert node_importance(a) == pytest.approx(0.5 * (1 - 0.8**3))


def test_a_fold_without_a_new_step_changes_no_node():
    table, agg = new_table(), ImportanceAggregator(decay=0.5, sink_pages=0)
    a = node()
    record_step(table, {3: 1.0})
    agg.fold(table, [obs(a, 0, 3)])
    before = node_importance(a)
    assert agg.fold(table, [obs(a, 0, 3)]) == 0
    assert node_importance(a) == before


def test_a_new_table_contributes_only_its_latest_step():
    table, agg = new_table(), ImportanceAggregator(decay=0.5, sink_pages=0)
    for _ in range(6):  # e.g. warm-up requests before the aggregator existed
        record_step(table, {3: 1.0})
    a = node()
    assert agg.fold(table, [obs(a, 0, 3)]) == 1
    assert node_importance(a) == pytest.approx(0.5)


def test_normalised_importance_is_relative_to_the_largest_recent_node():
    table, agg = new_table(), ImportanceAggregator(decay=0.5, sink_pages=0)
    hot, cold, never = node(), node(), node()
    assert agg.normalised(hot) == 0.0
    record_step(table, {3: 0.8, 4: 0.2})
    agg.fold(table, [obs(hot, 0, 3), obs(cold, PAGE, 4)])
    assert agg.normalised(hot) == 1.0
    assert agg.normalised(cold) == pytest.approx(0.25)
    assert agg.normalised(never) == 0.0


def test_a_split_gives_both_halves_the_density_and_moves_the_start():
    table, agg = new_table(), ImportanceAggregator(decay=0.5, sink_pages=1)
    whole = node()
    record_step(table, {1: 0.7, 2: 0.2, 3: 0.1})
    agg.fold(table, [obs(whole, 0, 1, 2, 3)])
    value = node_importance(whole)
    prefix = node()
    agg.split(prefix, whole, PAGE, PAGE)  # the prefix is the first (sink) page
    assert node_importance(prefix) == node_importance(whole) == value
    assert node_state(prefix).start == 0 and node_state(whole).start == PAGE
    assert node_pinned(prefix) and not node_pinned(whole)
    assert node_state(prefix).steps == node_state(whole).steps == 1


def test_splitting_a_never_attended_node_leaves_the_prefix_bare():
    agg = ImportanceAggregator()
    prefix, suffix = node(), node()
    agg.split(prefix, suffix, PAGE, PAGE)
    assert not has_importance(prefix) and node_importance(prefix) == 0.0
    assert peek_state(prefix) is None  # nothing allocated for a node never attended


@pytest.mark.parametrize("decay", [0, 1, 1.5, -0.1, "0.9", True, None])
def test_decay_outside_the_open_unit_interval_is_refused(decay):
    with pytest.raises(ValueError, match=r"decay=.* is invalid; allowed: a number in \(0, 1\)"):
        ImportanceAggregator(decay=decay)


@pytest.mark.parametrize("sink_pages", [-1, 65, 1.5, True])
def test_sink_pages_outside_the_range_is_refused(sink_pages):
    with pytest.raises(ValueError, match=r"sink_pages=.* is invalid; allowed: an integer in \[0, 64\]"):
        ImportanceAggregator(sink_pages=sink_pages)
