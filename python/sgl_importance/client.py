"""Requests to a running SGLang server, as the end-to-end tests, the benchmarks and
``scripts/collect_traces.py`` send them.

Owns the HTTP side of ``sgl_importance.local_server``: greedy ``/generate`` and
chat requests, a ``/metrics`` scrape, ``/flush_cache``, and the command line of
SGLang's own load generator (``python -m sglang.benchmark.serving``) kept offline.
SGLang is reached only over HTTP or as a subprocess; nothing here imports it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import requests


def greedy(max_new_tokens: int, **sampling: Any) -> dict:
    """``sampling_params`` of a greedy request (temperature 0), plus ``sampling``
    (e.g. ``ignore_eos``, ``custom_params``)."""
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}


def generate(url: str, *, timeout: float = 300, **body: Any) -> dict:
    """POST ``body`` to ``url/generate``.

    Args:
        url: the server's base URL (``LocalServer.url``).
        timeout: seconds the whole request may take.
        body: the request's fields (``text`` or ``input_ids``, ``sampling_params``, ...).

    Returns:
        The response's JSON.

    Raises:
        requests.HTTPError: the server answered with an error status.
    """
    r = requests.post(url + "/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def stream_generate(url: str, *, timeout: float = 600, **body: Any) -> tuple[float, dict]:
    """POST ``body`` to ``url/generate`` with ``stream`` on; returns the seconds to the
    first chunk (the time to first token) and the last chunk (its ``meta_info`` holds the
    cache report when ``return_cached_tokens_details`` was asked for).

    Raises:
        requests.HTTPError: the server answered with an error status.
    """
    start = time.perf_counter()
    first, last = None, {}
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - start
            last = json.loads(line[5:])
    return (first or 0.0), last


def chat(url: str, *, timeout: float = 300, **body: Any) -> dict:
    """POST ``body`` to ``url/v1/chat/completions``; the response's JSON (raises on
    an error status, as ``generate``)."""
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def metrics_text(url: str, timeout: float = 60) -> str:
    """One Prometheus scrape of ``url/metrics`` (read series with
    ``local_server.metric``)."""
    return requests.get(url + "/metrics", timeout=timeout).text


def flush_cache(url: str) -> requests.Response:
    """Ask the server to empty its device and host tiers; the response, whatever its
    status (SGLang refuses while requests are in flight)."""
    return requests.post(url + "/flush_cache", params={"timeout": 60}, timeout=120)


def load_generator(
    port: int, model: str, served_name: str, workload: Sequence[str], output_file: Path, home: Path
) -> tuple[list[str], dict[str, str]]:
    """Command and environment of ``python -m sglang.benchmark.serving`` against the
    server on 127.0.0.1:``port``, offline.

    Args:
        port: the server's port.
        model: the local model folder, given as ``--model`` and ``--tokenizer`` (with a
            served name only, the client would ask the Hugging Face hub for a tokenizer).
        served_name: the server's ``--served-model-name``.
        workload: the dataset flags (``--dataset-name``, ``--num-prompts``, ...).
        output_file: where the client writes its JSON result (with per-request details).
        home: the client's ``HOME``; it caches its generated dataset under it.

    Returns:
        ``(command, environment)`` for ``subprocess.run``.
    """
    command = [
        sys.executable, "-m", "sglang.benchmark.serving",
        "--backend", "sglang",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", model,
        "--served-model-name", served_name,
        "--tokenizer", model,
        *workload,
        # No warm-up request: it would be the stream's first prompt, sent twice.
        "--warmup-requests", "0",
        "--cache-report",
        "--output-file", str(output_file),
        "--output-details",
        "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return command, env
