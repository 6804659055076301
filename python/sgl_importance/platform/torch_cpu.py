"""torch_cpu: SGLang on any CPU in pure PyTorch.

SGLang's in-tree CPU platform (``SGLANG_USE_CPU_ENGINE=1``) needs the compiled
``sgl_kernel`` CPU extension. This platform needs nothing compiled: it is an
out-of-tree platform (``PlatformEnum.OOT``), so SGLang's fused ops run their
``forward_native`` torch paths, attention is the plugin's ``importance_torch`` (its C
decode kernel; SGLang's ``torch_native`` SDPA for a model it does not read exactly:
``attention_choice.py``), and the KV pool is sized from a token budget instead of a
fraction of RAM.

It exists for development, CI and demos on machines without a GPU.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Any

import torch
from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from sgl_importance.platform import DISPATCH_KEY
from sgl_importance.platform.attention_choice import FALLBACK_BACKEND, choose_attention_backend

# Without a cap, mem_fraction_static x host RAM becomes tens of millions of KV
# slots (gigabytes zero-filled at start-up) for a 135M model.
DEFAULT_MAX_TOTAL_TOKENS = 32768
# Small prefill chunks keep one long prompt from stalling decode on 2 cores.
DEFAULT_CHUNKED_PREFILL_SIZE = 2048
DEFAULT_MAX_RUNNING_REQUESTS = 64
# SGLang's --hicache-host-memory-fraction default (auto-sizing of the host tier).
SGLANG_HOST_MEMORY_FRACTION = 0.8
# CPU flags (/proc/cpuinfo) of a native bfloat16 dot product: x86 AVX512-BF16 or
# AMX-BF16, Arm's BF16 extension. Without one, torch emulates bf16 matmuls.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})

logger = logging.getLogger(__name__)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty if unknown."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def default_dtype(flags: frozenset[str]) -> str:
    """``--dtype`` when the user left it ``auto``: float32 unless bf16 is native.

    A bf16 checkpoint (SmolLM2's) makes ``auto`` bf16, and on a CPU without bf16
    instructions torch emulates its matmuls: 20 vs 163 GFLOPS for a 2048 x 576 x 1536
    linear on this project's 2-core AVX2 machines, a 4K-token prefill 54 s vs 14 s.
    """
    return "auto" if flags & BF16_CPU_FLAGS else "float32"


def fork_children(*_: Any) -> None:
    """After SGLang's ``_set_envs_and_config`` (``entrypoints/engine.py``) chose "spawn" for the
    scheduler and detokenizer: "fork". Spawn keeps a parent's CUDA context out of its children;
    on torch_cpu there is none, and a spawned child imports SGLang, torch and transformers again
    (a server was ready in ~36 s spawned, ~25 s forked, on a 2-core VM). A forked child registers
    the rows of a scheduler process at the fork (``plugin._register``)."""
    multiprocessing.set_start_method("fork", force=True)
    # Only the launcher's children: a process a scheduler starts through multiprocessing is spawned as before.
    os.register_at_fork(after_in_child=lambda: multiprocessing.set_start_method("spawn", force=True))


class TorchCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """Out-of-tree CPU platform with no compiled SGLang kernels."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    # Nothing here can launch Triton, replay CUDA graphs or run the sgl_kernel
    # HiCache transfer kernels; SGLang picks torch fallbacks from these.
    capabilities = PlatformCapabilities()

    def get_device(self, device_id: int = 0) -> str:
        # SGLang's server-args resolution treats the answer as a device string
        # ("cuda:0".split(":")); torch accepts the string wherever a device goes.
        return self.device_type

    def is_pin_memory_available(self, device: Any = None) -> bool:
        return False

    def get_default_attention_backend(self) -> str:
        # What SGLang falls back to where it asks without the model in view (the
        # defaults below choose per model first). On hosts with AMX, SGLang would
        # otherwise pick `intel_amx`, which needs the compiled CPU kernels.
        return FALLBACK_BACKEND

    def apply_server_args_defaults(self, server_args: Any) -> None:
        """Defaults for a CPU without compiled kernels; explicit flags win."""
        if server_args.max_total_tokens is None:
            server_args.max_total_tokens = DEFAULT_MAX_TOTAL_TOKENS
        if server_args.chunked_prefill_size is None:
            server_args.chunked_prefill_size = DEFAULT_CHUNKED_PREFILL_SIZE
        if server_args.max_running_requests is None:
            server_args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
        # importance_torch where it reads the model exactly, else torch_native (one line why).
        choose_attention_backend(server_args)
        if server_args.dtype == "auto":
            server_args.dtype = default_dtype(cpu_flags())
            if server_args.dtype != "auto":
                logger.info("torch_cpu: --dtype %s (this CPU has no native bfloat16 matmul)", server_args.dtype)
        server_args.disable_cuda_graph = True
        if server_args.enable_hierarchical_cache:
            from sgl_importance.platform.host_pool import check_hicache_support

            check_hicache_support(server_args.hicache_mem_layout, server_args.hicache_io_backend)
            if server_args.hicache_host_memory_fraction == SGLANG_HOST_MEMORY_FRACTION:
                # SGLang sizes the host tier from the RAM left after a 10 GiB reserve
                # meant for GPU servers, and refuses to start on a small machine. Here
                # the device pool is itself RAM, bounded by --max-total-tokens, so keep
                # SGLang's default ratio (host pool = 2 x device pool) instead.
                server_args.hicache_host_memory_fraction = None
        if server_args.device is None:
            server_args.device = "cpu"

    def get_dispatch_key_name(self) -> str:
        return DISPATCH_KEY

    # SGLang's /start_profile asks an out-of-tree platform for its profiler activity; the
    # mixin's answer is NotImplementedError, raised in the scheduler: the server went down.
    def get_torch_profiler_activity_str(self) -> str:
        return "CPU"

    def get_torch_profiler_activity(self) -> torch.profiler.ProfilerActivity:
        return torch.profiler.ProfilerActivity.CPU
