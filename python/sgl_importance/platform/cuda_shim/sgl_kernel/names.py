"""Every name the shim provides, per module: exactly what SGLang 0.5.23 imports at module load
on a CUDA machine (found by importing its serving modules with ``is_cuda()`` true;
``test/unit/test_torch_cuda_imports.py`` checks the list is neither short nor long).

Kept free of imports so that the test can read it without putting the shim on the path.
"""

from __future__ import annotations

# Kernels: on torch_cuda SGLang's fused ops run forward_native, sampling runs in PyTorch,
# the HiCache host pool copies with torch and the GGUF path is never taken.
KERNELS: dict[str, tuple[str, ...]] = {
    "sgl_kernel": (
        "fused_add_rmsnorm",
        "gelu_and_mul",
        "gelu_tanh_and_mul",
        "gemma_fused_add_rmsnorm",
        "gemma_rmsnorm",
        "int8_scaled_mm",
        "moe_sum",
        "moe_sum_reduce",
        "rmsnorm",
        "silu_and_mul",
        "top_k_renorm_prob",
        "top_p_renorm_prob",
    ),
    "sgl_kernel.quantization": (
        "ggml_dequantize",
        "ggml_moe_a8",
        "ggml_mul_mat_a8",
        "ggml_mul_mat_vec_a8",
    ),
    "sgl_kernel.kvcacheio": (
        "transfer_kv_all_layer",
        "transfer_kv_all_layer_direct_lf_pf",
        "transfer_kv_all_layer_lf_pf",
        "transfer_kv_all_layer_lf_ph",
        "transfer_kv_all_layer_mla",
        "transfer_kv_all_layer_mla_lf_pf",
        "transfer_kv_direct",
        "transfer_kv_per_layer",
        "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_per_layer_mla",
        "transfer_kv_per_layer_mla_pf_lf",
        "transfer_kv_per_layer_pf_lf",
        "transfer_kv_per_layer_ph_lf",
    ),
}

# Queries, answered rather than refused: SGLang's Triton backend asks this when it is
# built. Programmatic dependent launch needs sgl_kernel's launcher, so: no.
QUERIES: dict[str, tuple[str, ...]] = {
    "sgl_kernel.utils": ("is_arch_support_pdl",),
}
