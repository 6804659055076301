"""A two-layer Llama with random weights and the embedded model's tokenizer, for servers whose
Triton kernels run under Triton's interpreter (slow: the model must be small). Its weights are
drawn large enough (init 0.3) that greedy tokens vary and depend on attention."""

from __future__ import annotations

import shutil
from pathlib import Path


def save_tiny_llama(model_path: str, out: Path) -> str:
    """Write the model into ``out`` (float32) beside ``model_path``'s tokenizer; returns its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,  # the embedded model's tokenizer
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        initializer_range=0.3,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_path) / name, out / name)
    return str(out)
