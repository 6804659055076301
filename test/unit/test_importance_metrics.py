"""The importance policy's Prometheus series: evictions by tier and the importance distribution."""

from __future__ import annotations

import types

import pytest
from prometheus_client import CollectorRegistry

from sgl_importance import metrics as m
from sgl_importance.metrics import ImportanceMetrics, Metrics
from support.fake_tree import FakeCache, FakeTreeCore

LABELS = {"cache_type": "UnifiedRadixCache", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
SERIES_LABELS = {k: str(v) for k, v in LABELS.items()}


def test_evictions_are_counted_per_tier_with_the_evicted_nodes_importance():
    registry = CollectorRegistry()
    series = ImportanceMetrics(LABELS, registry=registry)
    series.evicted("device", 48, 0.04)
    series.evicted("device", 16, 0.6)
    series.evicted("host", 32, 0.0)

    def sample(name, tier, **extra):
        return registry.get_sample_value(name, {**SERIES_LABELS, "tier": tier, **extra})

    assert sample("sgl_importance:evicted_tokens_total", "device") == 64
    assert sample("sgl_importance:evicted_tokens_total", "host") == 32
    assert sample("sgl_importance:evicted_node_importance_count", "device") == 2
    assert sample("sgl_importance:evicted_node_importance_bucket", "device", le="0.05") == 1
    assert sample("sgl_importance:evicted_node_importance_bucket", "host", le="0.0") == 1


def test_a_fold_counts_its_steps_sets_the_scale_and_records_each_nodes_importance():
    registry = CollectorRegistry()
    series = ImportanceMetrics(LABELS, registry=registry)
    series.folded(2, 0.25, [1.0, 0.1, 0.0])
    assert registry.get_sample_value("sgl_importance:folded_steps_total", SERIES_LABELS) == 2
    assert registry.get_sample_value("sgl_importance:importance_scale", SERIES_LABELS) == 0.25
    assert registry.get_sample_value("sgl_importance:attended_node_importance_count", SERIES_LABELS) == 3
    assert registry.get_sample_value("sgl_importance:attended_node_importance_sum", SERIES_LABELS) == pytest.approx(1.1)


def test_no_series_exist_while_sglangs_metrics_are_off(monkeypatch):
    metrics = Metrics()
    assert metrics.importance(FakeCache(FakeTreeCore())) is None  # metrics_collector None
    assert metrics._importance is None


def test_the_series_carry_the_labels_of_sglangs_collector(monkeypatch):
    # Built with a stand-in: the real series register once per process registry.
    monkeypatch.setattr(m, "ImportanceMetrics", lambda labels: types.SimpleNamespace(labels=labels))
    metrics = Metrics()  # the process's (the runtime owns one)
    cache = FakeCache(FakeTreeCore())
    cache.metrics_collector = types.SimpleNamespace(labels=LABELS)
    series = metrics.importance(cache)
    assert series.labels == LABELS
    assert metrics.importance(cache) is series  # one instance per process


def test_hot_set_counts_land_in_one_counter_per_field():
    from sgl_importance.hot_set import HotSetCounts
    from sgl_importance.metrics import HOT_SET_SERIES, HotSetMetrics

    registry = CollectorRegistry()
    series = HotSetMetrics({"tp_rank": 0}, registry=registry)
    step = HotSetCounts(steps=2, guard_flagged=1, late_arrivals=5, pages_attended=60, pages_dense=300)
    series.add(step.as_dict())
    series.add(step.as_dict())
    labels = {"tp_rank": "0"}
    assert set(HOT_SET_SERIES) == set(step.as_dict())  # every count has a series
    assert registry.get_sample_value("sgl_importance:hot_set_steps_total", labels) == 4
    assert registry.get_sample_value("sgl_importance:hot_set_guard_flagged_total", labels) == 2
    assert registry.get_sample_value("sgl_importance:hot_set_late_arrivals_total", labels) == 10
    assert registry.get_sample_value("sgl_importance:hot_set_pages_dense_total", labels) == 600
    assert registry.get_sample_value("sgl_importance:hot_set_promotions_total", labels) == 0
