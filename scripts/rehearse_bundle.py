"""Rehearse the GPU run's install on this machine: serve from the bundle and nothing else.

Builds the bundle for this Python (default /tmp/bundle311), installs it with its own
install.sh into a clean folder, and links beside it exactly the distributions the GPU
image provides (taken from the development venv; transformers at the image's 5.17.0,
downloaded once). The server then runs under ``python -S`` with only those two folders
on its path: a module the bundle forgot fails here as it would on the GPU machine.

    .venv/bin/python scripts/rehearse_bundle.py             # 5-8 min on 2 shared cores; prints PASS/FAIL
    .venv/bin/python scripts/rehearse_bundle.py --reuse     # keep an existing bundle

Three servers, each answering /generate and a chat completion on torch_cpu: SmolLM2 dense;
SmolLM2 with the importance eviction policy, the HiCache host and file tiers and the hot
set at 20 % (plus /metrics' sgl_importance series and SGLang's load generator); and the
bundle's tokenizer folder with dummy weights, as the GPU run starts it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bundle_gpu  # noqa: E402  (a sibling script, not a package)

from sgl_importance.local_server import LocalServer  # noqa: E402

IMAGE_TRANSFORMERS = "5.17.0"  # the GPU image's; SGLang pins 5.19.0
SERVED = "SmolLM2-135M-Instruct"
IMPORTANCE_FLAGS = [
    "--page-size", "16", "--attention-backend", "importance_torch", "--enable-hierarchical-cache",
    "--hicache-storage-backend", "file", "--radix-eviction-policy", "importance", "--hot-set-policy", "importance",
    "--hot-set-budget", "0.2", "--enable-metrics", "--enable-cache-report",
]  # fmt: skip


def link_image(image: Path, cache: Path) -> None:
    """``image``: a symlink to every top-level file or folder of each distribution the GPU
    image provides and the dev venv has, transformers replaced by the image's version."""
    image.mkdir(parents=True)
    linked: set[str] = set()
    for dist in md.distributions():
        name = bundle_gpu.canonical(dist.metadata["Name"])
        if name not in bundle_gpu.GPU_IMAGE or name == "transformers":
            continue
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "bin") or top in linked or top.endswith(".pth"):
                continue
            source = Path(dist.locate_file(top))
            if source.exists():
                (image / top).symlink_to(source)
                linked.add(top)
    if not (cache / "transformers").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(cache)]
        subprocess.run([*pip, f"transformers=={IMAGE_TRANSFORMERS}"], check=True)
    for entry in cache.iterdir():
        if entry.name.startswith("transformers"):
            (image / entry.name).symlink_to(entry)


def isolated_env(site: Path, image: Path, workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PYTHONPATH=f"{site}{os.pathsep}{image}",
        PYTHONNOUSERSITE="1",
        SGLANG_PLATFORM="torch_cpu",
        OMP_NUM_THREADS="1",
        SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(workdir / "hicache"),
        HOME=str(workdir),  # no user caches of this machine
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


# -S: no site-packages (the dev venv's); SGLang passes the flag on to its children.
PYTHON = [sys.executable, "-S"]

# What the servers will import, and the entry points SGLang will find the plugin by.
_PROBE = """import sys, sglang, transformers, sgl_importance
from importlib.metadata import entry_points
leaked = sorted({m.__file__ for m in list(sys.modules.values())
                 if getattr(m, '__file__', None) and sys.argv[1] in m.__file__})
eps = [f"{e.group}:{e.name}" for g in ("sglang.srt.plugins", "sglang.srt.platforms") for e in entry_points(group=g)]
print(transformers.__version__, sglang.__file__, sgl_importance.__file__, len(leaked), ",".join(eps), *leaked[:3])
"""


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok


def serve(label: str, model: Path, flags: list[str], env: dict[str, str], workdir: Path, checks: Checks) -> None:
    log_path = workdir / f"{label}.log"
    server = LocalServer(
        str(model), ["--dtype", "float32", *flags], log_path, env, platform=None, served_name=SERVED,
        python=PYTHON, inherit_env=False, cwd=workdir,
    )  # fmt: skip
    url, port = server.url, server.port
    try:
        try:
            server.wait_ready(300)
            healthy = True
        except (RuntimeError, TimeoutError):
            healthy = False
        if not checks.check(f"{label}: server healthy", healthy, f"log {log_path}"):
            print(log_path.read_text()[-3000:])
            return
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        text = requests.post(url + "/generate", json=body, timeout=120).json().get("text", "")
        real = "dummy" not in flags
        checks.check(f"{label}: /generate", bool(text) and ("Paris" in text or not real), repr(text))
        chat = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        reply = requests.post(url + "/v1/chat/completions", json=chat, timeout=120).json()
        content = (reply.get("choices") or [{}])[0].get("message", {}).get("content")
        checks.check(f"{label}: /v1/chat/completions", bool(content), repr(content))
        if "--enable-metrics" in flags:
            # The plugin logs at start-up only what its features do (the dense server's
            # proof is that torch_cpu, the plugin's platform, served at all).
            checks.check(f"{label}: plugin's log lines", "sgl-importance:" in log_path.read_text())
            metrics = requests.get(url + "/metrics", timeout=30).text
            series = sorted({line.split("{")[0].split(" ")[0] for line in metrics.splitlines()
                             if line.startswith("sgl_importance:")})  # fmt: skip
            checks.check(f"{label}: /metrics sgl_importance series", bool(series), f"{len(series)} series")
            bench = [
                *PYTHON, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", "127.0.0.1",
                "--port", str(port), "--model", str(model), "--served-model-name", SERVED, "--tokenizer", str(model),
                "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2",
                "--gsp-system-prompt-len", "32", "--gsp-question-len", "8", "--gsp-output-len", "4",
                "--warmup-requests", "0", "--disable-tqdm", "--output-file", str(workdir / "bench.jsonl"),
            ]  # fmt: skip
            run = subprocess.run(bench, env=env, cwd=workdir, capture_output=True, text=True)
            checks.check(
                f"{label}: sglang.benchmark.serving", run.returncode == 0 and "Successful requests" in run.stdout
            )
            if run.returncode:
                print(run.stderr[-2000:])
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    parser.add_argument("--bundle", type=Path, default=Path(f"/tmp/bundle{version.replace('.', '')}"))
    parser.add_argument("--reuse", action="store_true", help="use an existing --bundle as it is")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "rehearse-bundle")
    args = parser.parse_args()
    if not (args.reuse and (args.bundle / "MANIFEST.json").is_file()):
        bundle_gpu.build(args.bundle, version)
    workdir = args.workdir
    shutil.rmtree(workdir, ignore_errors=True)
    site, image = workdir / "site", workdir / "image"
    workdir.mkdir(parents=True)
    # The bundle's own installer, as the GPU run calls it (its python3: this Python).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    subprocess.run(["sh", str(args.bundle / "install.sh"), str(site)], check=True, env={**os.environ, "PATH": path})
    link_image(image, Path(tempfile.gettempdir()) / f"rehearse-transformers-{IMAGE_TRANSFORMERS}")
    env = isolated_env(site, image, workdir)
    checks = Checks()
    venv_site = str(Path(md.distribution("sglang").locate_file("")))
    probe = subprocess.run([*PYTHON, "-c", _PROBE, venv_site], env=env, capture_output=True, text=True, cwd=workdir)
    print(probe.stdout.strip() or probe.stderr[-2000:])
    fields = probe.stdout.split()
    checks.check(
        "isolated: transformers 5.17.0, sglang and the plugin (entry points) from the bundle, nothing from the venv",
        len(fields) >= 5 and fields[0] == IMAGE_TRANSFORMERS and all(str(site) in f for f in fields[1:3])
        and fields[3] == "0" and "sglang.srt.plugins:importance" in fields[4]
        and "sglang.srt.platforms:torch_cpu" in fields[4],
    )  # fmt: skip
    model = bundle_gpu.MODEL_DIR
    serve("dense", model, [], env, workdir, checks)
    serve("importance+hicache+hot-set", model, IMPORTANCE_FLAGS, env, workdir, checks)
    serve(
        "bundle tokenizer, dummy weights", args.bundle / "tokenizer", ["--load-format", "dummy"], env, workdir, checks
    )
    print("PASS" if not checks.failed else f"FAIL ({len(checks.failed)}: {', '.join(checks.failed)})")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
