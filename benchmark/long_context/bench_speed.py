"""Decode speed of record: transformers, importance_torch dense, the hot set — one run, one table.

What a decode step costs on this machine, against what it has to read. In one
invocation, one measurement after another (never two at once):

1. ``transformers`` — the peer: ``AutoModelForCausalLM`` from the model folder
   (``--dtype``, SDPA attention, its own KV cache), greedy decode of the same prompts,
   each step timed; ``serve`` — ``make serve``'s server (no attention, page or HiCache
   flag: the platform's default backend; ``benchmark/serving/bench_serve_speed.py`` runs
   it against transformers in turns);
2. ``reference`` — a plain ``importance_torch`` server (no hot set, HiCache on) with
   ``SGL_IMPORTANCE_DECODE=reference``: the slot-by-slot reference decode;
   ``dense-torch`` — the same with ``SGL_IMPORTANCE_DECODE=torch``: the batched
   page-list decode in torch (gather, then matmuls);
3. ``dense`` — the same server with the default decode (sgl_kernel_ext's C kernel,
   reading the pool in place);
4. ``sglang-<backend>`` — the peer server: the dense server's flags with SGLang's own
   ``--attention-backend <backend>`` (``sglang-torch_native`` on the CPU, ``sglang-triton``
   on a GPU); one server per peer, measured before the plugin's;
5. ``hot-*`` — one hot-set server (``--hot-set-policy importance``, HiCache on) decoding
   each configuration chosen per request through ``custom_params.hot_set``:
   ``hot-dense`` (policy dense), ``hot-10`` / ``hot-20`` / ``hot-30`` (importance at that
   budget, guard off: ``guard_threshold`` 1.0), ``hot-20-guard`` (importance 20 % with the
   server's default guard).

Lengths (prompt tokens) x batches (requests decoding at once): each server first
prefills the batch's distinct prompts (essay slices, ``max_new_tokens`` 1) so they are
cached, then decodes ``--new-tokens`` greedy tokens (``ignore_eos``) for every batch and
configuration from those cached prompts. The per-step time is the median of the
server's per-step decode log (``--decode-log-interval 1``, steps where the whole batch
ran); the mean from ``/generate``'s meta_info (decode time / tokens) is kept beside it.
Hot-set configurations run only where the prompt is longer than ``--threshold``
(shorter requests decode densely on that server, the same as ``dense``).

Per row: decode tok/s, step time, pages read per step (per layer, summed over the batch:
the pages dense attention reads, times the hot set's ``pages_attended / pages_dense``
from ``/metrics``), the bytes the step reads (the weights once + the KV it reads), the
machine's copy bandwidth (a large tensor copy, best of several, measured before each
measurement; bandwidth = bytes read + bytes written per second) and the time to read
those bytes once at that bandwidth, so each row shows how far it is from the limit;
and the ratio of its tok/s to dense's and to transformers'.

Platforms (``--platform``, the servers' ``SGLANG_PLATFORM``): ``torch_cpu`` (default;
``--attention-backend importance_torch``) and ``torch_cuda`` (a GPU with SGLang's native
ops; ``importance_triton``, and the bandwidth column is a device-to-device copy timed with
CUDA events). ``--model-path`` serves another folder and ``--server-args`` adds flags to
every server (``--load-format dummy --skip-tokenizer-init`` for a model shape without its
weights: the requests send token ids and read ``output_ids``, never text; the prompts'
tokenizer comes from the folder or ``--tokenizer``). ``transformers`` needs real weights
and the CPU: refused with ``--load-format dummy`` or on torch_cuda. ``--no-hicache``
starts every server without HiCache (the hot set then releases no pages).

Writes RESULTS.md (the table and the command), results.json (rows, and per configuration
the error of a measurement that failed; the others go on), speed.png (step time vs pages
read) and every server's log under ``logs/`` into ``--out``, then prints a short table.
``--profile-steps N``: after each row its requests run again while SGLang's profiler
(``/start_profile``) records N of their decode steps, and ``profile_<row>.md`` sums the
trace's kernels by name (on a CPU server, its top-level ops): where a step's time goes
(``profile_steps.py``).

    python -m benchmark.long_context.bench_speed --out /tmp/bench_speed          # full grid
    python -m benchmark.long_context.bench_speed --smoke --out /tmp/bench_speed  # minutes
    python -m benchmark.long_context.bench_speed --platform torch_cuda --model-path DIR \\
        --server-args "--load-format dummy --skip-tokenizer-init" --dtype bfloat16 --no-hicache \\
        --lengths 8192,32768 --batches 1,8 --new-tokens 64 \\
        --configs sglang-triton,dense,hot-20,hot-20-guard --out /tmp/bench_speed_gpu   # a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from benchmark.long_context.bench_hot_set import PAGE, essay_text
from benchmark.long_context.profile_steps import kernel_table, markdown, profile_decode
from sgl_importance.client import generate, greedy, metrics_text
from sgl_importance.local_server import LocalServer, metric, model_path

GUARD_DEFAULT = "server default"
ALL_CONFIGS = (
    "transformers",
    "serve",
    "reference",
    "dense-torch",
    "dense",
    "hot-dense",
    "hot-10",
    "hot-20",
    "hot-30",
    "hot-20-guard",
)
# SGLang's own attention under a dense server's flags: the peer on each platform.
PEER_PREFIX = "sglang-"
DEFAULT_BACKEND = {"torch_cpu": "importance_torch", "torch_cuda": "importance_triton"}
DEFAULT_PEER = {"torch_cpu": "sglang-torch_native", "torch_cuda": "sglang-triton"}
SERVER_KINDS = ("serve", "reference", "dense-torch", "dense", "hot")
DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+), .*?gen throughput \(token/s\): ([\d.]+)")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAPH_REPLAYED = re.compile(r"Decode batch.*?(?:cuda|cpu) graph: True")


# ------------------------------------------------------------------ configurations


def parse_config(name: str) -> dict[str, Any]:
    """What a configuration name means: which measurement runs it and its ``hot_set``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "transformers":
        return {"name": name, "server": None, "hot_set": None}
    if name in ("serve", "reference", "dense-torch", "dense"):
        return {"name": name, "server": name, "hot_set": None}
    peer = re.fullmatch(PEER_PREFIX + r"([a-z0-9_]+)", name)
    if peer:
        # A server of its own: SGLang's backend, no importance recording, no hot set.
        return {"name": name, "server": name, "hot_set": None, "backend": peer.group(1)}
    if name == "hot-dense":
        return {"name": name, "server": "hot", "hot_set": {"policy": "dense"}}
    m = re.fullmatch(r"hot-(\d+)(-guard)?", name)
    if m and 0 < int(m.group(1)) <= 100:
        hot_set: dict[str, Any] = {"policy": "importance", "budget": int(m.group(1)) / 100}
        if not m.group(2):
            hot_set["guard_threshold"] = 1.0  # guard off
        return {"name": name, "server": "hot", "hot_set": hot_set}
    raise ValueError(
        f"--configs: unknown configuration {name!r}; allowed: {', '.join(ALL_CONFIGS)}, hot-<percent>, "
        f"{PEER_PREFIX}<attention backend>"
    )


def config_order(name: str) -> tuple[int, str]:
    """Where a configuration's rows go in the table: transformers, SGLang's own backends
    (the peers), then the plugin's from the plainest to the hot set."""
    if name == "transformers":
        return (0, name)
    if name.startswith(PEER_PREFIX):
        return (1, name)
    order = {n: i for i, n in enumerate(ALL_CONFIGS)}
    return (2 + order.get(name, len(ALL_CONFIGS)), name)


def context_length(lengths: list[int], new_tokens: int, page: int = PAGE) -> int:
    """``--context-length`` for every server: the longest prompt, its new tokens and a page
    of slack (the model's ``max_position_embeddings`` must allow it)."""
    return max(lengths) + new_tokens + page


def load_format(extra_args: list[str]) -> Optional[str]:
    """The ``--load-format`` among ``--server-args`` (None where not given)."""
    for i, arg in enumerate(extra_args):
        if arg == "--load-format" and i + 1 < len(extra_args):
            return extra_args[i + 1]
        if arg.startswith("--load-format="):
            return arg.split("=", 1)[1]
    return None


# ------------------------------------------------------------------ bytes and bandwidth


def model_shape(config: dict[str, Any]) -> dict[str, int]:
    """The numbers of a Llama-style ``config.json`` the byte counts need."""
    hidden = config["hidden_size"]
    q_heads = config["num_attention_heads"]
    return {
        "layers": config["num_hidden_layers"],
        "hidden": hidden,
        "intermediate": config["intermediate_size"],
        "q_heads": q_heads,
        "kv_heads": config.get("num_key_value_heads", q_heads),
        "head_dim": config.get("head_dim", hidden // q_heads),
        "vocab": config["vocab_size"],
        "tied": int(bool(config.get("tie_word_embeddings", False))),
    }


def weight_bytes(shape: dict[str, int], dtype_bytes: int) -> int:
    """Bytes of weights one decode step reads: every layer's projections and norms, the
    final norm and the LM head (the embedding lookup reads a few rows only, and a tied
    LM head is the embedding matrix, read once)."""
    h, d = shape["hidden"], shape["head_dim"]
    attn = h * (shape["q_heads"] * d + 2 * shape["kv_heads"] * d) + shape["q_heads"] * d * h
    mlp = 3 * h * shape["intermediate"]
    per_layer = attn + mlp + 2 * h
    return (shape["layers"] * per_layer + h + shape["vocab"] * h) * dtype_bytes


def kv_bytes_per_page(shape: dict[str, int], dtype_bytes: int, page: int = PAGE) -> int:
    """K and V bytes of one page in every layer."""
    return 2 * page * shape["kv_heads"] * shape["head_dim"] * dtype_bytes * shape["layers"]


def code_bytes_per_page(shape: dict[str, int], page: int = PAGE) -> int:
    """Bytes of the guard's key codes of one page in every layer (``key_codes.bytes_per_token``)."""
    from sgl_importance.hot_set.guard.key_codes import bytes_per_token

    return round(bytes_per_token(shape["head_dim"], page) * page * shape["layers"] * shape["kv_heads"])


def dense_pages_per_step(length: int, batch: int, new_tokens: int, page: int = PAGE) -> float:
    """Pages dense attention reads per layer and step, summed over the batch, averaged over
    the decode steps (the sequence grows by one token a step)."""
    steps = range(1, new_tokens)
    return batch * statistics.fmean(math.ceil((length + t) / page) for t in steps)


def copy_bandwidth(device: str = "cpu", mib: int = 256, repeats: int = 5) -> float:
    """GB/s of a large tensor copy on ``device`` (bytes read + bytes written), best of
    ``repeats``. On a GPU: a device-to-device copy timed with CUDA events, after a warm-up
    copy; the tensors are freed after (the client must not hold memory the servers need)."""
    import torch

    if device == "cpu":
        src = torch.ones(mib * 2**20 // 4)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return 2 * src.numel() * 4 / best / 1e9
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: the first launch pays for its set-up
    best_ms = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end))
    nbytes = src.numel() * 4
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (best_ms / 1e3) / 1e9


def load_average() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


# ------------------------------------------------------------------ prompts


def make_prompts(tokenizer: Any, lengths: list[int], count: int) -> dict[int, list[list[int]]]:
    """``count`` distinct essay slices of each length (token ids).

    The essays are ~154K tokens with SmolLM2's tokenizer: 8 slices of 32768 start 15K apart.
    Where they hold too few tokens for ``count`` slices of a length, each prompt instead
    reads the essays as a ring from its own start (``i / count`` of the way in), repeating
    the text as often as the length needs: deterministic, and distinct from the first page.
    """
    filler = tokenizer(essay_text(), add_special_tokens=False)["input_ids"]
    return prompts_from_filler(filler, lengths, count)


def prompts_from_filler(filler: list[int], lengths: list[int], count: int) -> dict[int, list[list[int]]]:
    """``make_prompts`` on given filler token ids."""
    if len(filler) < count * PAGE:
        raise ValueError(f"{len(filler)} filler tokens are too few for {count} distinct prompts")
    prompts = {}
    for length in lengths:
        stride = (len(filler) - length) // count
        if stride >= 1:
            prompts[length] = [filler[i * stride : i * stride + length] for i in range(count)]
            continue
        ring = filler * (length // len(filler) + 2)
        starts = [i * len(filler) // count for i in range(count)]
        prompts[length] = [ring[s : s + length] for s in starts]
    return prompts


# ------------------------------------------------------------------ transformers, the peer


def load_transformers(model_dir: str, dtype: str) -> Any:
    """transformers' own model of the folder in ``dtype`` (SDPA attention), for inference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval()


def transformers_prefill(model: Any, ids: list[list[int]]) -> tuple[list, list, list[int]]:
    """Each prompt prefilled alone in chunks of 2,048 (like the server's): per layer one
    ``[requests, kv_heads, tokens, D]`` K and V, and each request's first greedy token."""
    import torch
    from transformers import DynamicCache

    keys: list = []
    values: list = []
    firsts = []
    with torch.inference_mode():
        for i, prompt in enumerate(ids):
            cache = DynamicCache(config=model.config)
            for s in range(0, len(prompt), 2048):
                chunk = torch.tensor([prompt[s : s + 2048]])
                out = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
            firsts.append(int(out.logits[0, -1].argmax()))
            for layer, entry in enumerate(cache.layers):
                if i == 0:
                    keys.append(entry.keys.new_empty((len(ids), *entry.keys.shape[1:])))
                    values.append(entry.values.new_empty((len(ids), *entry.values.shape[1:])))
                keys[layer][i] = entry.keys[0]
                values[layer][i] = entry.values[0]
            del cache
    return keys, values, firsts


def transformers_decode(model: Any, keys: list, values: list, firsts: list[int], batch: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` greedy decode steps of the first ``batch`` prefilled
    requests (forward + argmax: ``generate``'s loop without its logits processors)."""
    import torch
    from transformers import DynamicCache

    # Slices: the cache concatenates new tokens into fresh tensors, the store stays.
    cache = DynamicCache(ddp_cache_data=[(k[:batch], v[:batch]) for k, v in zip(keys, values)])
    token = torch.tensor(firsts[:batch])[:, None]
    times = []
    with torch.inference_mode():
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    del cache
    return times


def measure_transformers(model_dir: str, prompts: dict[int, list[list[int]]], batches: list[int], a) -> list[dict]:
    """Greedy decode with transformers' own model and KV cache, every step timed."""
    model = load_transformers(model_dir, a.dtype)
    rows = []
    for length, ids in prompts.items():
        keys, values, firsts = transformers_prefill(model, ids[: max(batches)])
        for batch in batches:
            bandwidth = copy_bandwidth()
            load = load_average()
            times = transformers_decode(model, keys, values, firsts, batch, a.new_tokens - 1)
            step = statistics.median(times)
            rows.append(
                {
                    "config": "transformers",
                    "length": length,
                    "batch": batch,
                    "step_s": step,
                    "step_mean_s": statistics.fmean(times),
                    "steps": len(times),
                    "hot_ratio": None,
                    "bandwidth_gbs": bandwidth,
                    "load": load,
                }
            )
            print(f"transformers {length} x{batch}: {step * 1e3:.1f} ms/step", flush=True)
        del keys, values
        gc.collect()
    del model
    gc.collect()
    return rows


# ------------------------------------------------------------------ servers


def server_args(kind: str, a, max_tokens: int, guard_share: float, context: int) -> tuple[list[str], dict[str, str]]:
    """The server's flags for ``kind``: a pool of ``max_tokens`` KV tokens (the hot-set
    server's with room for the rows it borrows beside them, ``guard_share`` their pages per KV
    page), ``--context-length context``, then ``--server-args`` (last, so they win).

    ``sglang-<backend>`` is the dense server with SGLang's own backend instead of
    ``--attention-backend``. ``serve`` is ``make serve``'s server: no flag of the plugin's or of
    SGLang's attention (the platform's default backend, SGLang's page size of 1, no HiCache),
    only the dtype and what measuring needs (the context, a pool that holds the batch, the
    per-step log)."""
    if kind == "serve":
        args = ["--dtype", a.dtype, "--context-length", str(context), "--max-total-tokens", str(max_tokens)]
        return args + ["--decode-log-interval", "1", *shlex.split(a.server_args)], {}
    hot = kind == "hot"
    if hot:
        # The server borrows its key ranges and codes from --max-total-tokens: room for them
        # beside the prompts, so the KV pool still keeps every prompt cached (else the prompts
        # are prefilled again for every measurement, chunks interleaved with the timed steps).
        max_tokens += math.ceil(max_tokens * guard_share / PAGE) * PAGE + PAGE
    backend = kind[len(PEER_PREFIX) :] if kind.startswith(PEER_PREFIX) else a.attention_backend
    args = [
        "--page-size", str(PAGE), "--attention-backend", backend, "--dtype", a.dtype, "--enable-metrics",
        "--context-length", str(context), "--max-total-tokens", str(max_tokens), "--decode-log-interval", "1",
    ]  # fmt: skip
    if not a.no_hicache:
        # Without it the hot set keeps every page on the device (nothing to release to).
        args += ["--enable-hierarchical-cache", "--hicache-ratio", str(a.hicache_ratio)]
    env = {}
    if kind in ("reference", "dense-torch"):
        env["SGL_IMPORTANCE_DECODE"] = "torch" if kind == "dense-torch" else "reference"
    if hot:
        args += ["--hot-set-policy", "importance", "--hot-set-threshold", str(a.threshold)]
    return args + shlex.split(a.server_args), env


def replayed_steps(log: str) -> int:
    """Decode steps SGLang's log says replayed a CUDA graph ("cuda graph: True")."""
    return len(GRAPH_REPLAYED.findall(log))


def step_times_from_log(log: str, batch: int) -> list[float]:
    """Seconds per decode step from SGLang's per-step log lines where ``batch`` requests ran.

    The first line of a window measures the gap since the last decode before it (idle
    time included), so it is dropped."""
    steps = []
    for i, m in enumerate(DECODE_LINE.finditer(log)):
        running, rate = int(m.group(1)), float(m.group(2))
        if i == 0 or running != batch or rate <= 0:
            continue
        steps.append(running / rate)
    return steps


def measure_server(
    kind: str,
    configs: list[dict],
    model_dir: str,
    prompts: dict[int, list[list[int]]],
    batches: list[int],
    a,
    logs: Path,
    guard_share: float,
    rows: list[dict],
) -> None:
    """One server, every length x batch x configuration of ``kind`` (``guard_share``: the
    guard's bytes per KV byte, for the hot-set server's pool), each row appended to
    ``rows`` as it is measured (a failure later keeps it)."""
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_tokens = max(batches) * (longest + a.new_tokens + PAGE) + 64 * PAGE
    context = context_length(list(prompts), a.new_tokens)
    args, env = server_args(kind, a, max_tokens, guard_share, context)
    server = LocalServer(model_dir, args, logs / f"server_{kind}.log", env=env, platform=a.platform)
    print(f"{kind}: {shlex.join(server.cmd)}", flush=True)

    def decode(ids: list[int], new: int, hot_set: Optional[dict]) -> dict:
        params = greedy(new, ignore_eos=True)
        if hot_set is not None:
            params["custom_params"] = {"hot_set": hot_set}
        return generate(server.url, input_ids=ids, sampling_params=params, timeout=3600)

    def at_once(ids: list[list[int]], new: int, hot_set: Optional[dict]) -> list[dict]:
        pool = ThreadPoolExecutor(len(ids))
        try:
            return list(pool.map(lambda p: decode(p, new, hot_set), ids))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def scrape() -> str:
        return metrics_text(server.url)

    def profile(name: str, ids: list[list[int]], hot_set: Optional[dict]) -> dict:
        """The row's requests again, ``--profile-steps`` of their decode profiled; the
        table written beside the report (``profile_<row>.md``), the trace dropped."""
        activities = ["CPU", "GPU"] if a.platform == "torch_cuda" else ["CPU"]
        with tempfile.TemporaryDirectory() as folder:
            trace = profile_decode(
                server.url,
                server.log,
                lambda: at_once(ids, a.new_tokens, hot_set),
                Path(folder),
                a.profile_steps,
                activities,
            )
            table = kernel_table(trace, a.profile_steps)
        (a.out / f"profile_{name}.md").write_text(markdown(table, f"{name}: {a.profile_steps} decode steps profiled"))
        return {"source": table["source"], "ms_per_step": table["total_ms_per_step"], "top": table["rows"][:15]}

    try:
        server.wait_ready(timeout=900)
        for length, ids in prompts.items():
            cached = ids[: max(batches)]
            at_once(cached, 1, None)  # prefill: the prompts stay in the radix cache
            at_once(cached[:1], 4, None)  # warm-up, not measured
            for batch in batches:
                for config in configs:
                    if config["hot_set"] is not None and length <= a.threshold:
                        continue  # below the threshold a hot-set request decodes densely
                    bandwidth = copy_bandwidth(a.bandwidth_device)
                    load = load_average()
                    before, mark = scrape(), len(server.log())
                    results = at_once(cached[:batch], a.new_tokens, config["hot_set"])
                    after, log = scrape(), server.log()[mark:]
                    steps = step_times_from_log(log, batch)
                    # The first token's latency is reported with --enable-metrics only (the
                    # serve server has none): there the logged steps give the mean too.
                    means = [
                        (r["meta_info"]["e2e_latency"] - r["meta_info"]["first_token_latency"])
                        / max(r["meta_info"]["completion_tokens"] - 1, 1)
                        for r in results
                        if "first_token_latency" in r["meta_info"]
                    ]
                    means = means if len(means) == len(results) else steps
                    attended = metric(after, "sgl_importance:hot_set_pages_attended_total") - metric(
                        before, "sgl_importance:hot_set_pages_attended_total"
                    )
                    dense = metric(after, "sgl_importance:hot_set_pages_dense_total") - metric(
                        before, "sgl_importance:hot_set_pages_dense_total"
                    )
                    estimated = metric(after, "sgl_importance:hot_set_pages_estimated_total") - metric(
                        before, "sgl_importance:hot_set_pages_estimated_total"
                    )
                    row = {
                        "config": config["name"],
                        "length": length,
                        "batch": batch,
                        "step_s": statistics.median(steps) if steps else statistics.fmean(means),
                        "step_mean_s": statistics.fmean(means),
                        "steps": len(steps),
                        "replayed_steps": replayed_steps(log),
                        "graphs": replayed_steps(log) > 0,
                        "hot_ratio": attended / dense if dense > 0 else None,
                        "estimated_ratio": estimated / dense if dense > 0 else 0.0,
                        "bandwidth_gbs": bandwidth,
                        "load": load,
                        "output_ids": [r["output_ids"] for r in results],
                        # The guard's flags and the selection's misses over the run (issue 46).
                        "counters": {
                            name: metric(after, f"sgl_importance:hot_set_{name}_total")
                            - metric(before, f"sgl_importance:hot_set_{name}_total")
                            for name in (
                                "steps",
                                "warmups",
                                "guard_checks",
                                "guard_flagged",
                                "late_arrivals",
                                "pages_missed",
                                "pages_sampled",
                                "pages_guard_read",
                                "graph_steps",
                                "graph_eager",
                            )
                        },  # fmt: skip
                    }
                    if a.profile_steps:
                        name = f"{config['name']}_{length}x{batch}"
                        row["profile"] = profile(name, cached[:batch], config["hot_set"])
                    rows.append(row)
                    print(
                        f"{config['name']} {length} x{batch}: {row['step_s'] * 1e3:.1f} ms/step "
                        f"(mean {row['step_mean_s'] * 1e3:.1f}, {len(steps)} steps logged)",
                        flush=True,
                    )
    finally:
        server.stop()


# ------------------------------------------------------------------ the report


def complete_rows(
    rows: list[dict], shape: dict[str, int], dtype_bytes: int, new_tokens: int, peer: Optional[str] = None
) -> list[dict]:
    """Add the computed columns: pages, bytes, time to read them once, ratios (to dense, to
    transformers and to ``peer``: by default the first ``sglang-*`` configuration measured)."""
    if peer is None:
        peer = min((r["config"] for r in rows if r["config"].startswith(PEER_PREFIX)), default=None)
    weights = weight_bytes(shape, dtype_bytes)
    per_page = kv_bytes_per_page(shape, dtype_bytes)
    per_code_page = code_bytes_per_page(shape)
    best_bw = max((r["bandwidth_gbs"] for r in rows), default=float("nan"))
    out = []
    for r in rows:
        r = dict(r)
        dense_pages = dense_pages_per_step(r["length"], r["batch"], new_tokens)
        r["pages_per_step"] = dense_pages * (r["hot_ratio"] if r["hot_ratio"] is not None else 1.0)
        r["coded_pages_per_step"] = dense_pages * r.get("estimated_ratio", 0.0)
        r["bytes_per_step"] = weights + r["pages_per_step"] * per_page + r["coded_pages_per_step"] * per_code_page
        r["best_bandwidth_gbs"] = best_bw
        r["read_once_s"] = r["bytes_per_step"] / (best_bw * 1e9)
        r["tok_s"] = r["batch"] / r["step_s"]
        out.append(r)
    by_key = {(r["config"], r["length"], r["batch"]): r for r in out}
    for r in out:
        for other_name, column in (("dense", "vs_dense"), ("transformers", "vs_transformers"), (peer, "vs_peer")):
            other = by_key.get((other_name, r["length"], r["batch"]))
            r[column] = r["tok_s"] / other["tok_s"] if other else None
        r["peer"] = peer
    return out


def _ratio(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.2f}x"


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["length"], r["batch"], config_order(r["config"])))


def _peer_name(rows: list[dict]) -> str:
    return next((r["peer"] for r in rows if r.get("peer")), "sglang")


def table_lines(rows: list[dict]) -> list[str]:
    lines = [
        "| length | batch | config | tok/s | step ms (median) | step ms (mean) | pages/step | coded pages/step "
        "| MB read/step "
        f"| read once at bw, ms | step / read once | vs dense | vs {_peer_name(rows)} | vs transformers |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in _sorted(rows):
        cells = (
            r["length"],
            r["batch"],
            r["config"],
            f"{r['tok_s']:.1f}",
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['step_mean_s'] * 1e3:.1f}",
            f"{r['pages_per_step']:.0f}",
            f"{r.get('coded_pages_per_step', 0.0):.0f}",
            f"{r['bytes_per_step'] / 1e6:.0f}",
            f"{r['read_once_s'] * 1e3:.1f}",
            f"{r['step_s'] / r['read_once_s']:.1f}",
            _ratio(r["vs_dense"]),
            _ratio(r.get("vs_peer")),
            _ratio(r["vs_transformers"]),
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def short_table(rows: list[dict], errors: dict[str, str]) -> str:
    """The few columns worth reading in a terminal, and each configuration that failed."""
    lines = [f"{'length':>7} {'batch':>5}  {'config':<22}{'tok/s':>9}{'step ms':>9}{'vs dense':>9}{'vs peer':>9}"]
    for r in _sorted(rows):
        lines.append(
            f"{r['length']:>7} {r['batch']:>5}  {r['config']:<22}{r['tok_s']:>9.1f}{r['step_s'] * 1e3:>9.1f}"
            f"{_ratio(r['vs_dense']):>9}{_ratio(r.get('vs_peer')):>9}"
        )
    lines += [f"NOT MEASURED {name}: {error}" for name, error in errors.items()]
    return "\n".join(lines)


def write_report(rows: list[dict], meta: dict[str, Any], out: Path) -> str:
    bws = [r["bandwidth_gbs"] for r in rows] or [float("nan")]
    loads = [r["load"] for r in rows if not math.isnan(r["load"])]
    text = "\n".join(
        [
            "# Decode speed (bench_speed.py)",
            "",
            f"Command (took {meta['minutes']:.0f} min): `{meta['command']}`",
            "",
            f"Machine: {meta['machine']}. Model {meta['model']} in {meta['dtype']}, pages of {PAGE} tokens, "
            f"{meta['new_tokens']} greedy tokens after a cached prompt; hot-set threshold {meta['threshold']} tokens.",
            f"Platform {meta.get('platform', 'torch_cpu')}, attention backend "
            f"{meta.get('attention_backend', 'importance_torch')}; server flags added: "
            f"`{meta.get('server_args') or '(none)'}`; HiCache {'off' if meta.get('no_hicache') else 'on'}.",
            f"Copy bandwidth (read + written bytes per second, {meta.get('bandwidth', 'a 256 MiB tensor copy')}, "
            f"best of 5, measured before each row): {min(bws):.1f}-{max(bws):.1f} GB/s; "
            f"'read once' uses the best, {max(bws):.1f} GB/s. "
            f"Load average (1 min) when rows started: {min(loads, default=float('nan')):.1f}-"
            f"{max(loads, default=float('nan')):.1f}.",
            "",
            "pages/step: pages read per layer and step, summed over the batch (hot set: dense's pages x "
            "pages_attended / pages_dense from /metrics, the guard's sampled pages included); coded pages/step: the "
            "unread pages the guard accounted for from their 4-bit key codes (pages_estimated). MB read/step: the "
            "weights once + those pages' K and V in every layer + the coded pages' key codes. "
            f"vs dense / vs {_peer_name(rows)} / vs transformers: tok/s over "
            "that configuration's at the same length and batch.",
            "",
            *table_lines(rows),
            "",
            *[f"Not measured (failed): {name}: {error}" for name, error in meta.get("errors", {}).items()],
        ]
    )
    (out / "RESULTS.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if rows:  # every configuration failed: nothing to draw
        plot(rows, out / "speed.png")
    return text


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    markers = "os^vD<>xP*"
    names = sorted({r["config"] for r in rows}, key=config_order)
    for i, name in enumerate(names):
        mine = [r for r in rows if r["config"] == name]
        ax.scatter(
            [r["pages_per_step"] for r in mine], [r["step_s"] * 1e3 for r in mine], marker=markers[i % 10], label=name
        )
    limit = sorted(rows, key=lambda r: r["pages_per_step"])
    ax.plot(
        [r["pages_per_step"] for r in limit],
        [r["read_once_s"] * 1e3 for r in limit],
        "k--",
        lw=1,
        label="weights + KV read once",
    )
    ax.set_xscale("symlog", linthresh=10)
    ax.set_yscale("log")
    ax.set_xlabel("pages read per layer and step (batch total)")
    ax.set_ylabel("decode step, ms")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--lengths",
        default="64,2048,4096,7500",
        help="prompt tokens; every server gets --context-length = the longest + --new-tokens + a page "
        "(the model's max_position_embeddings must allow it: 8192 for the embedded SmolLM2)",
    )
    ap.add_argument("--batches", default="1,4,8", help="requests decoding at once")
    ap.add_argument(
        "--configs",
        default=None,
        help=f"from {', '.join(ALL_CONFIGS)}, hot-<percent>, {PEER_PREFIX}<SGLang attention backend> "
        f"(default: all of them and {DEFAULT_PEER['torch_cpu']} on torch_cpu; on torch_cuda "
        f"{DEFAULT_PEER['torch_cuda']}, dense and the hot set)",
    )
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per request")
    ap.add_argument("--threshold", type=int, default=1024, help="--hot-set-threshold of the hot-set server")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each row, profile this many of its decode steps (SGLang's /start_profile) and write "
        "profile_<row>.md: the trace's kernels by name (0: none)",
    )
    ap.add_argument("--hicache-ratio", type=float, default=1.5, help="host pool size over the device pool's")
    ap.add_argument(
        "--no-hicache",
        action="store_true",
        help="servers without --enable-hierarchical-cache (on a GPU its pinned host pool slows start-up; "
        "the hot set then keeps every page on the device)",
    )
    ap.add_argument("--platform", default="torch_cpu", choices=sorted(DEFAULT_BACKEND), help="SGLANG_PLATFORM")
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="the plugin's backend of the dense and hot-set servers (default: importance_torch on torch_cpu, "
        "importance_triton on torch_cuda)",
    )
    ap.add_argument("--model-path", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for the prompts (default: --model-path)")
    ap.add_argument(
        "--server-args",
        default="",
        help='flags appended to every server\'s, e.g. "--load-format dummy --skip-tokenizer-init"',
    )
    ap.add_argument("--smoke", action="store_true", help="tiny grid: lengths 64,512, batches 1,2, 8 tokens")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench_speed_")))
    a = ap.parse_args()
    if a.smoke:
        a.lengths, a.batches, a.new_tokens, a.threshold = "64,512", "1,2", 8, 256
    if a.new_tokens < 3:
        ap.error("--new-tokens must be at least 3")
    if a.profile_steps < 0 or (a.profile_steps and a.new_tokens < 2 * a.profile_steps + 8):
        ap.error("--profile-steps: at least 0, and --new-tokens at least 2 x it + 8 (the profiled run's room)")
    a.attention_backend = a.attention_backend or DEFAULT_BACKEND[a.platform]
    a.bandwidth_device = "cuda" if a.platform == "torch_cuda" else "cpu"
    if a.configs is None:
        plugin = ALL_CONFIGS if a.platform == "torch_cpu" else ("dense", "hot-dense", "hot-10", "hot-20", "hot-30")
        a.configs = ",".join((DEFAULT_PEER[a.platform], *plugin))
    lengths = [int(x) for x in a.lengths.split(",")]
    batches = sorted({int(x) for x in a.batches.split(",")})
    try:
        configs = [parse_config(c) for c in a.configs.split(",") if c]
        extra = shlex.split(a.server_args)
    except ValueError as e:
        ap.error(str(e))
    if any(c["server"] is None for c in configs):
        # transformers loads the folder's weights on the CPU: with dummy weights, or beside
        # servers on a GPU, it is no peer of theirs.
        if load_format(extra) == "dummy":
            ap.error("--configs transformers needs real weights: it cannot run with --load-format dummy")
        if a.platform != "torch_cpu":
            ap.error(f"--configs transformers runs on the CPU only; on {a.platform} use {DEFAULT_PEER[a.platform]}")
    a.out.mkdir(parents=True, exist_ok=True)
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)
    print(f"server logs in {logs}", flush=True)
    started = time.time()
    model_dir = a.model_path or model_path()
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or model_dir)
    except (OSError, ValueError) as e:
        sys.exit(f"no tokenizer in {a.tokenizer or model_dir} for the prompts ({e}); pass --tokenizer DIR")
    prompts = make_prompts(tokenizer, lengths, max(batches))
    model_config = AutoConfig.from_pretrained(model_dir).to_dict()
    shape = model_shape(model_config)
    top = max(max(ids) for ps in prompts.values() for ids in ps)
    if top >= shape["vocab"]:
        sys.exit(f"the tokenizer's ids reach {top}, past the model's vocabulary of {shape['vocab']}")
    most = model_config.get("max_position_embeddings")
    if most is not None and context_length(lengths, a.new_tokens) > most:
        # SGLang refuses such a server at start-up (every config would fail after its load).
        longest = most - a.new_tokens - PAGE
        sys.exit(f"--lengths {max(lengths)} + --new-tokens {a.new_tokens} + a page exceed the model's {most} "
                 f"positions: at most {longest}")  # fmt: skip
    # The rows' pages per KV page (the hot-set server's pool makes room for them): a sixteenth
    # for the ranges, one in 4 x element size - 1 for the codes.
    from sgl_importance.hot_set.guard.key_codes import code_rows_per_page

    guard_share = 1 / PAGE + 1 / code_rows_per_page(DTYPE_BYTES[a.dtype])
    rows: list[dict] = []
    errors: dict[str, str] = {}
    if max(lengths) <= a.threshold:
        # Hot-set rows run only above the threshold; say so rather than leave them out unseen.
        for c in configs:
            if c["hot_set"] is not None:
                errors[c["name"]] = f"skipped: no --lengths above --threshold {a.threshold}"
                print(f"{c['name']}: {errors[c['name']]}", file=sys.stderr, flush=True)
        configs = [c for c in configs if c["name"] not in errors]  # no server started for nothing
    steps = [("transformers", [c for c in configs if c["server"] is None])]
    kinds = [c["server"] for c in configs if c["server"] and c["server"].startswith(PEER_PREFIX)]
    # The plugin's servers before the peers: a run cut short keeps the rows it is for.
    steps += [(kind, [c for c in configs if c["server"] == kind]) for kind in (*SERVER_KINDS, *kinds)]
    for kind, mine in steps:
        if not mine:
            continue
        # One measurement failing (a server that does not start) leaves the others' rows,
        # and this one's rows measured before the failure.
        try:
            if kind == "transformers":
                rows += measure_transformers(model_dir, prompts, batches, a)
            else:
                measure_server(kind, mine, model_dir, prompts, batches, a, logs, guard_share, rows)
        except Exception as e:  # noqa: BLE001 - recorded per configuration in results.json
            print(f"{kind} failed: {e!r}", file=sys.stderr, flush=True)
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (log: {logs}/server_{kind}.log)"
            errors.update({c["name"]: error for c in mine})
        (a.out / "rows-partial.json").write_text(json.dumps(rows))
    import platform

    import torch

    peer = next((c["name"] for c in configs if c["name"].startswith(PEER_PREFIX)), None)
    rows = complete_rows(rows, shape, DTYPE_BYTES[a.dtype], a.new_tokens, peer=peer)
    gpu = a.bandwidth_device == "cuda"
    meta = {
        "command": "python -m benchmark.long_context.bench_speed " + shlex.join(sys.argv[1:]),
        "minutes": (time.time() - started) / 60,
        "machine": f"{platform.machine()}, {_cpu_name()}, {torch.get_num_threads()} torch threads"
        + (f", {torch.cuda.get_device_name()}" if gpu else ""),
        "model": Path(model_dir).name,
        "dtype": a.dtype,
        "new_tokens": a.new_tokens,
        "threshold": a.threshold,
        "platform": a.platform,
        "attention_backend": a.attention_backend,
        "server_args": a.server_args,
        "no_hicache": a.no_hicache,
        "context_length": context_length(lengths, a.new_tokens),
        "bandwidth": "a 256 MiB device-to-device copy timed with CUDA events" if gpu else "a 256 MiB tensor copy",
        "weight_bytes": weight_bytes(shape, DTYPE_BYTES[a.dtype]),
        "kv_bytes_per_page": kv_bytes_per_page(shape, DTYPE_BYTES[a.dtype]),
        "errors": errors,
    }
    write_report(rows, meta, a.out)
    print(f"{a.out}/RESULTS.md, results.json; server logs in {logs}\n")
    print(short_table(rows, errors))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
