"""Model folders that can be made on any machine, for runs where real weights cannot travel.

Two kinds:

``tiny``   a 4-layer Llama with SmolLM2-135M's shapes whose float32 weights are generated
           from a seed, bit for bit the same on every machine (numpy's PCG64 bit stream
           and elementwise IEEE arithmetic only: no torch RNG, no BLAS, no libm). Its
           greedy choices are decisive (see ``tiny_weights``), so a CPU server's tokens
           are a reference a GPU server must reproduce (``scripts/compare_greedy.py``).
``dummy``  config and tokenizer only, for SGLang's ``--load-format dummy``: the full
           SmolLM2-135M shape, or Llama-3.1-8B's.

Usage::

    python scripts/make_models.py tiny --out DIR --tokenizer-from DIR [--seed 0] [--expect-sha HEX]
    python scripts/make_models.py dummy --shape smollm2|llama-8b --out DIR --tokenizer-from DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

MARKER = "made.json"
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Greedy by default (top_k 1: transformers and SGLang both read it so): a request that
# names no sampling parameters still gets a reproducible answer.
GREEDY_GENERATION = {"do_sample": True, "top_k": 1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
TINY_LAYERS = 4

# SmolLM2-135M-Instruct's config.json, as published (30 layers).
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.02,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    # transformers 5's form (SmolLM2's own config.json); SGLang's llama.py reads it too.
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 49152,
}

# Llama-3.1-8B's published architecture. max_position_embeddings is its 131072 and the
# rope its "llama3" scaling, which SGLang's llama.py hands to get_rope.
LLAMA_8B = {
    **SMOLLM2,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "pad_token_id": None,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_parameters": {
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
# llama-8b folders carry SmolLM2's tokenizer (49,152 ids) while the model's vocabulary
# has 128,256: generated ids can fall outside the tokenizer, so runs on this shape must
# send `input_ids` and/or start the server with --skip-tokenizer-init.
SHAPES = {"smollm2": SMOLLM2, "llama-8b": LLAMA_8B}


def tiny_config() -> dict:
    """SmolLM2-135M's config cut to TINY_LAYERS layers, stored as float32."""
    return {**SMOLLM2, "num_hidden_layers": TINY_LAYERS, "dtype": "float32"}


class _Uniform:
    """Uniform draws in [-1, 1) from one PCG64 stream, in a fixed call order.

    ``Generator.random(dtype=float32)`` is (24 random bits) * 2**-24, exact on every
    platform; the affine map below is elementwise float32 arithmetic, also exact, so the
    bytes never depend on the machine. Its std is 1/sqrt(3); callers scale by std * sqrt(3).
    """

    def __init__(self, seed: int):
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def __call__(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        u = self._rng.random(shape, dtype=np.float32)
        half_width = np.float32(std * 3.0**0.5)
        return (u * np.float32(2.0) - np.float32(1.0)) * half_width


# The tiny model's init. Random weights at the usual std 0.02 give near-uniform logits
# and near-ties, which float32 vs TF32 rounding can flip. Instead layer 0 is one sharp
# attention pattern that copies the attended token's embedding into the residual stream
# (all heads share one query and one key, so they agree on the position; o_proj is
# v_proj transposed, so the value path is close to a projection): the final state then
# points at one token's (tied) embedding and its logit stands far above the rest. The
# other layers stay random at the usual scale, so every weight still moves the logprobs.
EMBED_STD = 0.1  # logit scale: the top-1 margin grows with it
SCORE_STD = 30.0  # std of layer 0's attention scores: large is sharp (one position wins)
COPY_GAIN = 2.0  # how far the copied embedding outweighs the current token's
INIT_STD = 0.02


def tiny_weights(seed: int) -> dict[str, np.ndarray]:
    """The tiny model's tensors (float32, SGLang's Llama names), drawn in a fixed order."""
    c = tiny_config()
    hidden, head_dim, ffn = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q_heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    group = q_heads // kv_heads
    draw = _Uniform(seed)
    ones = np.ones(hidden, dtype=np.float32)

    weights = {"model.embed_tokens.weight": draw((c["vocab_size"], hidden), EMBED_STD)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        if layer == 0:
            # q.k over a unit-RMS input has std hidden * std_q * std_k: pick both to give SCORE_STD.
            qk_std = (SCORE_STD / hidden) ** 0.5
            query, key = draw((head_dim, hidden), qk_std), draw((head_dim, hidden), qk_std)
            value = draw((kv_heads * head_dim, hidden), hidden**-0.5)
            # q head h reads kv head h // group; each of a group's heads carries 1/group of the copy.
            out = np.concatenate(
                [value[(h // group) * head_dim : (h // group + 1) * head_dim].T for h in range(q_heads)], 1
            )
            weights[p + "self_attn.q_proj.weight"] = np.tile(query, (q_heads, 1))
            weights[p + "self_attn.k_proj.weight"] = np.tile(key, (kv_heads, 1))
            weights[p + "self_attn.v_proj.weight"] = value
            weights[p + "self_attn.o_proj.weight"] = np.ascontiguousarray(out * np.float32(COPY_GAIN / group))
        else:
            weights[p + "self_attn.q_proj.weight"] = draw((q_heads * head_dim, hidden), INIT_STD)
            weights[p + "self_attn.k_proj.weight"] = draw((kv_heads * head_dim, hidden), INIT_STD)
            weights[p + "self_attn.v_proj.weight"] = draw((kv_heads * head_dim, hidden), INIT_STD)
            weights[p + "self_attn.o_proj.weight"] = draw((hidden, q_heads * head_dim), INIT_STD)
        weights[p + "mlp.gate_proj.weight"] = draw((ffn, hidden), INIT_STD)
        weights[p + "mlp.up_proj.weight"] = draw((ffn, hidden), INIT_STD)
        weights[p + "mlp.down_proj.weight"] = draw((hidden, ffn), INIT_STD)
        weights[p + "input_layernorm.weight"] = ones.copy()
        weights[p + "post_attention_layernorm.weight"] = ones.copy()
    weights["model.norm.weight"] = ones.copy()
    return weights


def weights_sha256(weights: dict[str, np.ndarray]) -> str:
    """SHA-256 over (name, dtype, shape, little-endian bytes) of every tensor, in name order."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        t = np.ascontiguousarray(weights[name], dtype=np.dtype(weights[name].dtype).newbyteorder("<"))
        digest.update(f"{name}|{t.dtype.str}|{tuple(t.shape)}".encode())
        digest.update(t.tobytes())
    return digest.hexdigest()


def copy_tokenizer(source: Path, out: Path) -> None:
    """Copy the tokenizer files (and chat template) that ``source`` has into ``out``."""
    found = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in found:
        sys.exit(f"error: no tokenizer.json in {source}")
    for name in found:
        shutil.copyfile(source / name, out / name)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def make_tiny(out: Path, tokenizer_from: Path, seed: int = 0, expect_sha: str | None = None) -> str:
    """Write the tiny model to ``out``; its weights' SHA-256.

    Raises:
        SystemExit: ``expect_sha`` is given and the generated weights differ (nothing is written).
    """
    from safetensors.numpy import save_file

    weights = tiny_weights(seed)
    sha = weights_sha256(weights)
    if expect_sha is not None and sha != expect_sha.lower():
        sys.exit(f"error: tiny model (seed {seed}) has weights sha256 {sha}, expected {expect_sha}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})
    _write_json(out / "config.json", tiny_config())
    _write_json(out / "generation_config.json", GREEDY_GENERATION)
    copy_tokenizer(tokenizer_from, out)
    _write_json(out / MARKER, {"kind": "tiny", "seed": seed, "tensor_sha256": sha})
    return sha


def make_dummy(out: Path, shape: str, tokenizer_from: Path) -> None:
    """Write a config-and-tokenizer folder of ``shape`` for ``--load-format dummy``."""
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", SHAPES[shape])
    _write_json(out / "generation_config.json", GREEDY_GENERATION)
    copy_tokenizer(tokenizer_from, out)
    _write_json(out / MARKER, {"kind": "dummy", "shape": shape})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    tiny = sub.add_parser("tiny", help="a 4-layer Llama with seeded, machine-independent float32 weights")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--expect-sha", help="exit non-zero unless the weights' sha256 is this")
    dummy = sub.add_parser("dummy", help="config + tokenizer for --load-format dummy")
    dummy.add_argument("--shape", choices=sorted(SHAPES), required=True)
    for p in (tiny, dummy):
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--tokenizer-from", type=Path, required=True, help="a folder holding tokenizer.json")
    args = parser.parse_args(argv)
    if args.kind == "tiny":
        print(make_tiny(args.out, args.tokenizer_from, args.seed, args.expect_sha))
    else:
        make_dummy(args.out, args.shape, args.tokenizer_from)
        print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
