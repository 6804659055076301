"""scripts/make_models.py and scripts/compare_greedy.py: seeded tiny weights that are the
same bytes everywhere, dummy-load folders with the published shapes, and the greedy
comparison against the committed CPU reference."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "benchmark" / "gpu" / "tiny_reference.json"

make_models = load_script("make_models")
compare_greedy = load_script("compare_greedy")


@pytest.fixture(scope="module")
def seed0_sha() -> str:
    return make_models.weights_sha256(make_models.tiny_weights(0))


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def test_the_same_seed_gives_the_same_weights_sha(seed0_sha):
    assert make_models.weights_sha256(make_models.tiny_weights(0)) == seed0_sha


def test_another_seed_gives_other_weights(seed0_sha):
    assert make_models.weights_sha256(make_models.tiny_weights(1)) != seed0_sha


def test_the_committed_reference_was_made_from_seed_0s_weights(seed0_sha):
    # Changing the init invalidates benchmark/gpu/tiny_reference.json: record it again.
    assert json.loads(REFERENCE.read_text())["model"]["tensor_sha256"] == seed0_sha


def test_tiny_tensors_have_the_llama_loader_names_and_the_config_shapes():
    c = make_models.tiny_config()
    hidden, head_dim, ffn = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    want = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        want |= {
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    weights = make_models.tiny_weights(0)
    assert {name: t.shape for name, t in weights.items()} == want
    assert all(t.dtype.name == "float32" for t in weights.values())
    assert c["num_hidden_layers"] == 4 and c["tie_word_embeddings"]  # lm_head is the embedding


def test_tiny_folder_round_trips_through_safetensors_with_its_marker(tmp_path, tokenizer_dir, seed0_sha):
    from safetensors.numpy import load_file

    out = tmp_path / "tiny"
    assert make_models.make_tiny(out, tokenizer_dir, seed=0) == seed0_sha
    assert make_models.weights_sha256(load_file(str(out / make_models.WEIGHTS))) == seed0_sha
    assert json.loads((out / make_models.MARKER).read_text())["tensor_sha256"] == seed0_sha
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_expect_sha_mismatch_exits_non_zero_naming_both_and_writes_nothing(tmp_path, tokenizer_dir, seed0_sha, capsys):
    out = tmp_path / "tiny"
    with pytest.raises(SystemExit) as stop:
        make_models.main(["tiny", "--out", str(out), "--tokenizer-from", str(tokenizer_dir), "--expect-sha", "ab" * 32])
    assert stop.value.code not in (0, None)
    assert seed0_sha in str(stop.value.code) and "ab" * 32 in str(stop.value.code)
    assert not out.exists()


def test_llama_8b_dummy_folder_has_llama_3_1_8b_published_shape(tmp_path, tokenizer_dir):
    out = tmp_path / "llama-8b"
    make_models.main(["dummy", "--shape", "llama-8b", "--out", str(out), "--tokenizer-from", str(tokenizer_dir)])
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (32, 4096, 14336)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (32, 8, 128)
    assert c["vocab_size"] == 128256 and not c["tie_word_embeddings"]
    assert c["rope_parameters"]["rope_theta"] == 500000.0 and c["rope_parameters"]["rope_type"] == "llama3"
    assert c["max_position_embeddings"] >= 32768 + 1024
    assert c["dtype"] == "bfloat16"
    assert not (out / make_models.WEIGHTS).exists()


def test_smollm2_dummy_folder_is_the_full_30_layer_config(tmp_path, tokenizer_dir):
    out = tmp_path / "smollm2"
    make_models.make_dummy(out, "smollm2", tokenizer_dir)
    c = json.loads((out / "config.json").read_text())
    assert c["num_hidden_layers"] == 30 and c["hidden_size"] == 576 and c["vocab_size"] == 49152


def _answer(ids: list[int], chosen: list[float]) -> dict:
    """A /generate response as SGLang shapes it with return_logprob and top_logprobs_num 2."""
    return {
        "meta_info": {
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(chosen, ids)],
            "output_top_logprobs": [[[lp, i, None], [lp - 5.0, i + 1, None]] for lp, i in zip(chosen, ids)],
        }
    }


def test_compare_reports_equal_ids_and_the_largest_logprob_difference(monkeypatch):
    reference = json.loads(REFERENCE.read_text())
    answers = iter(copy.deepcopy(reference["prompts"]))

    def server(url, body):
        entry = next(answers)
        assert body["input_ids"] == entry["input_ids"] and body["sampling_params"]["temperature"] == 0
        return _answer(entry["output_ids"], [lp + 1e-3 for lp in entry["chosen_logprobs"]])

    monkeypatch.setattr(compare_greedy, "post_generate", server)
    results = compare_greedy.compare(reference, "http://unused")
    assert all(r.equal and r.first_difference is None for r in results)
    assert all(r.max_logprob_diff == pytest.approx(1e-3, abs=1e-6) for r in results)


def test_compare_names_the_first_differing_token_and_measures_only_the_common_prefix(monkeypatch):
    reference = json.loads(REFERENCE.read_text())
    entry = reference["prompts"][0]
    ids, chosen = list(entry["output_ids"]), list(entry["chosen_logprobs"])
    ids[7] += 1
    chosen[9] -= 100.0  # after the difference: not counted
    monkeypatch.setattr(compare_greedy, "post_generate", lambda url, body: _answer(ids, chosen))
    result = compare_greedy.compare({**reference, "prompts": [entry]}, "http://unused")[0]
    assert not result.equal and result.first_difference == 7
    assert result.max_logprob_diff == 0.0


def test_recorded_reference_is_decisive():
    # The point of the tiny model's init: no near-tie a GPU's rounding could flip.
    found = compare_greedy.margins(json.loads(REFERENCE.read_text()))
    assert len(found) == 3 * 32 and min(found) > 1.0
