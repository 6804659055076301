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


def test_defaults_cap_the_pool_and_pick_the_plugins_decode(platform, monkeypatch):
    from sgl_importance.platform import attention_choice

    monkeypatch.setattr(attention_choice, "model_config_for", lambda args: model_config())
    args = server_args()
    platform.apply_server_args_defaults(args)
    assert args.max_total_tokens == 32768
    assert args.attention_backend == "importance_torch"
    assert args.disable_cuda_graph is True
    assert args.device == "cpu"


def model_config(**overrides):
    """What ``unserved`` reads of SGLang's ``ModelConfig``: a plain decoder by default."""
    fields = dict(
        attention_arch=SimpleNamespace(name="MHA"),
        is_encoder_decoder=False,
        is_hybrid_swa=False,
        sliding_window_size=None,
        attention_chunk_size=None,
        linear_attn_registry_result=None,
        use_alibi=False,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def choose(config=None, fails=None, **flags):
    from sgl_importance.platform.attention_choice import choose_attention_backend

    args = SimpleNamespace(
        model_path="m", attention_backend=None, prefill_attention_backend=None, decode_attention_backend=None
    )
    vars(args).update(flags)

    def config_of(_):
        if fails is not None:
            raise fails
        return config if config is not None else model_config()

    choose_attention_backend(args, config_of)
    return args


@pytest.mark.parametrize(
    "unset",
    [None, "intel_amx"],  # intel_amx: SGLang's CPU default, set before the platform's defaults run
)
def test_a_plain_decoder_gets_importance_torch_when_no_backend_is_named(unset):
    assert choose(attention_backend=unset).attention_backend == "importance_torch"


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (dict(sliding_window_size=4096), "sliding attention window"),
        (dict(is_hybrid_swa=True), "sliding attention window"),
        (dict(is_encoder_decoder=True), "encoder-decoder"),
        (dict(attention_chunk_size=8192), "local chunks"),
        (dict(linear_attn_registry_result=object()), "linear-attention"),
        (dict(attention_arch=SimpleNamespace(name="MLA")), "MLA"),
    ],
)
def test_a_model_it_does_not_read_exactly_falls_back_to_torch_native_with_one_line(overrides, reason, caplog):
    with caplog.at_level("INFO", logger="sgl_importance.platform.attention_choice"):
        args = choose(model_config(**overrides))
    assert args.attention_backend == "torch_native"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and reason in lines[0] and "importance_torch" in lines[0]


def test_an_unreadable_configuration_falls_back_to_torch_native():
    assert choose(fails=OSError("no config.json")).attention_backend == "torch_native"


@pytest.mark.parametrize("flag", ["attention_backend", "decode_attention_backend", "prefill_attention_backend"])
def test_importance_torch_named_for_a_model_it_cannot_read_is_a_start_up_error(flag):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} importance_torch cannot serve m: .*MLA"):
        choose(model_config(attention_arch=SimpleNamespace(name="MLA")), **{flag: "importance_torch"})


def test_importance_torch_named_for_a_windowed_model_keeps_its_per_layer_fallback():
    args = choose(model_config(sliding_window_size=4096), attention_backend="importance_torch")
    assert args.attention_backend == "importance_torch"


def test_another_named_backend_is_left_to_sglang():
    assert choose(fails=AssertionError("not read"), attention_backend="torch_native").attention_backend == (
        "torch_native"
    )


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
