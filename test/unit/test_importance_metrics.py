"""The importance policy's Prometheus series: evictions by tier and the importance distribution."""

from __future__ import annotations

import types

import pytest
from prometheus_client import CollectorRegistry

from sgl_importance import metrics as m
from sgl_importance.metrics import ImportanceMetrics, importance_metrics

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
    monkeypatch.setattr(m, "_instance", None)
    assert importance_metrics(types.SimpleNamespace(metrics_collector=None)) is None
    assert importance_metrics(types.SimpleNamespace()) is None
    assert m._instance is None
