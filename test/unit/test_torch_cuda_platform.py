"""The torch_cuda platform, checked on a CPU: SGLang's CUDA import path runs on the shim.

The import test runs in a fresh interpreter (``test/support/fake_cuda_imports.py``) that
tells torch a CUDA device is there, so SGLang's modules take their ``is_cuda()`` branches.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sgl_importance.platform import activate
from sgl_importance.platform.cuda_shim import shim_dir

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture(scope="module")
def cuda_import_report() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim_dir()), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "fake_cuda_imports.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT ") :])


def shim_names() -> dict[str, tuple[str, ...]]:
    names = runpy.run_path(str(shim_dir() / "sgl_kernel" / "names.py"))
    return {**names["KERNELS"], **names["QUERIES"]}


def test_sglang_serving_modules_import_on_the_shim_with_cuda_present(cuda_import_report):
    assert cuda_import_report["is_shim"], cuda_import_report["sgl_kernel_file"]
    assert cuda_import_report["failed"] == {}
    assert cuda_import_report["platform"] == "TorchCudaPlatform"
    assert cuda_import_report["out_of_tree"] is True


def test_the_shim_provides_exactly_the_names_sglang_imports(cuda_import_report):
    # Short: an import above would fail. Long: a name nothing binds is dead weight that
    # would hide a change in what SGLang imports.
    expected = {module: sorted(names) for module, names in shim_names().items()}
    assert cuda_import_report["bound"] == expected


def test_every_fused_op_of_a_llama_layer_resolves_to_its_native_form(cuda_import_report):
    assert "dispatch_error" not in cuda_import_report, cuda_import_report.get("dispatch_error")
    assert cuda_import_report["dispatch"] == {
        "RMSNorm": "forward_native",
        "SiluAndMul": "forward_native",
        "RotaryEmbedding": "forward_native",
    }


def test_a_shim_kernel_refuses_to_run_and_says_why():
    sys.path.insert(0, str(shim_dir()))
    try:
        from sgl_kernel import rmsnorm
        from sgl_kernel.refuse import ShimKernelCalled
        from sgl_kernel.utils import is_arch_support_pdl
    finally:
        sys.path.remove(str(shim_dir()))
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]
    with pytest.raises(ShimKernelCalled, match="sgl_kernel.rmsnorm was called.*torch_cuda"):
        rmsnorm(None, None)
    assert is_arch_support_pdl() is False


def test_torch_cuda_activates_only_by_name_and_only_with_a_gpu(monkeypatch):
    import torch

    monkeypatch.setenv("SGLANG_PLATFORM", "torch_cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert activate() is None  # SGLang then says the hardware is not available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert activate() == "sgl_importance.platform.torch_cuda.TorchCudaPlatform"


def server_args(**overrides):
    fields = dict(
        attention_backend=None,
        prefill_attention_backend=None,
        decode_attention_backend=None,
        sampling_backend=None,
        disable_cuda_graph=False,
        disable_decode_cuda_graph=False,
        disable_prefill_cuda_graph=False,
        disable_custom_all_reduce=False,
        device=None,
        enable_hierarchical_cache=False,
        hicache_mem_layout="layer_first",
        hicache_io_backend="kernel",
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.fixture
def platform():
    from sgl_importance.platform.torch_cuda import TorchCudaPlatform

    return TorchCudaPlatform()


def test_defaults_pick_triton_importance_attention_torch_sampling_and_decode_graphs_only(platform):
    args = server_args()
    platform.apply_server_args_defaults(args)
    assert args.attention_backend == "importance_triton"
    assert args.sampling_backend == "pytorch"
    assert (args.disable_cuda_graph, args.disable_decode_cuda_graph, args.disable_prefill_cuda_graph) == (
        False, False, True,
    )  # fmt: skip
    assert args.device == "cuda"
    assert platform.get_default_attention_backend() == "importance_triton"
    assert str(platform.get_group_coordinator_device(1)) == "cuda:1"
    assert platform.get_device(0) == "cuda:0"


def test_sglangs_kernel_version_check_is_skipped_only_without_sglang_kernel(platform, monkeypatch):
    from sgl_importance.platform import torch_cuda

    monkeypatch.delenv("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", raising=False)
    monkeypatch.setattr(torch_cuda, "sgl_kernel_installed", lambda: True)
    platform.apply_server_args_defaults(server_args())
    assert "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK" not in os.environ
    monkeypatch.setattr(torch_cuda, "sgl_kernel_installed", lambda: False)
    platform.apply_server_args_defaults(server_args())
    assert os.environ["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] == "1"


def test_sglangs_triton_backend_is_allowed_as_the_peer(platform):
    args = server_args(attention_backend="triton")
    platform.apply_server_args_defaults(args)
    assert args.attention_backend == "triton"


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(attention_backend="flashinfer"), "--attention-backend 'flashinfer'"),
        (dict(decode_attention_backend="fa3"), "--attention-backend 'fa3'"),
        (dict(sampling_backend="flashinfer"), "--sampling-backend 'flashinfer'"),
        (dict(enable_hierarchical_cache=True, hicache_mem_layout="page_head"), "--hicache-mem-layout"),
    ],
)
def test_choices_that_need_compiled_kernels_are_refused_at_start_up(platform, overrides, flag):
    with pytest.raises(ValueError, match=flag):
        platform.apply_server_args_defaults(server_args(**overrides))


def test_run_time_compiled_paths_are_turned_off_only_on_torch_cuda(monkeypatch):
    from sgl_importance import plugin
    from sgl_importance.platform.torch_cuda import no_compiled_kernel, no_dual_gemm

    rows = {h.target: h for h in plugin.HOOKS if h.process == "torch_cuda"}
    assert set(rows) == {
        "mem_cache.memory_pool.can_use_store_cache",
        "mem_cache.pool_host.mha.can_use_hicache_jit_kernel",
        "layers.dual_gemm.DualGemm._select_mode",
        "server_args.ServerArgs.from_cli_args",
    }
    assert no_compiled_kernel(lambda *a, **k: True) is False
    assert no_dual_gemm(lambda *a, **k: "mode") is None
    monkeypatch.setenv("SGLANG_PLATFORM", "torch_cuda")
    assert plugin._in_process("torch_cuda") and plugin._in_process("native")
    assert not plugin._in_process("torch_cpu")
    monkeypatch.setenv("SGLANG_PLATFORM", "torch_cpu")
    assert not plugin._in_process("torch_cuda") and plugin._in_process("native")


@pytest.mark.parametrize("selected", ["torch_cpu", "torch_cuda", None])
def test_the_plugin_loads_whichever_platform_is_selected(monkeypatch, selected):
    # SGLang skips the general plugins of a distribution that offers a platform other
    # than the selected one; each platform's distribution must carry the plugin.
    from importlib.metadata import entry_points

    from sglang.srt.plugins import _get_excluded_dists

    if selected is None:
        monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PLATFORM", selected)
    excluded = _get_excluded_dists()
    loaded = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.dist.name not in excluded]
    assert [ep.value for ep in loaded if ep.name == "importance"], f"plugin skipped: {excluded=}"
    assert {ep.value for ep in loaded if ep.name == "importance"} == {"sgl_importance.plugin:load"}


def test_launcher_flags_capture_decode_graphs_unless_turned_off_and_never_prefill_graphs():
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sgl_importance.platform.torch_cuda import graph_backends

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)

    def resolved(*flags):
        args = parser.parse_args(["--model-path", "m", *flags])
        graph_backends(args)
        return args.cuda_graph_backend_prefill, args.cuda_graph_backend_decode

    assert resolved() == ("disabled", "full")
    assert resolved("--disable-cuda-graph") == ("disabled", "disabled")
    assert resolved("--disable-decode-cuda-graph") == ("disabled", "disabled")
    assert resolved("--cuda-graph-backend-decode", "disabled") == ("disabled", "disabled")
    assert resolved("--cuda-graph-backend-prefill", "disabled") == ("disabled", "full")
    # Backends without graph support decode eagerly, and refuse graphs asked for.
    assert resolved("--attention-backend", "torch_native") == ("disabled", "disabled")
    assert resolved("--attention-backend", "triton") == ("disabled", "full")
    assert resolved("--attention-backend", "triton", "--decode-attention-backend", "torch_native") == (
        "disabled", "disabled",
    )  # fmt: skip
    with pytest.raises(ValueError, match="'torch_native' attention backend cannot be captured"):
        resolved("--attention-backend", "torch_native", "--cuda-graph-backend-decode", "full")
    with pytest.raises(ValueError, match="--cuda-graph-backend-decode 'breakable'.*torch_cuda"):
        resolved("--cuda-graph-backend-decode", "breakable")
    with pytest.raises(ValueError, match="--cuda-graph-backend-prefill 'full'.*torch_cuda"):
        resolved("--cuda-graph-backend-prefill", "full")


def test_without_the_launchers_check_graphs_with_a_backend_that_cannot_capture_are_refused(platform):
    with pytest.raises(ValueError, match="'importance_torch' attention backend cannot be captured"):
        platform.apply_server_args_defaults(server_args(attention_backend="importance_torch"))
    args = server_args(attention_backend="importance_torch", cuda_graph_backend_decode="disabled")
    platform.apply_server_args_defaults(args)
    assert args.disable_decode_cuda_graph


@pytest.mark.parametrize(
    "flags,decode_graphs",
    [({}, True), ({"cuda_graph_backend_decode": "full"}, True), ({"cuda_graph_backend_decode": "disabled"}, False),
     ({"disable_cuda_graph": True}, False), ({"disable_decode_cuda_graph": True}, False)],
)  # fmt: skip
def test_decode_graphs_stay_on_unless_turned_off_and_prefill_graphs_stay_off(platform, flags, decode_graphs):
    args = server_args(**flags)
    platform.apply_server_args_defaults(args)
    want = (not decode_graphs, not decode_graphs, True)
    assert (args.disable_cuda_graph, args.disable_decode_cuda_graph, args.disable_prefill_cuda_graph) == want


def test_decode_graphs_capture_with_sglangs_own_cuda_runner(platform):
    # SGLang captures a decode graph on an out-of-tree platform only when it declares
    # graph_capture and names its runner (a GPU run with neither captured nothing).
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    assert platform.capabilities.graph_capture
    assert platform.get_graph_runner_cls() is DecodeCudaGraphRunner
