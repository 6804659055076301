"""Invalid configuration stops `python -m sglang.launch_server` with a clear message."""

from __future__ import annotations

import json

import pytest

from support.server import launch_and_fail

pytestmark = pytest.mark.e2e


def test_unknown_value_of_a_plugin_choice_flag_names_the_flag(model_path):
    out = launch_and_fail(model_path, "--importance-reduce", "median")
    assert "--importance-reduce" in out and "median" in out


def test_out_of_range_plugin_value_names_the_flag_and_the_range(model_path):
    out = launch_and_fail(model_path, "--importance-sample-interval", "0")
    assert "--importance-sample-interval 0 is invalid" in out
    assert "[1, 1000000]" in out


def test_host_layout_that_torch_cpu_cannot_serve_is_refused(model_path):
    out = launch_and_fail(model_path, "--enable-hierarchical-cache", "--hicache-mem-layout", "page_head")
    assert "--hicache-mem-layout 'page_head' is not supported on the torch_cpu and torch_cuda platforms" in out


# DeepSeek-V2's attention in miniature: multi-head latent attention (a compressed KV pool).
MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "q_lora_rank": None,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "vocab_size": 1000,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 2048,
}


def test_importance_torch_named_for_a_model_it_cannot_read_is_refused_with_the_reason(tmp_path):
    # Refused from the model's configuration, before any weight (this folder has none).
    (tmp_path / "config.json").write_text(json.dumps(MLA_CONFIG))
    out = launch_and_fail(str(tmp_path), "--attention-backend", "importance_torch")
    assert "--attention-backend importance_torch cannot serve" in out and "its attention is MLA" in out
