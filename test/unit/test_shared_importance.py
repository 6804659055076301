"""Importance shared next to the pages in a storage tier every instance reads
(storage/shared_importance.py): its record format, its merge rule, and what the
tree's importance code does with it. No server; the store is a dict with the two
calls Mooncake's client offers for it."""

from __future__ import annotations

import logging
import socket
import types

import msgpack
import pytest

from sgl_importance.cache.admission import DEFERRED, admit_deferred
from sgl_importance.cache.stored import StoredImportance
from sgl_importance.node_state import node_state, peek_state
from sgl_importance.storage import shared_importance as si
from sgl_importance.storage.mooncake import check_master
from support.fake_tree import AdmissionCache

HOUR = 3600.0


class DictStore:
    """``get_batch`` / ``upsert_batch`` over a dict; ``down`` makes every call fail."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.down = False
        self.calls = 0

    def get_batch(self, keys):
        self.calls += 1
        if self.down:
            raise RuntimeError("master unreachable")
        return [self.data.get(k, b"") for k in keys]

    def upsert_batch(self, keys, values):
        self.calls += 1
        if self.down:
            raise RuntimeError("master unreachable")
        self.data.update(zip(keys, (bytes(v) for v in values)))
        return 0


def test_a_record_reads_back_as_written():
    rec = si.ImportanceRecord(0.25, 1000.5, {"a": 3, "b": 1})
    back = si.decode(si.encode(rec))
    assert back == rec and back.total_hits == 4


@pytest.mark.parametrize(
    "data",
    [
        None,
        b"",
        b"\x00\x01garbage",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 99, "i": 1.0, "t": 0.0, "h": {}}),
        msgpack.packb({"v": 1, "i": "high", "t": 0.0, "h": {}}),
        msgpack.packb({"v": 1, "i": float("nan"), "t": 0.0, "h": {}}),
        msgpack.packb({"v": 1, "i": -1.0, "t": 0.0, "h": {}}),
    ],
    ids=["none", "empty", "garbage", "not-a-map", "other-version", "text", "nan", "negative"],
)
def test_absent_foreign_or_damaged_records_are_ignored_not_raised(data):
    assert si.decode(data) is None


def test_merge_keeps_the_larger_decayed_importance_at_the_later_time():
    old_high = si.ImportanceRecord(0.8, 0.0, {})
    new_low = si.ImportanceRecord(0.3, 2 * HOUR, {})
    merged = si.merge(old_high, new_low, now=2 * HOUR, half_life_s=HOUR)
    # 0.8 two half-lives ago is 0.2 now: the fresh 0.3 wins.
    assert merged.importance == pytest.approx(0.3)
    assert merged.time == 2 * HOUR
    fresh_high = si.merge(si.ImportanceRecord(0.8, HOUR, {}), new_low, now=HOUR, half_life_s=HOUR)
    assert fresh_high.importance == pytest.approx(0.8)


def test_merge_counts_hits_once_per_writer_and_sums_over_writers():
    a = si.ImportanceRecord(0.1, 0.0, {"a": 2, "b": 1})
    b = si.ImportanceRecord(0.1, 0.0, {"b": 3, "c": 1})
    merged = si.merge(a, b, now=0.0)
    assert merged.hits == {"a": 2, "b": 3, "c": 1} and merged.total_hits == 6
    # Republishing the same counts changes nothing (no double counting).
    assert si.merge(merged, b, now=0.0).total_hits == 6


def test_merge_is_symmetric_and_keeps_the_busiest_writers_when_bounded():
    a = si.ImportanceRecord(0.4, 10.0, {f"w{i}": i for i in range(5)})
    b = si.ImportanceRecord(0.2, 20.0, {f"x{i}": 10 + i for i in range(5)})
    ab, ba = si.merge(a, b, 30.0, max_writers=4), si.merge(b, a, 30.0, max_writers=4)
    assert ab == ba
    assert set(ab.hits) == {"x1", "x2", "x3", "x4"}
    assert si.merge(None, b, 0.0) is b and si.merge(a, None, 0.0) is a


def test_decay_never_raises_importance_for_a_record_from_the_future():
    rec = si.ImportanceRecord(0.5, 100.0, {})
    assert rec.decayed(50.0) == 0.5
    assert rec.decayed(100.0 + si.HALF_LIFE_S) == pytest.approx(0.25)


def pair(store, clock=lambda: 0.0):
    a = si.SharedImportance("a", key_of=lambda h: "model_" + h, store=store, clock=clock)
    b = si.SharedImportance("b", key_of=lambda h: "model_" + h, store=store, clock=clock)
    return a, b


def test_what_one_instance_publishes_another_reads_next_to_the_pages():
    store = DictStore()
    a, b = pair(store)
    a.publish(["p1", "p2"], 0.6, hits=2)
    assert a.flush() == 2
    assert set(store.data) == {"model_p1@imp", "model_p2@imp"}
    assert b.fetch(["p1", "p2", "p3"]) == 2
    assert b.importance("p1") == pytest.approx(0.6) and b.importance("p3") is None
    assert b.other_hits(["p1", "p2"]) == 2 and a.other_hits(["p1"]) == 0


def test_hits_seen_by_two_instances_add_up_in_the_store():
    store = DictStore()
    a, b = pair(store)
    a.publish(["p"], 0.1, hits=2)
    a.flush()
    b.publish(["p"], 0.05, hits=3)
    b.flush()
    rec = si.decode(store.data["model_p@imp"])
    assert rec.hits == {"a": 2, "b": 3} and rec.importance == pytest.approx(0.1)


def test_publishing_costs_the_scheduler_no_store_call_until_the_flush():
    store = DictStore()
    a, _ = pair(store)
    for i in range(100):
        a.publish([f"p{i}"], 0.1, hits=1)
    assert store.calls == 0
    a.flush()
    # One batched read and one batched write, whatever the number of pages.
    assert store.calls == 2


def test_a_store_outage_is_logged_once_and_publishing_resumes_after_it(caplog):
    store = DictStore()
    a, _ = pair(store)
    store.down = True
    with caplog.at_level(logging.WARNING, logger=si.__name__):
        for _ in range(3):
            a.publish(["p"], 0.3, hits=1)
            assert a.flush() == 0
            assert a.fetch(["p"]) == 0
        store.down = False
        a.publish(["p"], 0.3, hits=1)
        assert a.flush() == 1
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and "reachable again" in caplog.records[-1].getMessage()


def node(hashes, importance=None, hits=0):
    n = types.SimpleNamespace(hash_value=hashes, hit_count=hits)
    if importance is not None:
        node_state(n).importance = importance
    return n


def test_a_node_rebuilt_from_pages_another_instance_computed_gets_their_importance():
    store = DictStore()
    writer, reader = pair(store)
    # The writer drops the node to storage: its StoredImportance publishes it.
    StoredImportance(shared=lambda: writer).remember(node(["p1", "p2"], 0.4, hits=1))
    writer.flush()
    # Another process: nothing remembered locally, the hit query read the records.
    reader.fetch(["p1", "p2"])
    rebuilt = node(["p1", "p2"])
    assert StoredImportance(shared=lambda: reader).recall(rebuilt) == pytest.approx(0.4)
    assert peek_state(rebuilt).importance == pytest.approx(0.4)


def test_the_local_memory_and_the_shared_record_combine_to_the_larger():
    store = DictStore()
    a, b = pair(store)
    a.publish(["p"], 0.9, hits=0)
    a.flush()
    b.fetch(["p"])
    stored = StoredImportance(shared=lambda: b)
    stored._by_hash["p"] = 0.2
    assert stored.page_value("p") == pytest.approx(0.9)


def test_hits_another_instance_saw_qualify_a_node_for_the_storage_tier():
    store = DictStore()
    a, b = pair(store)
    a.publish(["p"], 0.0, hits=2)
    a.flush()
    cache = AdmissionCache(shared=b, storage_min_hits=3)
    n = cache.add(hits=1, hashes=["p"])
    cache.write_backup_storage(n.id)
    # Deferred: this instance has seen one hit and has not read the record yet...
    assert cache.written == [] and peek_state(n).storage == DEFERRED
    # ...the flusher reads the records admission asked for, off the scheduler...
    b.flush()
    assert b.other_hits(["p"]) == 2
    # ...and the next fold that attends the node writes it: 1 here + 2 elsewhere.
    assert admit_deferred(cache, [n]) == 1 and cache.written == [n.id]


def test_hits_this_instance_published_itself_are_not_counted_twice():
    store = DictStore()
    a, _ = pair(store)
    a.publish(["p"], 0.0, hits=2)
    a.flush()
    a.fetch(["p"])
    assert a.other_hits(["p"]) == 0


def test_an_unset_master_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_CLIENT", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ValueError, match="MOONCAKE_MASTER is not set"):
        check_master(None)


def test_an_unreachable_master_is_refused_in_one_line_naming_it(monkeypatch):
    monkeypatch.delenv("MOONCAKE_CLIENT", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(ValueError) as err:
            check_master(f"127.0.0.1:{port}")
    message = str(err.value)
    assert f"127.0.0.1:{port}" in message and "unreachable" in message and "\n" not in message


def test_the_launcher_check_reads_the_master_from_the_extra_config_before_the_env(monkeypatch):
    import argparse

    from sgl_importance.storage.factory import check_cli_args

    monkeypatch.delenv("MOONCAKE_CLIENT", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:1")
    args = argparse.Namespace(
        hicache_storage_backend="mooncake",
        hicache_storage_backend_extra_config='{"master_server_address": "127.0.0.1:2"}',
    )
    with pytest.raises(ValueError, match=r"master 127\.0\.0\.1:2 .*unreachable"):
        check_cli_args(args)
    # Other backends check themselves.
    check_cli_args(argparse.Namespace(hicache_storage_backend="nixl", hicache_storage_backend_extra_config=None))
