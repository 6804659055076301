"""torch_cuda: SGLang on a CUDA GPU with no compiled SGLang kernels.

Stock SGLang's CUDA path imports ``sgl_kernel`` (373 MB) at module load. On an
out-of-tree platform SGLang's fused ops (norms, activations, rotary) resolve to
their ``forward_native`` torch forms, so with the names SGLang imports provided
by a shim (``cuda_shim/``) the server runs on a GPU with PyTorch, Triton and the
plugin's Triton attention alone. The plugin turns off the paths that would
compile CUDA at run time (the KV store kernel, the HiCache transfer kernel, the
CuTe dual GEMM); the HiCache host pool is pinned and copies with torch.

It is the way to serve where ``sgl-kernel`` cannot be installed (a bundle that
must stay small, a new CUDA or torch); it is not SGLang's fast path.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from sglang.srt.platforms.cuda import CudaDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from sgl_importance.env import SKIP_KERNEL_VERSION_CHECK_ENV
from sgl_importance.platform import DISPATCH_KEY

DEFAULT_ATTENTION_BACKEND = "importance_triton"
# Attention backends whose kernels are Triton (or torch) only; the others need
# sgl_kernel, FlashInfer or FlashAttention wheels that this platform does without.
ATTENTION_BACKENDS = ("importance_triton", "importance_torch", "triton", "torch_native")
SAMPLING_BACKEND = "pytorch"
GRAPHS_OFF = "disabled"  # SGLang's --cuda-graph-backend-{prefill,decode} values
DECODE_GRAPHS = "full"
# Attention backends that capture decode graphs (torch_native and importance_torch do not).
GRAPH_ATTENTION_BACKENDS = ("importance_triton", "triton")

logger = logging.getLogger(__name__)


def check_attention_backend(name: str | None) -> None:
    if name is not None and name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"--attention-backend {name!r} is not supported on the torch_cuda platform "
            f"(it needs compiled kernels this platform does without); choose one of "
            f"{', '.join(ATTENTION_BACKENDS)}"
        )


def sgl_kernel_installed() -> bool:
    """Whether the real ``sglang-kernel`` distribution is installed (the shim has no metadata)."""
    try:
        version("sglang-kernel")
    except PackageNotFoundError:
        return False
    return True


def no_compiled_kernel(original: Any) -> bool:
    """Around SGLang's ``can_use_*`` probes of a JIT CUDA kernel: no, use the torch path.

    The probe would compile with nvcc on first use (and needs packages the bundle
    leaves out); the platform promises nothing compiled at run time.
    """
    return False


def graph_backends(args: Any) -> None:
    """Launcher check: decode graphs (``full``) unless turned off; prefill graphs never.

    SGLang resolves its graph configuration before it asks the platform for defaults, so
    ``apply_server_args_defaults`` is too late for it (seen on an H200: the prefill graph
    was captured and failed); the launcher's parsed flags are where to say it. Decode
    graphs of SGLang's native ops captured and replayed on an H200 with the same greedy
    output (benchmark/gpu/RESULTS.md); ``--disable-cuda-graph``,
    ``--disable-decode-cuda-graph`` or ``--cuda-graph-backend-decode disabled`` turn them off.

    Raises:
        ValueError: a prefill graph backend, or a decode backend other than ``full``
            or ``disabled``, was asked for.
    """
    off = getattr(args, "disable_cuda_graph", False) or getattr(args, "disable_decode_cuda_graph", False)
    backend = decode_attention_backend(args)
    if backend not in GRAPH_ATTENTION_BACKENDS:
        if getattr(args, "cuda_graph_backend_decode", None) == DECODE_GRAPHS:
            raise uncapturable(backend, "--cuda-graph-backend-decode full")
        off = True
    defaults = {
        "cuda_graph_backend_prefill": GRAPHS_OFF,
        "cuda_graph_backend_decode": GRAPHS_OFF if off else DECODE_GRAPHS,
    }
    for flag, allowed in (("cuda_graph_backend_prefill", (GRAPHS_OFF,)),
                          ("cuda_graph_backend_decode", (GRAPHS_OFF, DECODE_GRAPHS))):  # fmt: skip
        chosen = getattr(args, flag, None)
        if chosen is not None and chosen not in allowed:
            raise ValueError(
                f"--{flag.replace('_', '-')} {chosen!r}: not supported on the torch_cuda platform "
                f"(it runs without SGLang's compiled kernels); use {' or '.join(map(repr, allowed))}"
            )
        setattr(args, flag, chosen or defaults[flag])


def decode_attention_backend(args: Any) -> str:
    """The attention backend decode runs with: ``--decode-attention-backend``, else
    ``--attention-backend``, else the platform's default."""
    return (
        getattr(args, "decode_attention_backend", None)
        or getattr(args, "attention_backend", None)
        or DEFAULT_ATTENTION_BACKEND
    )


def uncapturable(backend: str, asked: str) -> ValueError:
    """The error for decode graphs asked for (``asked``) with a backend that cannot be captured."""
    return ValueError(
        f"{asked}: the {backend!r} attention backend cannot be captured in a CUDA graph on torch_cuda; "
        f"use one of {', '.join(GRAPH_ATTENTION_BACKENDS)}, or turn decode graphs off "
        f"(--cuda-graph-backend-decode disabled)"
    )


def no_dual_gemm(original: Any) -> None:
    """Around ``DualGemm._select_mode``: no fused mode (the CuTe DSL kernel is not installed)."""
    return None


class TorchCudaPlatform(CudaDeviceMixin, SRTPlatform):
    """Out-of-tree CUDA platform: SGLang's native ops, Triton attention, torch sampling."""

    _enum = PlatformEnum.OOT
    device_name = "cuda"
    device_type = "cuda"
    # Triton launches here. No prefill graphs (SGLang's breakable capture, without sgl_kernel,
    # failed on an H200: benchmark/gpu/RESULTS.md), full decode graphs, no sgl_kernel
    # HiCache kernels, and PyNccl is not needed for one GPU.
    capabilities = PlatformCapabilities(supports_triton=True, graph_capture=True)

    def get_device(self, device_id: int = 0) -> str:
        # SGLang's server-args resolution splits the answer as a string ("cuda:0").
        return f"cuda:{device_id}"

    def get_graph_runner_cls(self) -> type:
        # SGLang's own CUDA decode runner (full graphs of its native ops); consulted only
        # where decode graphs are on (graph_backends: the default with importance_triton/triton).
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

        return DecodeCudaGraphRunner

    def get_default_attention_backend(self) -> str:
        return DEFAULT_ATTENTION_BACKEND

    def get_group_coordinator_device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    def apply_server_args_defaults(self, server_args: Any) -> None:
        """Defaults for a GPU without compiled SGLang kernels; explicit choices are checked."""
        if server_args.attention_backend is None:
            server_args.attention_backend = DEFAULT_ATTENTION_BACKEND
        for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            check_attention_backend(getattr(server_args, flag, None))
        if server_args.sampling_backend not in (None, SAMPLING_BACKEND):
            raise ValueError(
                f"--sampling-backend {server_args.sampling_backend!r} is not supported on the "
                f"torch_cuda platform (it needs FlashInfer); use {SAMPLING_BACKEND!r}"
            )
        server_args.sampling_backend = SAMPLING_BACKEND
        decode_graphs = (
            getattr(server_args, "cuda_graph_backend_decode", None) in (None, DECODE_GRAPHS)
            and not server_args.disable_cuda_graph
            and not server_args.disable_decode_cuda_graph
        )
        if decode_graphs and decode_attention_backend(server_args) not in GRAPH_ATTENTION_BACKENDS:
            # Reached without the launcher's check (which turns them off for these): SGLang
            # resolved its graph configuration already and would fail capturing.
            raise uncapturable(decode_attention_backend(server_args), "decode graphs on")
        server_args.disable_cuda_graph = not decode_graphs
        server_args.disable_decode_cuda_graph = not decode_graphs
        server_args.disable_prefill_cuda_graph = True
        server_args.disable_custom_all_reduce = True
        if server_args.enable_hierarchical_cache:
            from sgl_importance.platform.host_pool import check_hicache_support

            check_hicache_support(server_args.hicache_mem_layout, server_args.hicache_io_backend)
        if server_args.device is None:
            server_args.device = "cuda"
        if not sgl_kernel_installed():
            # SGLang's launcher requires sglang-kernel >= 0.4.9 on CUDA; this platform calls none
            # of it, so it uses SGLang's own switch for that check (read when the engine starts).
            os.environ[SKIP_KERNEL_VERSION_CHECK_ENV] = "1"

    def get_dispatch_key_name(self) -> str:
        return DISPATCH_KEY

    # SGLang's /start_profile asks an out-of-tree platform for its profiler activity (the
    # mixin raises, in the scheduler); CUDA also answers a request's "GPU".
    def get_torch_profiler_activity_str(self) -> str:
        return "CUDA"

    def get_torch_profiler_activity(self) -> torch.profiler.ProfilerActivity:
        return torch.profiler.ProfilerActivity.CUDA
