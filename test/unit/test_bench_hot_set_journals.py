"""benchmark/long_context/bench_hot_set.py: journals of separate grids merge into one report."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_hot_set", REPO / "benchmark" / "long_context" / "bench_hot_set.py")
bench_hot_set = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_hot_set)


def _row(trial: int, config: str, text: str) -> dict:
    return {"task": "kv", "length": 2048, "trial": trial, "config": config, "text": text, "correct": True}


def _journal(folder: Path, name: str, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_shared_dense_rows_are_kept_once_and_every_configuration_survives(tmp_path, capsys):
    a = _journal(tmp_path / "a", "trials-0.jsonl", [_row(0, "dense", " 1."), _row(0, "lru 0.2 no guard", " 2.")])
    _journal(a, "trials-1.jsonl", [_row(1, "dense", " 3.")])
    b = _journal(tmp_path / "b", "trials.jsonl", [_row(0, "dense", " 1."), _row(0, "lru 0.1 no guard", " 4.")])
    rows = bench_hot_set.read_journals(a, b)
    keys = sorted((r["trial"], r["config"]) for r in rows)
    assert keys == [(0, "dense"), (0, "lru 0.1 no guard"), (0, "lru 0.2 no guard"), (1, "dense")]
    assert "warning" not in capsys.readouterr().err


def test_a_repeated_row_that_answered_differently_is_counted_and_the_first_kept(tmp_path, capsys):
    a = _journal(tmp_path / "a", "trials.jsonl", [_row(0, "dense", " 1.")])
    b = _journal(tmp_path / "b", "trials.jsonl", [_row(0, "dense", " 1?")])
    rows = bench_hot_set.read_journals(a, b)
    assert [r["text"] for r in rows] == [" 1."]
    assert "1 repeated rows answered differently" in capsys.readouterr().err


def test_chat_trials_frame_the_question_in_the_template_without_an_answer_prefix(model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    head, tail = bench_hot_set.chat_frame(tokenizer)
    for task, pairs in (("needle-chat", 1), ("kv-chat", 4)):
        trials = bench_hot_set.make_trials(tokenizer, task, [1024], 3, seed=0)
        for t in trials:
            assert len(t["ids"]) == 1024
            assert t["ids"][: len(head)] == head and t["ids"][-len(tail) :] == tail
            text = tokenizer.decode(t["ids"])
            assert text.rstrip().endswith("assistant")
            question = text.rsplit("\n\nWhat is", 1)[1].split("<|im_end|>")[0]
            assert question.endswith(("?", "Answer with the number."))  # nothing primes the answer
            assert t["answer"] in text and text.count("The magic number for") == (pairs if task == "kv-chat" else 0)
    plain = bench_hot_set.make_trials(tokenizer, "kv", [1024], 1, seed=0)[0]
    assert tokenizer.decode(plain["ids"]).endswith(" is")


def test_guard_variants_are_named_apart_and_lost_trials_are_dense_hits_a_configuration_missed():
    variants = bench_hot_set.parse_variants("read_cap=0.5;top_p=0.99,budget=0.3")
    assert variants == [{"read_cap": 0.5}, {"top_p": 0.99, "budget": 0.3}]
    base = {"policy": "importance", "budget": 0.2, "guard_threshold": bench_hot_set.GUARD_DEFAULT}
    names = [bench_hot_set.config_key(c) for c in [base] + [bench_hot_set.variant_config(base, v) for v in variants]]
    assert names == [
        "importance 0.2 guard",
        "importance 0.2 guard read_cap=0.5",
        "importance 0.2 guard top_p=0.99,budget=0.3",
    ]
    for bad in ("cap=0.5", "read_cap", "read_cap=x"):
        with pytest.raises(ValueError):
            bench_hot_set.parse_variants(bad)
    rows = [
        {**_row(0, "dense", "a"), "correct": True},
        {**_row(0, names[0], "b"), "correct": False},  # lost
        {**_row(1, "dense", "a"), "correct": False},
        {**_row(1, names[0], "b"), "correct": False},  # dense missed it too
        {**_row(2, "dense", "a"), "correct": True},
        {**_row(2, names[0], "a"), "correct": True},  # kept
    ]
    assert bench_hot_set.lost_trials(rows, names[0]) == {("kv", 2048, 0)}


def test_a_lost_answer_is_placed_where_it_left_dense_with_dense_margin_there():
    tops = [[[-0.1, 5], [-3.0, 6]], [[-0.75, 7], [-1.07, 8]], [[-0.02, 9], [-5.2, 4]]]
    dense = {**_row(0, "dense", "579"), "output_ids": [5, 7, 9], "tops": tops}
    near = {**_row(0, "hot", "58"), "correct": False, "output_ids": [5, 8, 1]}  # dense's second at token 1
    wide = {**_row(0, "hot wide", "574"), "correct": False, "output_ids": [5, 7, 4]}
    kept = {**_row(0, "hot kept", "579"), "output_ids": [5, 7, 9]}
    old = {**_row(0, "hot old", "5"), "correct": False}  # a journal from before output ids
    lines = bench_hot_set.lost_margins([dense, near, wide, kept, old])
    assert len(lines) == 2
    assert "hot: leaves dense at its token 1" in lines[0] and "0.32 nats (near tie)" in lines[0]
    assert "hot wide: leaves dense at its token 2" in lines[1] and "5.18 nats (wide margin)" in lines[1]
