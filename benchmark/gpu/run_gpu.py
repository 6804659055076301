"""The GPU run: one prepared script for a lent H100/H200, rehearsed on the CPU first.

Stages, each under its own time limit, each recorded in ``results.json`` whether it
passed or not (a failing stage never stops the ones after it):

1. ``env`` — Python, torch, CUDA, Triton, transformers, SGLang, the device.
2. ``kernels`` — ``test/kernels`` compiled (``TRITON_INTERPRET=0``): every dtype, page
   size and head layout the CPU runs under the interpreter, plus the long (32K, 128K)
   Llama-8B-head cases that only run on a GPU. They run in the background beside
   ``serve`` (correctness only) and are waited for before ``speed`` is timed.
3. ``serve`` — the server on the platform with the plugin, on the small seeded
   checkpoint (``scripts/make_models.py tiny``, the same weights as on the CPU):
   ``dense`` (greedy output compared with the CPU server's, ``benchmark/gpu/tiny_reference.json``,
   and a chat completion) and ``hot-set`` (``--radix-eviction-policy importance`` with the
   HiCache host tier and the hot set at 20 %: a long prompt sent twice, the second a prefix
   hit; the plugin's series read from ``/metrics``).
4. ``speed`` — ``benchmark/long_context/bench_speed.py`` on a Llama-3.1-8B-shaped model
   with dummy weights: SGLang's own ``triton`` backend (the peer), ``importance_triton``
   dense, the hot set at 20 % with the guard off and on; 8K and 32K, batch 1 and 8.
5. ``kbench`` — with the time left: ``benchmark/kernel/bench_decode.py`` (importance on
   vs off, SGLang's Triton decode kernel as the peer) and ``bench_page_list.py``.
6. ``memory`` — GPU.md item 4: dense and the hot set at 20 % (host tier) serving
   ``--memory-requests`` x ``--memory-length`` tokens at once (Llama-3.1-8B shape, dummy
   weights): the card's peak memory in use beside what SGLang sized, the plugin's pools.

Everything lands in ``--out``: ``results.json``, ``summary.md`` (also printed last) and
``logs.tar.gz`` (every server log and each stage's output).

    bash benchmark/gpu/run.sh                       # on the GPU machine ($OUT set)
    python -m benchmark.gpu.run_gpu --rehearse --out /tmp/gpu-rehearse   # this CPU, small shapes
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "benchmark" / "gpu" / "tiny_reference.json"
MAKE_MODELS = ROOT / "scripts" / "make_models.py"
COMPARE = ROOT / "scripts" / "compare_greedy.py"
# The reference's server flags (tiny_reference.json: torch_cpu's defaults otherwise); SGLang's
# dtype "auto" would serve the float32 checkpoint as float16.
# A bounded pool: on a GPU SGLang would size it from memory (0.91 of an H200: ~100 GB of
# KV for this model), and a host tier at --hicache-ratio 2 of that was refused (206 GB asked,
# 120 GB free on the H200's machine, 2026-11-26).
TINY_ARGS = ["--dtype", "float32", "--max-total-tokens", "65536"]
STAGES = ("env", "kernels", "serve", "speed", "kbench", "memory")
# Decode CUDA graphs on torch_cuda (prefill graphs stay off there); a small captured range
# keeps the capture short.
DECODE_GRAPHS = ["--cuda-graph-backend-decode", "full", "--cuda-graph-max-bs-decode", "8"]
# The hot set's captured step (--hot-set-graph-rows): as many rows as the graphs' largest batch.
HOT_SET_GRAPHS = ["--hot-set-graph-rows", "8"]
# The host's work between hot-set steps beside the next replay (speed mode "ahead").
PLAN_AHEAD = ["--hot-set-plan-ahead", "on"]
GRAPH_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?(?:cuda|cpu) graph: (True|False)")


class Run:
    """The run's output folder, its results and its clock."""

    def __init__(self, out: Path, rehearse: bool, budget_s: float) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        # Outside --out: the device tool brings back at most 8 files; the logs travel as one tarball.
        self.logs = Path(tempfile.mkdtemp(prefix="gpu-run-logs-"))
        self.rehearse = rehearse
        self.platform = "torch_cpu" if rehearse else "torch_cuda"
        self.backend = "importance_torch" if rehearse else "importance_triton"
        self.results: dict[str, Any] = {"platform": self.platform, "stages": {}}
        self.start = time.time()
        self.deadline = self.start + budget_s

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))

    def pack_logs(self) -> None:
        """The logs so far as ``logs.tar.gz``: after every stage, so a run the device tool kills
        still brings back the logs of the stages it finished (2026-11-28: one came back empty)."""
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")

    def stage(self, name: str, fn: Callable[["Run"], dict], need_s: float) -> None:
        """Run one stage; its result (or its error) goes into results.json at once."""
        if self.left() < need_s:
            self.results["stages"][name] = {"status": "skipped", "why": f"{self.left():.0f}s left < {need_s:.0f}s"}
            self.save()
            return
        t0 = time.time()
        print(f"=== {name} ({self.left():.0f}s left)", flush=True)
        try:
            result = {"status": "ok", **fn(self)}
        except Exception as e:  # recorded; the next stage still runs
            result = {"status": "error", "error": f"{type(e).__name__}: {e}"[-3000:]}
        result["seconds"] = round(time.time() - t0, 1)
        self.results["stages"][name] = result
        self.save()
        self.pack_logs()
        print(f"=== {name}: {result['status']} in {result['seconds']}s", flush=True)

    def sh(self, cmd: list[str], log: str, timeout: float, env: Optional[dict] = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` with its output in ``logs/<log>``; the completed process (output kept)."""
        full_env = dict(os.environ, **(env or {}))
        try:
            proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=max(timeout, 1))
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            (self.logs / log).write_text(f"$ {shlex.join(cmd)}\n{out}\nTIMEOUT after {timeout:.0f}s\n")
            raise TimeoutError(f"{shlex.join(cmd[:4])}... ran past {timeout:.0f}s (logs/{log})") from None
        (self.logs / log).write_text(f"$ {shlex.join(cmd)}\n{proc.stdout}\n--- stderr\n{proc.stderr}\n")
        return proc


# ------------------------------------------------------------------ stages


def stage_env(run: Run) -> dict:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    info["cuda"] = torch.version.cuda
    for name in ("triton", "transformers", "sglang", "sgl_importance", "sgl_kernel_ext"):
        try:
            from importlib.metadata import version

            dist = {"sgl_importance": "sglang-importance", "sgl_kernel_ext": "sgl-kernel-ext"}.get(name, name)
            info[name] = version(dist)
        except Exception as e:
            info[name] = f"missing ({e})"
    try:
        import sgl_kernel

        shim = getattr(sgl_kernel, "IS_SGL_IMPORTANCE_SHIM", False)
        info["sgl_kernel"] = f"shim ({sgl_kernel.__file__})" if shim else "real"
    except ImportError:
        info["sgl_kernel"] = "not importable"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sm_count"] = props.multi_processor_count
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm", "--format=csv"],
                             capture_output=True, text=True)  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip()
    else:
        info["device"] = f"cpu ({os.cpu_count()} cores)"
    return info


def start_kernels(run: Run, select: Optional[str]) -> tuple[subprocess.Popen, Path, float]:
    """``test/kernels`` compiled, in the background (it overlaps the serving stage: both
    check correctness, neither is timed); the process, its log and when it started."""
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "test" / "kernels"), "-q", "-p", "no:cacheprovider",
           "-n", "2" if run.rehearse else "8", "--timeout", "300", "-o", "addopts=--import-mode=importlib"]  # fmt: skip
    if run.rehearse:
        select = select or "long_context or importance_off"  # the GPU's long cases skip here
    if select:
        cmd += ["-k", select]
    log = run.logs / "kernels.log"
    env = dict(os.environ, TRITON_INTERPRET="1" if run.rehearse else "0")
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, log, time.time()


def finish_kernels(run: Run, started: tuple[subprocess.Popen, Path, float], timeout: float) -> dict:
    """Wait for the kernel tests; the pytest summary line and the failures' names."""
    proc, log, t0 = started
    try:
        proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    lines = log.read_text(errors="replace").strip().splitlines()
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line), "")
    failed = [line.split(" ")[1] for line in lines if line.startswith("FAILED ")]
    return {
        "summary": summary or f"no summary (killed after {time.time() - t0:.0f}s?)",
        "failed": failed,
        "returncode": proc.returncode,
        "seconds_total": round(time.time() - t0, 1),
        "progress": lines[1][:300] if len(lines) > 1 else "",
    }


def make_tiny(run: Run) -> str:
    reference = json.loads(REFERENCE.read_text())
    folder = Path("/tmp/sgl-importance-tiny")
    cmd = [sys.executable, str(MAKE_MODELS), "tiny", "--out", str(folder), "--tokenizer-from", tokenizer_dir(),
           "--expect-sha", reference["model"]["tensor_sha256"]]  # fmt: skip
    proc = run.sh(cmd, "make_tiny.log", timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"tiny model: {proc.stderr.strip()[-500:] or proc.stdout.strip()[-500:]}")
    return str(folder)


def tokenizer_dir() -> str:
    """SmolLM2's tokenizer files: from the bundle on the GPU, the prepared model here."""
    bundled = ROOT / "bundle" / "tokenizer"
    if bundled.is_dir():
        return str(bundled)
    from sgl_importance.local_server import model_path

    return model_path()


def graph_flags(run: Run) -> list[str]:
    return [] if run.rehearse else DECODE_GRAPHS


def graph_steps(log: str) -> dict:
    """Decode log lines by whether the step replayed a CUDA graph: {"True": n, "False": m}."""
    counts = {"True": 0, "False": 0}
    for m in GRAPH_LINE.finditer(log):
        counts[m.group(2)] += 1
    return counts


def serve_dense(run: Run, model: str) -> dict:
    from sgl_importance.client import chat
    from sgl_importance.local_server import LocalServer, start_with_retry

    args = [*TINY_ARGS, "--attention-backend", run.backend, "--decode-log-interval", "1", *graph_flags(run)]
    server = start_with_retry(
        lambda: LocalServer(model, args, run.logs / "server_dense.log", platform=run.platform), timeout=240
    )
    try:
        cmd = [sys.executable, str(COMPARE), str(REFERENCE), "--url", server.url, "--model-dir", model]
        proc = run.sh(cmd, "compare_dense.log", 120)
        answer = chat(server.url, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=16,
                      temperature=0)  # fmt: skip
        text = answer["choices"][0]["message"]["content"]
        steps = graph_steps(server.log())
    finally:
        server.stop()
    return {"greedy_equal": proc.returncode == 0, "compare": proc.stdout.strip()[-1500:], "chat": text,
            "graph_args": graph_flags(run), "decode_steps_by_graph": steps}  # fmt: skip


def long_prompt(tokens: int) -> str:
    from benchmark.long_context.bench_hot_set import essay_text

    words = essay_text().split()
    return " ".join(words[: int(tokens * 0.75)])


def serve_tiered(run: Run, model: str, name: str, extra: list[str]) -> dict:
    """A server with the HiCache host tier and ``extra`` flags: one long prompt twice (the
    second a prefix hit), its answers and the plugin's series from /metrics."""
    from sgl_importance.client import generate, greedy, metrics_text
    from sgl_importance.local_server import LocalServer, metric, start_with_retry

    args = [*TINY_ARGS, "--page-size", "16", "--attention-backend", run.backend, "--enable-metrics",
            "--enable-hierarchical-cache", "--hicache-ratio", "2", "--decode-log-interval", "1",
            *graph_flags(run), *extra]  # fmt: skip
    server = start_with_retry(
        lambda: LocalServer(model, args, run.logs / f"server_{name}.log", platform=run.platform), timeout=240
    )
    try:
        prompt = long_prompt(1500 if run.rehearse else 3000)
        answers = []
        for _ in range(2):
            out = generate(server.url, text=prompt, sampling_params=greedy(24))
            answers.append({"tokens": out["meta_info"]["completion_tokens"],
                            "cached": out["meta_info"].get("cached_tokens"), "text": out["text"][:80]})  # fmt: skip
        # Short requests alone (graph replays where graphs are on), then beside the long one
        # (the batch runs eagerly); the short answers must not change.
        short = "Name three colours of the rainbow."
        alone = [generate(server.url, text=short, sampling_params=greedy(24))["text"] for _ in range(2)]
        mark = len(server.log())
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(generate, server.url, text=t, sampling_params=greedy(n))
                       for t, n in ((prompt, 48), (short, 24), (short, 24))]  # fmt: skip
            beside = [f.result()["text"] for f in futures]
        result_mixed = {"short_alone_equal": len(set(alone)) == 1, "short_beside_long_equal": beside[1:] == alone,
                        "steps_alone_and_before": graph_steps(server.log()[:mark]),
                        "steps_mixed": graph_steps(server.log()[mark:])}  # fmt: skip
        scrape = metrics_text(server.url)
        series = {
            line.split("{")[0].split(" ")[0] for line in scrape.splitlines() if line.startswith("sgl_importance:")
        }
        result = {"answers": answers, "mixed": result_mixed, "plugin_series": sorted(series)[:40]}
        for key in ("sgl_importance:hot_set_pages_attended_total", "sgl_importance:hot_set_pages_dense_total",
                    "sgl_importance:hot_set_pages_released_total", "sgl_importance:hot_set_guard_reads_total",
                    "sgl_importance:hot_set_guard_checks_total", "sgl_importance:folded_steps_total"):  # fmt: skip
            result[key] = metric(scrape, key)
        errors = [line for line in server.log().splitlines() if "Traceback" in line or "Error" in line]
        result["log_errors"] = errors[:10]
    finally:
        server.stop()
    return result


def serve_streamed(run: Run, model: str, hot: list[str]) -> dict:
    """The long prompt in 512-token chunks on a hot-set server streaming its prefill (released
    pages read back from the host by the later chunks; on CUDA ordered against the forward
    stream) and on one prefilling dense: the prompt's logprobs and the greedy tokens, rid pinned
    (the guard's sample is drawn from it)."""
    from sgl_importance.client import generate, greedy, metrics_text
    from sgl_importance.local_server import LocalServer, metric, start_with_retry

    got = {}
    for prefill in ("stream", "dense"):
        args = [*TINY_ARGS, "--page-size", "16", "--attention-backend", run.backend, "--enable-metrics",
                "--enable-hierarchical-cache", "--hicache-ratio", "2", "--chunked-prefill-size", "512", *hot,
                "--hot-set-prefill", prefill, *graph_flags(run)]  # fmt: skip
        log = run.logs / f"server_prefill_{prefill}.log"
        server = start_with_retry(functools.partial(LocalServer, model, args, log, platform=run.platform), timeout=240)
        try:
            out = generate(server.url, text=long_prompt(1500 if run.rehearse else 3000), sampling_params=greedy(24),
                           rid="streamed-check", return_logprob=True, logprob_start_len=0)  # fmt: skip
            chunks = metric(metrics_text(server.url), "sgl_importance:hot_set_prefill_chunks_released_total")
            errors = [line for line in server.log().splitlines() if "Traceback" in line][:5]
        finally:
            server.stop()
        logprobs = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]
        got[prefill] = {"ids": out["output_ids"], "logprobs": logprobs, "chunks_released": chunks, "errors": errors}
    stream, dense = got["stream"], got["dense"]
    diff = max((abs(a - b) for a, b in zip(stream["logprobs"], dense["logprobs"])), default=None)
    return {"chunks_released": [stream["chunks_released"], dense["chunks_released"]],
            "prompt_logprobs_max_abs_diff": diff, "greedy_equal": stream["ids"] == dense["ids"],
            "errors": stream["errors"] + dense["errors"]}  # fmt: skip


def stage_serve(run: Run) -> dict:
    model = make_tiny(run)
    out: dict[str, Any] = {}
    hot = ["--radix-eviction-policy", "importance", "--hot-set-policy", "importance", "--hot-set-budget", "0.2",
           "--hot-set-threshold", "1024"]  # fmt: skip
    for name, fn in (
        ("dense", lambda: serve_dense(run, model)),
        ("hot-set", lambda: serve_tiered(run, model, "hot_set", hot)),
        ("streamed-prefill", lambda: serve_streamed(run, model, hot)),
    ):
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
        (run.out / "results.json").write_text(json.dumps({**run.results, "serve_partial": out}, default=str))
    return out


def stage_speed(run: Run) -> dict:
    """bench_speed per graph mode in ``run.speed_graphs`` ("off": eager decode; "on": decode
    graphs with the hot set's captured step; "ahead": the same, each step ended a step late,
    ``--hot-set-plan-ahead on``)."""
    folder = _dummy_model(run)
    if run.rehearse:
        grid = ["--lengths", "1024", "--batches", "1,2", "--new-tokens", "16", "--dtype", "float32",
                "--configs", "sglang-torch_native,dense,hot-20,hot-20-guard", "--threshold", "512"]  # fmt: skip
    else:
        grid = ["--lengths", run.speed_lengths, "--batches", run.speed_batches, "--new-tokens", "32",
                "--dtype", "bfloat16"]  # fmt: skip
    out: dict[str, Any] = {}
    for mode in run.speed_graphs:
        if run.left() < 60:
            out[mode] = {"status": "skipped", "why": "no time left"}
            continue
        speed_out = run.logs / f"speed_graphs_{mode}"
        server_args = "--load-format dummy --skip-tokenizer-init"
        graphs = mode in ("on", "ahead")
        if graphs:  # the flags parse and serve on the CPU too (torch_cpu captures no graph)
            server_args += " " + " ".join(HOT_SET_GRAPHS + (PLAN_AHEAD if mode == "ahead" else []))
        if not run.rehearse:  # torch_cuda captures decode graphs unless told not to
            server_args += " " + (" ".join(DECODE_GRAPHS) if graphs else "--cuda-graph-backend-decode disabled")
        if run.speed_server_args:  # every row's server alike (e.g. --triton-attention-num-kv-splits)
            server_args += " " + run.speed_server_args
        cmd = [sys.executable, "-m", "benchmark.long_context.bench_speed", "--platform", run.platform,
               "--model-path", str(folder), "--server-args", server_args,
               "--no-hicache", "--out", str(speed_out), *grid]  # fmt: skip
        if not run.rehearse:
            cmd += ["--configs", run.speed_configs[mode]]
        if run.speed_profile_steps:  # each row's kernels by name (bench_speed's profile_<row>.md)
            cmd += ["--profile-steps", str(run.speed_profile_steps)]
        try:
            proc = run.sh(cmd, f"speed_graphs_{mode}.log", timeout=run.left() - 20)
            code, tail = proc.returncode, proc.stdout[-3000:]
        except TimeoutError as e:
            code, tail = None, str(e)
        results = speed_out / "results.json"
        if not results.is_file():  # cut short: the rows measured so far
            results = speed_out / "rows-partial.json"
        rows = json.loads(results.read_text()) if results.is_file() else None
        if isinstance(rows, dict):  # results.json holds {"meta", "rows"}; rows-partial.json the list
            rows = rows["rows"]
        profiles = [p.name for p in sorted(speed_out.glob("profile_*.md"))]
        for name in ("RESULTS.md", "speed.png", *profiles):  # beside results.json: they come back on their own
            if (speed_out / name).is_file():
                shutil.copy2(speed_out / name, run.out / f"speed_graphs_{mode}_{name}")
        table = (speed_out / "RESULTS.md").read_text() if (speed_out / "RESULTS.md").is_file() else tail
        brief = [{k: r.get(k) for k in ("config", "length", "batch", "step_s", "hot_ratio")} for r in rows or []
                 if isinstance(r, dict)]  # fmt: skip
        out[mode] = {"returncode": code, "rows": rows, "brief": brief, "table": table}
    return out


def _dummy_model(run: Run) -> Path:
    folder = Path("/tmp/sgl-importance-dummy")
    shape = "smollm2" if run.rehearse else "llama-8b"
    proc = run.sh([sys.executable, str(MAKE_MODELS), "dummy", "--shape", shape, "--out", str(folder),
                   "--tokenizer-from", tokenizer_dir()], "make_dummy.log", 60)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"dummy model: {proc.stderr.strip()[-500:]}")
    return folder


class _PeakUsed:
    """The most device memory the GPU reported in use while inside (``nvidia-smi``, polled;
    every process on the card: the server's scheduler holds the pools)."""

    def __init__(self) -> None:
        import threading

        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True)  # fmt: skip
            try:
                self.peak_mib = max(self.peak_mib, float(out.stdout.split()[0]))
            except (ValueError, IndexError):
                pass
            self._stop.wait(0.2)

    def __enter__(self) -> "_PeakUsed":
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()


def stage_memory(run: Run) -> dict:
    """GPU.md item 4: a hot-set server at ``--memory-length`` x ``--memory-requests`` (Llama-3.1-8B
    shape, dummy weights, bf16, page 16, the host tier, the hot set at 20 %), beside dense with the
    same flags: the device memory the card reported at its peak against what SGLang sized (the
    weights and the KV pool from its log, the pool size SGLang allocated), and the plugin's pools
    and F(request) from /metrics. Every plugin byte inside the budget shows as the hot set's peak
    staying at dense's (its pools came out of the KV pool)."""
    folder = _dummy_model(run)
    length, count = (600, 3) if run.rehearse else (run.memory_length, run.memory_requests)
    base = ["--load-format", "dummy", "--skip-tokenizer-init", "--page-size", "16", "--attention-backend",
            run.backend, "--enable-hierarchical-cache", "--hicache-ratio", "2", "--enable-metrics",
            "--decode-log-interval", "1", "--max-running-requests", str(count)]  # fmt: skip
    if run.rehearse:
        base += ["--max-total-tokens", str(4 * length), "--dtype", "float32"]
    else:
        # The host tier sized in GB: --hicache-ratio 2 of an H200's 103 GiB pool asked 206 GiB of a
        # 121 GiB host and SGLang refused to start (runs/2026-11-28-h200).
        base += ["--dtype", "bfloat16", "--mem-fraction-static", "0.85", "--hicache-size", "48"]
    hot = ["--radix-eviction-policy", "importance", "--hot-set-policy", "importance", "--hot-set-budget", "0.2",
           "--hot-set-threshold", "1024"]  # fmt: skip
    out: dict[str, Any] = {"length": length, "requests": count}
    for name, extra in (("dense", []), ("hot-20", hot)):
        if run.left() < 90:
            out[name] = {"status": "skipped", "why": "no time left"}
            continue
        try:
            out[name] = _memory_of(run, folder, name, [*base, *extra], length, count)
        except Exception as exc:  # one server's failure is its row's; the next one still runs
            out[name] = {"status": "error", "why": f"{type(exc).__name__}: {str(exc)[-600:]}"}
    return out


def _memory_of(run: Run, folder: Path, name: str, args: list[str], length: int, count: int) -> dict:
    """One server of the memory stage: ``count`` prompts of ``length`` random ids at once."""
    import random

    from sgl_importance.client import generate, metrics_text
    from sgl_importance.local_server import LocalServer, metric, start_with_retry

    log_path = run.logs / f"server_memory_{name}.log"
    # Bounded by the run's clock: a stage that outlives the device tool's limit returns nothing.
    t0 = time.time()
    server = start_with_retry(
        lambda: LocalServer(str(folder), args, log_path, platform=run.platform),
        timeout=max(30.0, min(300.0, run.left() - 60)),
    )
    start_s = round(time.time() - t0, 1)
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    def send(ids: list[int]) -> dict:
        return generate(server.url, input_ids=ids, sampling_params=sampling, timeout=max(30.0, run.left() - 20))

    failed = None
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(count)]
        started = time.time()
        done: list = []
        # The peak and /metrics are read whether or not every request came back (on
        # 2026-11-28 a timed-out hot-set row lost both).
        with _PeakUsed() as peak, ThreadPoolExecutor(count) as pool:
            try:
                done = list(pool.map(send, prompts))
            except Exception as exc:
                failed = f"{type(exc).__name__}: {str(exc)[-300:]}"
        scrape = metrics_text(server.url)
        log = server.log()
    finally:
        server.stop()
    running = [int(m) for m in re.findall(r"Decode batch, #running-req: (\d+)", log)]
    row = {"start_s": start_s, "seconds": round(time.time() - started, 1), "answered": len(done), "failed": failed,
           "peak_used_mib": peak.peak_mib, "most_running": max(running, default=0)}  # fmt: skip
    for key in ("max_total_num_tokens", "mem_fraction_static"):
        m = re.search(rf"{key}[=:' ]+([\d.]+)", log)
        row[key] = float(m.group(1)) if m else None
    for line in ("Load weight end", "KV Cache is allocated", "Memory pool end", "hot set: nothing set aside"):
        found = [text for text in log.splitlines() if line in text]
        row[line] = found[-1][-300:] if found else None
    for key in ("device_bytes", "borrowed_pages", "guard_rows_in_use", "range_rows_in_use", "tracked_requests"):
        row[key] = metric(scrape, f"sgl_importance:hot_set_{key}")
    row["pages_released"] = metric(scrape, "sgl_importance:hot_set_pages_released_total")
    return row


def stage_kbench(run: Run) -> dict:
    """GPU.md's kernel timings: decode with importance on vs off (SGLang's Triton decode
    kernel as the peer where importable) and the hot set's page-list step."""
    out: dict[str, Any] = {}
    smoke = ["--smoke"] if run.rehearse else []
    for name, args in (
        ("decode", ["--models", "llama8b", "--bs", "1,8,32", "--ctx", "4096,32768,131072"]),
        ("page_list", ["--bs", "1,8,32"]),
    ):
        if run.left() < 30:
            out[name] = {"status": "skipped", "why": "no time left"}
            continue
        folder = run.logs / f"kbench_{name}"
        cmd = [sys.executable, "-m", f"benchmark.kernel.bench_{name}", "--out", str(folder), *smoke]
        cmd += [] if run.rehearse else args
        proc = run.sh(cmd, f"kbench_{name}.log", timeout=run.left() - 15)
        table = next((p.read_text() for p in sorted(folder.glob("*.md"))), proc.stdout[-3000:])
        out[name] = {"returncode": proc.returncode, "table": table[-6000:]}
    return out


# ------------------------------------------------------------------ report


def summary(run: Run) -> str:
    lines = [f"# GPU run ({run.platform}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(run.start))})", ""]
    for name, result in run.results["stages"].items():
        lines.append(f"## {name}: {result.get('status')} ({result.get('seconds', 0)} s)")
        if name == "speed":
            for mode, r in result.items():
                if isinstance(r, dict):
                    shown = r.get("brief") or r.get("table") or r
                    lines.append(f"### graphs {mode}\n" + json.dumps(shown, default=str)[:3000])
        else:
            brief = {k: v for k, v in result.items() if k not in ("status", "seconds", "rows", "table")}
            lines.append("```\n" + json.dumps(brief, indent=1, default=str)[:4000] + "\n```")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-run")))
    ap.add_argument("--rehearse", action="store_true", help="on this CPU: torch_cpu, importance_torch, small shapes")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {', '.join(STAGES)}")
    ap.add_argument("--budget-s", type=float, default=400, help="the whole run's seconds (stages past it are skipped)")
    ap.add_argument("--kernels-select", help="pytest -k expression for the kernel tests (default: all)")
    ap.add_argument("--kernels-timeout-s", type=float, default=180, help="the kernel tests' seconds, from their start")
    ap.add_argument("--speed-lengths", default="8192,32768", help="bench_speed --lengths on the GPU")
    ap.add_argument("--speed-configs", default="dense,hot-20,hot-20-guard", help="bench_speed --configs, graphs off")
    ap.add_argument("--speed-configs-graphs", default="dense,hot-20,sglang-triton", help="the same, graphs on")
    ap.add_argument("--speed-batches", default="1,8", help="bench_speed --batches on the GPU")
    ap.add_argument("--speed-graphs", default="off,on", help="decode graph modes, in order: off, on, ahead")
    ap.add_argument("--speed-server-args", default="", help="flags added to every speed row's server")
    ap.add_argument("--speed-profile-steps", type=int, default=0, help="bench_speed --profile-steps (0: none)")
    ap.add_argument("--memory-length", type=int, default=32768, help="memory stage: tokens per request")
    ap.add_argument("--memory-requests", type=int, default=8, help="memory stage: requests sent at once")
    a = ap.parse_args()
    run = Run(a.out, a.rehearse, a.budget_s)
    run.speed_lengths, run.speed_batches, run.speed_server_args = a.speed_lengths, a.speed_batches, a.speed_server_args
    run.speed_profile_steps = a.speed_profile_steps
    run.speed_configs = {"off": a.speed_configs, "on": a.speed_configs_graphs, "ahead": a.speed_configs_graphs}
    run.speed_graphs = [m for m in a.speed_graphs.split(",") if m]
    run.memory_length, run.memory_requests = a.memory_length, a.memory_requests
    if set(run.speed_graphs) - {"off", "on", "ahead"}:
        ap.error("--speed-graphs: off, on and/or ahead")
    wanted = a.stages.split(",")
    unknown = set(wanted) - set(STAGES)
    if unknown:
        ap.error(f"--stages: unknown {sorted(unknown)}; allowed: {', '.join(STAGES)}")
    kernels = start_kernels(run, a.kernels_select) if "kernels" in wanted else None

    def finish(r: Run) -> dict:
        return finish_kernels(r, kernels, a.kernels_timeout_s - (time.time() - kernels[2]))

    # The kernel tests run in the background from the start; they are waited for after serve,
    # before the timed stages (nothing else on the GPU then).
    plan = {"env": (stage_env, 0), "kernels": (finish, 0), "serve": (stage_serve, 90), "speed": (stage_speed, 60),
            "kbench": (stage_kbench, 40), "memory": (stage_memory, 120)}  # fmt: skip
    for name in ("env", "serve", "kernels", "speed", "kbench", "memory"):
        if name in wanted:
            run.stage(name, *plan[name])
    text = summary(run)
    (run.out / "summary.md").write_text(text)
    run.pack_logs()
    print(text)


if __name__ == "__main__":
    main()
