"""scripts/bundle_gpu.py: the GPU bundle keeps every module the server imported and carries
every distribution the GPU image lacks (checked against the recorded --discover run; no
network, no downloads)."""

import json

from support.scripts import load_script

bundle_gpu = load_script("bundle_gpu")

RECORDED = json.loads(bundle_gpu.MODULES_FILE.read_text())


def test_trimmed_sglang_keeps_a_file_for_every_module_the_server_imported():
    missing = []
    for module in RECORDED["sglang_modules"]:
        candidates = bundle_gpu.module_file_candidates(module)
        # A namespace package or a module that failed to import has neither file: only
        # a file the installed package has and the trim drops is a loss.
        if not any(bundle_gpu.sglang_keeps(path) for path in candidates):
            missing.append(module)
    assert not missing, missing[:20]


def test_trim_drops_diffusion_tests_and_compiled_extensions_only():
    assert not bundle_gpu.sglang_keeps("sglang/multimodal_gen/runtime/entrypoints/cli.py")
    assert not bundle_gpu.sglang_keeps("sglang/test/test_utils.py")
    assert not bundle_gpu.sglang_keeps("sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so")
    assert not bundle_gpu.sglang_keeps("sglang/srt/__pycache__/environ.cpython-311.pyc")
    for kept in (
        "sglang/srt/models/llama.py",
        "sglang/srt/mem_cache/storage/hf3fs/storage_hf3fs.py",
        "sglang/kernels/jit/csrc/dsa_gfx950/paged_mqa_logits.cuh",
        "sglang/benchmark/serving.py",
        "sglang/srt/layers/attention/triton_backend.py",
    ):
        assert bundle_gpu.sglang_keeps(kept), kept


def test_every_imported_distribution_is_in_the_image_carried_or_explained():
    undecided = [
        dist
        for dist in RECORDED["distributions"]
        if dist not in bundle_gpu.GPU_IMAGE and dist not in bundle_gpu.CARRIED and dist not in bundle_gpu.NOT_CARRIED
    ]
    assert not undecided, undecided


def test_nothing_the_image_has_is_carried():
    assert not set(bundle_gpu.CARRIED) & bundle_gpu.GPU_IMAGE


def test_recorded_run_saw_the_server_the_scheduler_the_llama_path_and_hicache():
    modules = set(RECORDED["sglang_modules"])
    for module in (
        "sglang.srt.entrypoints.http_server",
        "sglang.srt.managers.scheduler",
        "sglang.srt.managers.detokenizer_manager",
        "sglang.srt.models.llama",
        "sglang.srt.mem_cache.hicache_storage",
        "sglang.srt.mem_cache.storage.file",
        # python -m runs the load generator as __main__; its dataset is recorded by name
        "sglang.benchmark.datasets.generated_shared_prefix",
    ):
        assert module in modules, module
