from types import SimpleNamespace

import pytest

from sgl_importance.platform import activate


def test_platform_activates_only_when_selected_by_name(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    assert activate() is None
    monkeypatch.setenv("SGLANG_PLATFORM", "cuda")
    assert activate() is None
    monkeypatch.setenv("SGLANG_PLATFORM", "torch_cpu")
    assert activate() == "sgl_importance.platform.torch_cpu.TorchCpuPlatform"


def server_args(**overrides):
    fields = dict(
        max_total_tokens=None,
        chunked_prefill_size=None,
        max_running_requests=None,
        attention_backend=None,
        disable_cuda_graph=False,
        device=None,
        enable_hierarchical_cache=False,
        hicache_mem_layout="layer_first",
        hicache_io_backend="kernel",
        hicache_host_memory_fraction=0.8,
        dtype="auto",
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.fixture
def platform():
    from sgl_importance.platform.torch_cpu import TorchCpuPlatform

    return TorchCpuPlatform()


def test_defaults_cap_the_pool_and_pick_torch_native(platform):
    args = server_args()
    platform.apply_server_args_defaults(args)
    assert args.max_total_tokens == 32768
    assert args.attention_backend == "torch_native"
    assert args.disable_cuda_graph is True
    assert args.device == "cpu"


def test_explicit_values_win_over_platform_defaults(platform):
    args = server_args(max_total_tokens=1024, attention_backend="importance_torch", chunked_prefill_size=512)
    platform.apply_server_args_defaults(args)
    assert (args.max_total_tokens, args.attention_backend, args.chunked_prefill_size) == (
        1024,
        "importance_torch",
        512,
    )


@pytest.mark.parametrize(
    "layout,io", [("page_head", "kernel"), ("page_unified", "kernel"), ("layer_first", "kernel_ascend")]
)
def test_unsupported_hicache_layout_or_io_backend_is_refused(platform, layout, io):
    args = server_args(enable_hierarchical_cache=True, hicache_mem_layout=layout, hicache_io_backend=io)
    with pytest.raises(ValueError, match="not supported on the torch_cpu and torch_cuda platforms"):
        platform.apply_server_args_defaults(args)


def test_hicache_keeps_the_ratio_instead_of_sglangs_ram_auto_sizing(platform):
    args = server_args(enable_hierarchical_cache=True)
    platform.apply_server_args_defaults(args)
    assert args.hicache_host_memory_fraction is None
    # An explicit fraction still auto-sizes, as in SGLang.
    explicit = server_args(enable_hierarchical_cache=True, hicache_host_memory_fraction=0.5)
    platform.apply_server_args_defaults(explicit)
    assert explicit.hicache_host_memory_fraction == 0.5


def test_platform_reports_no_pinned_memory_and_a_string_device(platform):
    assert platform.is_pin_memory_available() is False
    assert platform.get_device(0) == "cpu"


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({"avx2", "fma"}, "float32"),
        ({"avx2", "avx512f", "avx512_bf16"}, "auto"),
        ({"amx_tile", "amx_bf16"}, "auto"),
        ({"fp", "asimd", "bf16"}, "auto"),
        (set(), "float32"),
    ],
)
def test_dtype_auto_becomes_float32_where_the_cpu_has_no_native_bf16(flags, expected):
    from sgl_importance.platform.torch_cpu import default_dtype

    assert default_dtype(frozenset(flags)) == expected


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo(tmp_path):
    from sgl_importance.platform.torch_cpu import cpu_flags

    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(arm)) == {"fp", "asimd", "bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_an_explicit_dtype_is_kept(platform):
    args = server_args(dtype="bfloat16")
    platform.apply_server_args_defaults(args)
    assert args.dtype == "bfloat16"
