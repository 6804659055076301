"""Production-trace replay: reading Mooncake and Qwen-Bailian traces, slicing whole
conversations, scaling blocks to token ids, the offline page model, and the turnover clock."""

from __future__ import annotations

import json

import pytest

from benchmark.hit_rate import page_model
from benchmark.hit_rate.production_trace import (
    ScaledRequest,
    TraceRequest,
    block_tokens,
    load_slice,
    read_trace,
    sample,
    scale,
    write_mooncake,
)
from benchmark.hit_rate.trace_report import belady_share, offline_markdown
from sgl_importance.importance.priority import ImportancePolicyConfig, PriorityWeights, eviction_priority
from sgl_importance.importance.turnover import TurnoverClock
from sgl_importance.sim.policies import make_policy
from sgl_importance.sim.prefix import replay_prefix


def conversations(n: int, turns: int, blocks: int = 2) -> list[dict]:
    """``n`` conversations of ``turns`` turns after a shared block 0; turn t re-reads the
    history and adds ``blocks`` blocks (ids are prefix hashes: unique per position)."""
    rows, next_id = [], 1
    for c in range(n):
        history = [0]
        for t in range(turns):
            history = history + list(range(next_id, next_id + blocks))
            next_id += blocks
            rows.append(
                {"timestamp": 1000 * (c + 10 * t), "input_length": 512 * len(history) - 100,
                 "output_length": 7, "hash_ids": list(history)}
            )  # fmt: skip
    return sorted(rows, key=lambda r: r["timestamp"])


def test_a_mooncake_request_belongs_to_the_conversation_of_its_first_non_shared_block(tmp_path):
    path = tmp_path / "t.jsonl"
    write_mooncake(path, conversations(3, 2))
    requests, per_block = read_trace(path, shared_share=0.9)
    assert per_block == 512 and len(requests) == 6
    # Block 0 is in every request: shared; each conversation's first own block keys it.
    keys = {r.conversation for r in requests}
    assert len(keys) == 3
    assert all(r.conversation == r.blocks[1] for r in requests if len(r.blocks) == 3)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)


def test_a_qwen_bailian_turn_belongs_to_the_root_of_its_parent_chain(tmp_path):
    rows = [
        {"chat_id": 7, "parent_chat_id": -1, "turn": 1, "timestamp": 0.5, "input_length": 40,
         "output_length": 3, "hash_ids": [1, 2, 3]},
        {"chat_id": 9, "parent_chat_id": 7, "turn": 2, "timestamp": 2.0, "input_length": 70,
         "output_length": 3, "hash_ids": [1, 2, 3, 4, 5]},
        {"chat_id": 11, "parent_chat_id": 9, "turn": 3, "timestamp": 4.0, "input_length": 90,
         "output_length": 3, "hash_ids": [1, 2, 3, 4, 5, 6]},
        {"chat_id": 8, "parent_chat_id": -1, "turn": 1, "timestamp": 1.0, "input_length": 20,
         "output_length": 3, "hash_ids": [10, 11]},
    ]  # fmt: skip
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    requests, per_block = read_trace(path)
    assert per_block == 16
    assert [(r.arrival_s, r.conversation) for r in requests] == [(0.5, 7), (1.0, 8), (2.0, 7), (4.0, 7)]


def test_a_slice_keeps_or_drops_each_conversation_whole(tmp_path):
    path = tmp_path / "t.jsonl"
    write_mooncake(path, conversations(64, 3))
    requests, _ = read_trace(path, shared_share=0.5)
    kept = sample(requests, every=4, seed=1)
    turns = {}
    for r in kept:
        turns[r.conversation] = turns.get(r.conversation, 0) + 1
    assert set(turns.values()) == {3}
    assert 4 <= len(turns) <= 32
    # Another seed draws another slice; the same seed the same one.
    assert {r.conversation for r in sample(requests, 4, 2)} != set(turns)
    assert sample(requests, 4, 1) == kept


def test_blocks_scale_to_token_ids_sharing_exactly_the_traces_prefixes():
    a, b = block_tokens(5, 16), block_tokens(6, 16)
    assert a != b and a[:2] != b[:2] and len(a) == 16
    one = scale(TraceRequest(0.0, (0, 5, 9), 2 * 512 + 256, 3, 5), 512, 16)
    two = scale(TraceRequest(1.0, (0, 5, 7), 3 * 512, 3, 5), 512, 16)
    assert len(one.token_ids) == 16 + 16 + 8  # the last block in proportion
    assert one.full_blocks == (0, 5) and two.full_blocks == (0, 5, 7)
    assert one.token_ids[:32] == two.token_ids[:32] and one.token_ids[32:40] != two.token_ids[32:40]


def request(blocks: tuple[int, ...], partial: int) -> ScaledRequest:
    ids = tuple(t for b in blocks for t in block_tokens(b, 16)) + tuple(block_tokens(999, partial))
    return ScaledRequest(0.0, 0, ids, blocks)


def test_the_page_model_hits_and_evicts_what_sglang_would():
    # 1: pages 1, 2 + 14 tokens + 3 kept generated ones fill a third page of its own;
    # 2: re-reads pages 1-2 and adds page 3; 3: a prompt of exactly pages 1-2 hits one
    # page (SGLang computes at least one token); 4: re-reads 1-2 and adds page 4.
    slice_ = [request((1, 2), 14), request((1, 2, 3), 4), request((1, 2), 0), request((1, 2, 4), 4)]
    model = page_model.build(slice_, new_tokens=4)
    # Radix nodes: pages 1-2 (no path parts or ends between them), request 1's own page, 3, 4.
    assert model.data.node_tokens.tolist() == [32, 16, 16, 16]
    assert page_model.ideal(model).tolist() == [0, 32, 16, 32]
    # An 80-token pool: request 2 needs its 20 uncached prompt tokens plus a page (36) on
    # top of the 48 cached, so request 1's own page goes; request 4 then evicts page 3.
    evicted: list[int] = []
    _, hits = replay_prefix(model.data, make_policy("lru"), 80, evictions=evicted)
    assert evicted == [1, 2]
    assert page_model.cached_tokens(model, "lru", 80).tolist() == [0, 32, 16, 32]


def test_offline_rows_report_the_share_of_beladys_gain_taken(tmp_path):
    path = tmp_path / "t.jsonl"
    write_mooncake(path, conversations(20, 3, blocks=3))
    model = page_model.build(load_slice(path, every=1, seed=0), new_tokens=4)
    row = {"slice": "conversation test", "pool": 256, "requests": model.n_requests, "ideal": 0, "prompt_tokens": 0}
    for p in ("lru", "sglang_slru", "lfu", "reread_oracle", "belady"):
        row[p] = int(page_model.cached_tokens(model, p, 256).sum())
    # Knowing which pages come back beats recency; knowing when beats that.
    assert row["lru"] < row["reread_oracle"] < row["belady"]
    assert belady_share(row["belady"], row["lru"], row["belady"]) == 1.0
    assert "`reread_oracle` | 0K" in offline_markdown([row])


def test_the_turnover_clock_maps_access_ticks_to_tokens_inserted_since():
    clock = TurnoverClock(capacity=2)
    clock.pool_tokens = 100.0
    for tick, tokens in [(1, 10), (4, 20), (9, 30), (12, 40), (20, 50)]:
        clock.record(tick, tokens)
    assert clock.total == 150
    assert clock.inserted_at(12) == 100 and clock.inserted_at(13) == 100 and clock.pools_since(12) == 0.5
    # Entries past twice the capacity are dropped: an older tick reads the newest dropped count.
    assert clock.inserted_at(2) == 60 and clock.inserted_at(0) == 60
    clock.record(20, 5)  # the same tick again: one entry
    assert clock.inserted_at(20) == 155


def credit_priority(config: dict, pools: float, reuses: int, importance: float = 0.0) -> tuple:
    weights = PriorityWeights.of(ImportancePolicyConfig.from_mapping(config))
    return eviction_priority(weights, importance, False, 5.0, reuses, 9.0, 1.0, pools)


def test_the_credit_form_ranks_by_turnover_age_less_its_credits():
    config = {"form": "credit", "reuse_credit": 1.0, "importance_credit": 0.4}
    # Re-read once: half a pool younger; older than that, it goes first.
    assert credit_priority(config, 0.6, 1) > credit_priority(config, 0.2, 0)
    assert credit_priority(config, 0.8, 1) < credit_priority(config, 0.2, 0)
    # Importance 0.5 of the scale: 0.2 pools younger.
    assert credit_priority(config, 0.5, 0, importance=0.5) == pytest.approx(credit_priority(config, 0.3, 0))


@pytest.mark.parametrize(
    "config, named",
    [({"form": "lfu"}, "form='lfu'"), ({"reuse_credit": -1}, "reuse_credit=-1"), ({"importance_credit": "x"}, "x")],
)
def test_a_bad_credit_key_fails_naming_it(config, named):
    with pytest.raises(ValueError, match=named):
        ImportancePolicyConfig.from_mapping(config)
