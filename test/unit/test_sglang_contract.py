"""The contract with the pinned SGLang: every name the plugin relies on, checked on SGLang.

The plugin reads SGLang's objects with plain attribute access (``node.hash_value``,
``cache.tp_world_size``, ...) and a few private names. After an SGLang upgrade a
renamed field would raise somewhere deep in the scheduler, or worse be read through
a fake in the unit tests and pass; this module names each relied-on attribute and
where the plugin uses it, and checks it on SGLang's real classes and modules, so an
upgrade fails here, in one test per name, saying what moved.

How each name is checked, cheapest faithful way first: on a real instance when
SGLang's constructor is cheap (``UnifiedTreeNode``, ``ComponentData``, the launcher's
namespace from SGLang's own parser), as a dataclass field, as a class attribute or
method, or as an assignment ``self.<name> = ...`` in the source of the class or one
of its bases (for objects that need a model or a process group to build).

The fakes in ``test/support/fake_tree.py`` are held to the same names.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from functools import cache
from pathlib import Path
from typing import NamedTuple

import pytest

from sgl_importance.platform import ROTARY_CLASSES
from support.fake_tree import FakeCache, FakeNode, FakeTreeCore

MEM = "sglang.srt.mem_cache"
NODE = f"{MEM}.unified_cache.unified_tree_core.UnifiedTreeNode"
CORE = f"{MEM}.unified_cache.unified_tree_core.UnifiedTreeCore"
CACHE = f"{MEM}.unified_radix_cache.UnifiedRadixCache"
COMPONENT_DATA = f"{MEM}.unified_cache.components.base.ComponentData"
PARAMS = f"{MEM}.cache_init_params.CacheInitParams"
REQ = "sglang.srt.managers.schedule_batch.Req"
MOONCAKE = f"{MEM}.storage.mooncake_store.mooncake_store"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
PATH_INFO = f"{MEM}.unified_cache.unified_tree_core_interface.TreePathNodeInfo"
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
WEIGHTS = "sglang.srt.model_executor.model_runner_components.weight_updater"
SESSIONS = "sglang.srt.session.session_controller"
WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
# The launcher's parsed namespace, checked on SGLang's own parser (its dests are ServerArgs'
# field names, but not every field is a flag).
LAUNCHER_ARGS = f"{SERVER_ARGS}.add_cli_args"
PLUGIN = Path(__file__).resolve().parents[2] / "python" / "sgl_importance" / "plugin.py"


class Name(NamedTuple):
    owner: str  # dotted path of the SGLang class or module
    name: str
    used_in: str  # the plugin module(s) that rely on it


# What the plugin reads or writes on SGLang's objects (private names are in PRIVATE).
ATTRIBUTES = [
    # The release/resume handlers' state (scheduler/control.py).
    *(Name(WEIGHT_UPDATER, n, "scheduler/control.py") for n in ("scheduler", "is_fully_idle", "offload_tags")),
    Name("sglang.srt.constants", "GPU_MEMORY_ALL_TYPES", "scheduler/control.py"),
    Name("sglang.srt.managers.io_struct", "ReleaseMemoryOccupationReqOutput", "scheduler/control.py"),
    Name("sglang.srt.managers.io_struct", "ResumeMemoryOccupationReqOutput", "scheduler/control.py"),
    # Radix-tree nodes.
    *(
        Name(NODE, n, "fold.py, prefetch.py, admission.py, stored.py, strategy.py")
        for n in ("id", "parent", "children", "key", "component_data", "last_access_time", "hit_count")
    ),
    Name(NODE, "hash_value", "cache/stored.py"),
    Name(NODE, "backuped", "cache/prefetch.py, cache/admission.py, cache/components.py"),
    Name(NODE, "evicted", "cache/prefetch.py"),
    Name(COMPONENT_DATA, "value", "scheduler/fold.py"),
    Name(COMPONENT_DATA, "lock_ref", "cache/prefetch.py"),
    Name(COMPONENT_DATA, "host_value", "fake tree (backuped)"),
    # Tree core.
    Name(CORE, "eviction_strategy", "cache/state_of.py, cache/components.py"),
    Name(CORE, "page_size", "cache/components.py"),
    Name(CORE, "evictable_device_leaves", "cache/prefetch.py"),
    Name(CORE, "root_node", "fake tree"),
    Name(CORE, "node_by_id", "scheduler/fold.py, cache/prefetch.py, cache/admission.py, cache/stored.py"),
    Name(CORE, "collect_path_info", "trace/recorder.py"),
    Name(f"{MEM}.base_prefix_cache.InsertResult", "inserted_host_node", "cache/stored.py"),
    # Radix cache.
    Name(CACHE, "tree_core", "cache/state_of.py"),
    Name(CACHE, "page_size", "cache/prefetch.py, cache/stored.py"),
    Name(CACHE, "tp_world_size", "scheduler/fold.py, cache/prefetch.py"),
    Name(CACHE, "tp_group", "scheduler/fold.py"),
    Name(CACHE, "metrics_collector", "metrics.py"),
    Name(CACHE, "enable_storage", "cache/components.py"),
    Name(CACHE, "cache_controller", "cache/prefetch.py"),
    Name(CACHE, "buffer_pipeline", "cache/prefetch.py"),
    Name(CACHE, "linker", "cache/prefetch.py"),
    Name(CACHE, "token_to_kv_pool_allocator", "cache/prefetch.py"),
    *(
        Name(CACHE, n, "cache/prefetch.py")
        for n in ("supports_swa", "supports_mamba", "is_root", "inc_lock_ref", "dec_lock_ref", "load_back")
    ),
    Name(CACHE, "write_backup_storage", "cache/admission.py, cache/stored.py (grading)"),
    # The MHA host pool's page geometry, which storage encoding reads (a rename would
    # silently store every page at the model's dtype).
    *(
        Name(f"{MEM}.pool_host.mha.MHATokenToKVPoolHost", n, "storage/page.py, storage/wrapper.py")
        for n in ("layout", "layer_num", "page_size", "head_num", "head_dim", "get_dummy_flat_data_page")
    ),
    Name("sglang.srt.observability.metrics_collector.RadixCacheMetricsCollector", "labels", "metrics.py"),
    Name(f"{MEM}.prefill_budget.PrefillBudget", "remaining_total", "cache/prefetch.py"),
    Name(f"{MEM}.prefill_budget.PrefillBudget", "remaining_current", "cache/prefetch.py"),
    # Cache parameters (a dataclass).
    *(
        Name(PARAMS, n, "cache/components.py")
        for n in ("eviction_policy", "disable", "pp_size", "attn_cp_size", "component_registry_override")
    ),
    # Scheduler, its batches and requests.
    Name(SCHEDULER, "tree_cache", "scheduler/fold.py, cache/stored.py, trace/recorder.py"),
    Name(SCHEDULER, "waiting_queue", "cache/prefetch.py"),
    Name(SCHEDULER, "disaggregation_mode", "cache/prefetch.py"),
    Name("sglang.srt.managers.schedule_policy.PrefillAdder", "can_run_list", "cache/prefetch.py"),
    Name("sglang.srt.managers.schedule_policy.PrefillAdder", "memory_budget", "cache/prefetch.py"),
    # Admission by footprint (scheduler/admission.py): what the adder subclass reads.
    Name("sglang.srt.managers.schedule_policy.PrefillAdder", "new_token_ratio", "scheduler/admission.py"),
    Name("sglang.srt.managers.schedule_policy.PrefillAdder", "add_chunked_req", "scheduler/admission.py"),
    # A continuing streamed chunk takes only the room there is (scheduler/admission.py).
    *(
        Name("sglang.srt.managers.schedule_policy.PrefillAdder", n, "scheduler/admission.py")
        for n in ("rem_chunk_tokens", "page_size", "token_to_kv_pool_allocator", "tree_cache")
    ),
    Name(SCHEDULER, "chunked_prefill_size", "scheduler/admission.py"),
    # A returning turn's history read from the host pool, not loaded back (scheduler/returning.py).
    *(
        Name(REQ, n, "scheduler/returning.py")
        for n in (
            "host_hit_length",
            "host_loaded_length",
            "swa_host_hit_length",
            "mamba_host_hit_length",
            "auxiliary_swa_host_hit_length",
            "best_match_node",
            "prefix_len",
            "full_untruncated_fill_ids",
            "lock",
        )
    ),
    Name("sglang.srt.managers.schedule_batch.ReqKvInfo", "holds_kv", "scheduler/returning.py"),
    Name("sglang.srt.managers.schedule_batch.ReqKvInfo", "cache_protected_len", "scheduler/returning.py"),
    *(
        Name(CACHE, n, "scheduler/returning.py")
        for n in ("linker", "buffer_pipeline", "inc_host_lock_ref", "dec_host_lock_ref", "path_device_indices")
    ),
    Name("sglang.srt.managers.schedule_policy.PrefillAdder", "add_one_req", "scheduler/admission.py"),
    *(
        Name("sglang.srt.model_executor.forward_batch_info.ForwardBatch", n, "attention/torch_backend.py")
        for n in ("seq_lens_cpu", "extend_seq_lens_cpu")
    ),
    Name("sglang.srt.managers.schedule_policy", "CLIP_MAX_NEW_TOKENS", "scheduler/admission.py"),
    Name("sglang.srt.managers.schedule_policy", "AddReqResult", "scheduler/admission.py"),
    *(
        Name("sglang.srt.managers.schedule_policy._PrefillAdmission", n, "scheduler/admission.py")
        for n in ("max_new_tokens", "is_chunked")
    ),
    *(Name(REQ, n, "scheduler/admission.py") for n in ("rid", "output_ids", "origin_input_ids", "sampling_params")),
    *(
        Name("sglang.srt.sampling.sampling_params.SamplingParams", n, "scheduler/admission.py")
        for n in ("max_new_tokens", "ignore_eos")
    ),
    Name("sglang.srt.managers.schedule_batch.ScheduleBatch", "reqs", "scheduler/fold.py"),
    Name("sglang.srt.managers.schedule_batch.ScheduleBatch", "forward_mode", "scheduler/fold.py"),
    *(
        Name(REQ, n, "scheduler/fold.py, cache/prefetch.py")
        for n in ("last_node", "host_hit_length", "best_match_node")
    ),
    Name(REQ, "last_node", "trace/recorder.py"),
    *(Name(REQ, n, "cache/stored.py") for n in ("extra_key", "cache_salt", "prefix_len", "full_untruncated_fill_ids")),
    # What the page trace records of a request and its batch.
    *(
        Name(REQ, n, "trace/recorder.py")
        for n in ("rid", "kv", "finished", "output_ids", "origin_input_ids", "time_stats", "cached_tokens")
    ),
    Name("sglang.srt.managers.schedule_batch.ReqKvInfo", "req_pool_idx", "trace/recorder.py"),
    Name("sglang.srt.observability.req_time_stats.SchedulerReqTimeStats", "scheduler_recv_time", "trace/recorder.py"),
    Name("sglang.srt.managers.schedule_batch.ScheduleBatch", "req_to_token_pool", "trace/recorder.py"),
    *(Name(PATH_INFO, n, "trace/recorder.py") for n in ("node_id", "path_start", "path_end")),
    # The tokenizer manager's side: OpenAI model names, prompt checks, slot frees.
    Name(
        "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase", "tokenizer_manager", "request_check/openai.py"
    ),
    *(
        Name(TOKENIZER_MANAGER, n, "request_check/openai.py")
        for n in ("served_model_name", "server_args", "lora_registry")
    ),
    Name(SERVER_ARGS, "model_path", "request_check/openai.py"),
    Name("sglang.srt.entrypoints.openai.protocol", "DetokenizeRequest", "request_check/openai.py"),
    # Control requests checked before SGLang handles them (request_check/control.py, scheduler/control.py).
    Name(SERVER_ARGS, "expert_distribution_recorder_mode", "request_check/control.py"),
    Name("sglang.srt.managers.io_struct.SlowDownReqInput", "forward_sleep_time", "request_check/control.py"),
    Name("sglang.srt.managers.io_struct.ProfileReq", "activities", "request_check/control.py"),
    *(
        Name("sglang.srt.managers.io_struct.ConfigureLoggingReq", n, "request_check/control.py")
        for n in ("log_requests_level", "log_requests_format", "log_level")
    ),
    *(Name(f"{WEIGHTS}.WeightUpdater", n, "scheduler/control.py") for n in ("model_config", "get_model_runner")),
    Name("sglang.srt.model_executor.model_runner.ModelRunner", "load_config", "scheduler/control.py"),
    Name("sglang.srt.configs.model_config.ModelConfig", "model_path", "scheduler/control.py"),
    Name("sglang.srt.configs.load_config", "LoadFormat", "scheduler/control.py"),
    Name("sglang.srt.configs.load_config.LoadConfig", "load_format", "scheduler/control.py"),
    *(Name(f"{SESSIONS}.Session", n, "scheduler/control.py") for n in ("streaming", "req_nodes")),
    Name(WEIGHT_UPDATER, "tp_worker", "scheduler/control.py"),
    Name("sglang.srt.managers.tp_worker.TpModelWorker", "deserialize_own_rank", "scheduler/control.py"),
    Name("sglang.srt.managers.io_struct", "UpdateWeightsFromTensorReqOutput", "scheduler/control.py"),
    *(Name(f"{SESSIONS}.SessionReqNode", n, "scheduler/control.py") for n in ("parent", "req", "clear")),
    *(Name("sglang.srt.managers.io_struct.SessionParams", n, "scheduler/control.py") for n in ("replace", "rid")),
    Name("sglang.srt.lora.lora_registry.LoRARegistry", "get_all_adapters", "request_check/openai.py"),
    Name(TOKENIZER_MANAGER, "model_config", "request_check/prompt.py"),
    *(Name(TOKENIZER_MANAGER, n, "request_check/") for n in ("context_len", "sampling_params_class")),
    *(
        Name("sglang.srt.managers.io_struct.GenerateReqInput", n, "request_check/")
        for n in (
            "text",
            "input_embeds",
            "top_logprobs_num",
            "logprob_start_len",
            "token_ids_logprob",
            "positional_embed_overrides",
            "session_params",
            "custom_labels",
        )
    ),
    Name(SERVER_ARGS, "tokenizer_metrics_allowed_custom_labels", "request_check/"),
    *(
        Name(f"sglang.srt.managers.io_struct.{c}", "input_ids", "request_check/prompt.py")
        for c in ("GenerateReqInput", "EmbeddingReqInput")
    ),
    Name(f"{MEM}.allocator.token.TokenToKVPoolAllocator", "free_group", "importance/allocator_reset.py"),
    Name("sglang.srt.layers.radix_attention.RadixAttention", "xai_temperature_len", "attention/triton_backend.py"),
    *(
        Name("sglang.srt.layers.radix_attention.RadixAttention", n, "attention/torch_backend.py")
        for n in ("attn_type", "is_cross_attention", "sliding_window_size", "scaling", "layer_id")
    ),
    Name("sglang.srt.layers.radix_attention.AttentionType", "ENCODER_ONLY", "attention/torch_backend.py"),
    *(
        Name("sglang.srt.model_executor.forward_batch_info.ForwardBatch", n, "attention/torch_backend.py")
        for n in ("encoder_lens", "extend_seq_lens", "seq_lens", "req_pool_indices", "out_cache_loc")
    ),
    Name("sglang.srt.model_executor.forward_batch_info.ForwardBatch", "rids", "attention/"),
    # Which decode batches may replay a CUDA graph with the hot set on (attention/hot_set_graphs.py).
    Name("sglang.srt.model_executor.forward_batch_info.ForwardBatch", "seq_lens_cpu", "attention/hot_set_graphs.py"),
    Name("sglang.srt.model_executor.forward_batch_info.ForwardBatch", "forward_mode", "attention/triton_backend.py"),
    Name(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
        "require_mlp_sync",
        "attention/hot_set_graphs.py",
    ),
    # The captured hot-set step (attention/hot_set_graphs.py, attention/triton_backend.py).
    *(
        Name("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner", n, "attention/")
        for n in ("attn_backend", "capture_bs")
    ),
    Name("sglang.srt.model_executor.runner_utils.capture_mode", "get_capture_attention_variant", "attention/"),
    Name("sglang.srt.model_executor.forward_batch_info.ForwardBatch", "batch_size", "attention/triton_backend.py"),
    Name(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend",
        "init_forward_metadata_in_graph",
        "attention/triton_backend.py",
    ),
    # The hot set in importance_triton (attention/triton_backend.py).
    *(
        Name("sglang.srt.layers.attention.triton_backend.TritonAttnBackend", n, "attention/triton_backend.py")
        for n in ("req_to_token", "max_kv_splits", "forward_metadata")
    ),
    *(
        Name("sglang.srt.layers.attention.triton_backend.ForwardMetadata", n, "attention/triton_backend.py")
        for n in ("kv_indptr", "kv_indices", "qo_indptr", "custom_mask", "mask_indptr", "max_extend_len")
    ),
    # importance_triton's extend over prefixes staged from the host pool (attention/triton_backend.py).
    Name(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend",
        "extend_attention_fwd",
        "attention/triton_backend.py",
    ),
    *(
        Name("sglang.srt.layers.radix_attention.RadixAttention", n, "attention/triton_backend.py")
        for n in ("k_scale", "tp_q_head_num", "qk_head_dim", "v_head_dim")
    ),
    Name("sglang.srt.model_executor.model_runner.ModelRunner", "forward_stream", "attention/hot_set_attention.py"),
    Name("sglang.srt.model_executor.model_runner.ModelRunner", "sliding_window_size", "attention/triton_backend.py"),
    Name(SERVER_ARGS, "dtype", "platform/torch_cpu.py"),
    # Per-request hot-set parameters (request_check/prompt.py, scheduler/hot_set_requests.py).
    Name("sglang.srt.managers.io_struct.GenerateReqInput", "sampling_params", "request_check/prompt.py"),
    *(
        Name("sglang.srt.managers.io_struct.TokenizedGenerateReqInput", n, "scheduler/hot_set_requests.py")
        for n in ("rid", "sampling_params")
    ),
    Name("sglang.srt.sampling.sampling_params.SamplingParams", "custom_params", "scheduler/hot_set_requests.py"),
    Name(REQ, "finished", "scheduler/hot_set_requests.py"),
    Name(SCHEDULER, "server_args", "scheduler/hot_set_requests.py, trace/tracing.py"),
    # SGLang's Mooncake backend, which storage/mooncake.py stores sealed pages through.
    *(Name(f"{MOONCAKE}.MooncakeStore", n, "storage/mooncake.py") for n in ("store", "config_prefix")),
    Name(f"{MOONCAKE}.MooncakeStore", "config", "storage/factory.py"),
    Name(f"{MOONCAKE}.MooncakeStoreConfig", "master_server_address", "storage/factory.py"),
    # The file tier's backend, and the host pools whose pages the storage tier seals.
    Name(f"{MEM}.hicache_storage.HiCacheFile", "file_path", "storage/factory.py, storage/file.py"),
    Name(f"{MEM}.hicache_storage.HiCacheFile", "metadata_cache", "storage/file.py"),
    Name(f"{MEM}.hicache_storage.MetadataCache", "remove", "storage/file.py"),
    Name(f"{MEM}.storage.file.lru_file_evictor.LRUFileEvictor", "abort", "storage/file.py"),
    *(Name(f"{MEM}.pool_host.base.HostKVCache", n, "storage/wrapper.py") for n in ("dtype", "page_size", "layout")),
    # Server arguments: the launcher checks read the parsed namespace (before from_cli_args),
    # the scheduler-side code the ServerArgs built from it.
    *(
        Name(LAUNCHER_ARGS, n, "storage/file.py, storage/mooncake.py")
        for n in ("hicache_storage_backend", "hicache_storage_backend_extra_config")
    ),
    Name(LAUNCHER_ARGS, "enable_hierarchical_cache", "storage/file.py"),
    *(Name(LAUNCHER_ARGS, n, "cache/strategy.py") for n in ("radix_eviction_policy", "radix_eviction_policy_config")),
    *(Name(LAUNCHER_ARGS, n, "config.py") for n in ("attention_backend", "decode_attention_backend")),
    Name(SERVER_ARGS, "enable_metrics", "storage/factory.py, storage/mooncake.py, attention/torch_backend.py"),
    Name(SERVER_ARGS, "radix_eviction_policy", "storage/mooncake.py"),
    # What the runtime and the tracer read of the ServerArgs (sglang_types/server.py).
    *(Name(SERVER_ARGS, n, "runtime.py") for n in ("attention_backend", "decode_attention_backend")),
    *(Name(SERVER_ARGS, n, "trace/tracing.py") for n in ("page_size", "served_model_name", "model_path")),
    # The storage tier's identity and ranks (storage/factory.py, runtime.py).
    *(
        Name(f"{MEM}.hicache_storage.HiCacheStorageConfig", n, "storage/factory.py, runtime.py")
        for n in ("tp_rank", "tp_size", "pp_rank", "pp_size", "model_name")
    ),
    Name("sglang.srt.model_executor.model_runner.ModelRunner", "server_args", "attention/"),
    # Hot-set page release (scheduler/hot_set_release.py).
    *(Name(CACHE, n, "scheduler/hot_set_release.py") for n in ("host_pool_group", "evict_host")),
    Name(f"{MEM}.pool_host.group.HostPoolGroup", "anchor_entry", "scheduler/hot_set_release.py"),
    Name(f"{MEM}.pool_host.group.HostPoolGroup", "alloc", "scheduler/hot_set_release.py"),
    Name(f"{MEM}.pool_host.group.HostPoolGroup", "free", "scheduler/hot_set_release.py"),
    Name("sglang.srt.managers.cache_controller.HiCacheController", "io_backend", "scheduler/hot_set_release.py"),
    *(
        Name(f"{MEM}.pool_host.mha.MHATokenToKVPoolHost", n, "scheduler/hot_set_release.py, platform/host_pool.py")
        for n in ("layer_num", "backup_from_device_all_layer", "load_to_device_per_layer", "k_data_refs")
    ),
    # The host-slot ledger's view of the pool (platform/host_pool.py overrides alloc, free and
    # clear; hot_set_release.py reads which slots are allocated).
    *(
        Name(f"{MEM}.pool_host.base.HostKVCache", n, "scheduler/hot_set_release.py, platform/host_pool.py")
        for n in ("alloc", "free", "clear", "size", "slot_used")
    ),
    *(
        Name(f"{MEM}.allocator.paged.PagedTokenToKVPoolAllocator", n, "scheduler/hot_set_release.py")
        for n in ("alloc", "free", "available_size", "get_kvcache", "page_size")
    ),
    *(
        Name(REQ, n, "scheduler/hot_set_release.py")
        for n in ("rid", "kv", "full_untruncated_fill_ids", "skip_radix_cache_insert", "extend_end", "prefix_len")
    ),
    *(
        Name("sglang.srt.managers.schedule_batch.ReqKvInfo", n, "scheduler/hot_set_release.py")
        for n in ("req_pool_idx", "cache_protected_len", "kv_committed_len")
    ),
    Name("sglang.srt.managers.schedule_batch.ScheduleBatch", "reqs", "scheduler/hot_set_release.py"),
    Name(f"{MEM}.common", "evict_from_tree_cache", "scheduler/hot_set_release.py"),
    Name(SCHEDULER, "running_batch", "scheduler/hot_set_release.py"),
    Name("sglang.srt.managers.schedule_batch.ScheduleBatch", "batch_is_full", "scheduler/hot_set_release.py"),
    # The page importance table's share of the KV pool's memory (attention/table_reserve.py);
    # the hot set's rows in KV pages (hot_set/guard/key_codes.py: K and V of a layer as one
    # allocation in MHATokenToKVPool).
    *(
        Name(f"{MEM}.memory_pool.MHATokenToKVPool", n, "attention/hot_set_attention.py")
        for n in ("k_buffer", "v_buffer")
    ),
    # torch_cpu's direct KV write (attention/torch_backend.py: plain_kv_pool, _store_kv) and
    # its C RMSNorm / rotary forwards (platform/cpu_forwards.py).
    *(
        Name(f"{MEM}.memory_pool.MHATokenToKVPool", n, "attention/torch_backend.py")
        for n in ("start_layer", "dtype", "store_dtype", "is_quantized_kv_cache", "requires_physical_write_loc")
    ),
    *(
        Name("sglang.srt.layers.layernorm.RMSNorm", n, "platform/cpu_forwards.py")
        for n in ("weight", "variance_epsilon", "variance_size_override", "override_orig_dtype", "forward_native")
    ),
    *(
        Name("sglang.srt.layers.rotary_embedding.base.RotaryEmbedding", n, "platform/cpu_forwards.py")
        for n in ("head_size", "rotary_dim", "is_neox_style", "cos_sin_cache", "forward_native")
    ),
    # Its C linear and LM head (platform/cpu_forwards.py): what they read to leave SGLang its own branches.
    *(
        Name("sglang.srt.layers.logits_processor.LogitsProcessor", n, "platform/cpu_forwards.py")
        for n in ("use_fp32_lm_head", "rl_on_policy_target")
    ),
    Name("sglang.srt.layers.logits_processor", "should_apply_lm_head_quant_method", "platform/cpu_forwards.py"),
    # Requests longer than the device pool (scheduler/long_requests.py, request_check/prompt.py).
    *(
        Name(SCHEDULER, n, "scheduler/long_requests.py")
        for n in (
            "chunked_prefill_size",
            "model_config",
            "init_req_max_new_tokens",
            "max_new_tokens_limit",
        )
    ),
    *(
        Name(TOKENIZER_MANAGER, n, "request_check/prompt.py")
        for n in ("max_req_input_len", "context_len", "server_args")
    ),
    *(
        Name("sglang.srt.managers.schedule_batch.ScheduleBatch", n, "scheduler/hot_set_rows.py")
        for n in ("seq_lens_cpu",)
    ),
    Name(REQ, "seqlen", "scheduler/hot_set_rows.py"),
    *(
        Name(f"{MEM}.kv_cache_configurator.KVCacheConfigurator", n, "attention/hot_set_attention.py")
        for n in ("model_config", "layer_info", "kv_cache_dtype", "page_size")
    ),
    Name("sglang.srt.model_executor.pool_configurator.MemoryPoolConfig", "max_total_num_tokens", "attention/"),
    Name(
        "sglang.srt.model_executor.model_runner_components.layer_setup.ModelLayerInfo",
        "num_effective_layers",
        "attention/hot_set_attention.py",
    ),
    *(
        Name("sglang.srt.configs.model_config.ModelConfig", n, "attention/hot_set_attention.py")
        for n in ("head_dim", "v_head_dim", "get_num_kv_heads")
    ),
    Name(SERVER_ARGS, "enable_hierarchical_cache", "attention/"),
    # Read through get_schedule() / get_memory(), SGLang's resolved settings (a bag per struct).
    Name("sglang.srt.arg_groups.fields.schedule.Schedule", "max_total_tokens", "attention/hot_set_attention.py"),
    Name("sglang.srt.arg_groups.fields.memory.Memory", "enable_hierarchical_cache", "attention/hot_set_attention.py"),
    Name("sglang.srt.model_executor.model_runner.ModelRunner", "max_total_num_tokens", "attention/"),
    # Modules.
    Name(f"{MEM}.radix_cache", "RadixKey", "cache/stored.py"),
    Name(f"{MEM}.utils", "get_storage_hash_str", "cache/stored.py"),
]

# Private SGLang names: each is listed in plugin.py's touch-point docstring too.
PRIVATE = [
    Name(f"{MEM}.utils", "_EVICTION_POLICY_FACTORIES", "plugin.py"),
    Name(f"{MEM}.unified_cache.components.base", "_LAST_ACCESS_TIME_COUNTER_FLOAT", "cache/strategy.py"),
    Name(CACHE, "_all_reduce", "cache/prefetch.py"),
    Name(CACHE, "_apply_cache_actions", "scheduler/hot_set_release.py"),
    Name(f"{MEM}.hicache_storage.HiCacheFile", "_get_suffixed_key", "storage/file.py"),
    Name(f"{MEM}.hicache_storage.HiCacheFile", "_evictor", "storage/file.py"),
    Name(f"{MEM}.hicache_storage.HiCacheStorageFailureInjector", "_backend", "storage/factory.py"),
    Name(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend",
        "_set_kv_buffer",
        "attention/triton_backend.py",
    ),
    Name(f"{MEM}.allocator.paged.PagedTokenToKVPoolAllocator", "_release_page_ids", "plugin.py (hook)"),
    Name("sglang.srt.managers.tokenizer_manager.TokenizerManager", "_validate_one_request", "plugin.py (hook)"),
    Name("sglang.srt.layers.dual_gemm.DualGemm", "_select_mode", "plugin.py (hook, torch_cuda)"),
    Name("sglang.srt.layers.logits_processor.LogitsProcessor", "_compute_lm_head", "plugin.py (hook, torch_cpu)"),
    Name("sglang.srt.entrypoints.engine", "_set_envs_and_config", "plugin.py (hook, torch_cpu: children forked)"),
    Name(
        "sglang.srt.model_executor.runner.eager_runner.EagerRunner",
        "_execute_decode",
        "plugin.py (hook, torch_cpu: decode rows in C)",
    ),
    Name(SCHEDULER, "_engine_paused", "scheduler/control.py (a release after /pause_generation)"),
    # Overridden by the footprint adder (scheduler/admission.py), each called through super().
    *(
        Name("sglang.srt.managers.schedule_policy.PrefillAdder", n, "scheduler/admission.py")
        for n in (
            "_get_running_request_total_token_offset",
            "_select_prefill_admission",
            "_commit_prefill_admission",
            "_update_prefill_budget",
        )
    ),
]

# Hook targets plugin.py registers (a hook cannot target a missing attribute).
HOOK_TARGETS = [
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.server_args.ServerArgs.from_cli_args",
    "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request",
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__",
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
    "sglang.srt.entrypoints.http_server.ORJSONRequest.json",
    f"{MEM}.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids",
    f"{MEM}.allocator.token.TokenToKVPoolAllocator.free",
    f"{MEM}.allocator.paged.PagedTokenToKVPoolAllocator.clear",
    f"{MEM}.allocator.token.TokenToKVPoolAllocator.clear",
    "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
    "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc",
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict",
    "sglang.srt.managers.scheduler.Scheduler.__init__",
    "sglang.srt.managers.scheduler.Scheduler.handle_generate_request",
    "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens",
    "sglang.srt.mem_cache.common.checkpoint_kv_cache",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
    f"{CACHE}.prefix_device_indices",
    "sglang.srt.mem_cache.common.release_kv_cache",
    "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.free_kv_row",
    f"{CACHE}.__init__",
    f"{CACHE}.write_backup_storage",
    f"{CACHE}.ready_to_load_host_cache",
    "sglang.srt.managers.schedule_policy.PrefillAdder.__init__",
    "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem",
    f"{CORE}.insert_host",
    f"{MEM}.storage_prefetch.StoragePrefetchRetries.pop_ready",
    f"{MEM}.storage.backend_factory.StorageBackendFactory.create_backend",
    f"{MEM}.pool_host.mha.get_mha_host_pool_cls",
    f"{MEM}.l2_transfer.L2TransferEngine.__init__",
    f"{MEM}.memory_pool.can_use_store_cache",
    f"{MEM}.pool_host.mha.can_use_hicache_jit_kernel",
    "sglang.srt.layers.dual_gemm.DualGemm._select_mode",
    f"{MEM}.kv_cache_configurator.KVCacheConfigurator.config_from_budget",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.create_attention_graph_variants",
    "sglang.srt.layers.layernorm.RMSNorm",
    *(f"sglang.srt.layers.rotary_embedding.{cls}" for cls in ROTARY_CLASSES),
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply",
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head",
    "sglang.srt.entrypoints.engine._set_envs_and_config",
    "sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_decode",
    f"{WEIGHT_UPDATER}.release_memory_occupation",
    f"{WEIGHT_UPDATER}.resume_memory_occupation",
    *(
        f"{TOKENIZER_MANAGER}.{m}"
        for m in (
            "slow_down",
            "configure_logging",
            "start_profile",
            *(f"{a}_expert_distribution_record" for a in ("start", "stop", "dump")),
        )
    ),
    f"{WEIGHTS}.WeightUpdater.update_weights_from_disk",
    f"{WEIGHT_UPDATER}.update_weights_from_tensor",
    "sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter.send_weights_to_remote_instance",
    f"{SESSIONS}.Session.create_req",
]


def test_the_matmuls_torch_cpu_wraps_take_the_arguments_its_wrappers_hand_back():
    # cpu_forwards.linear_apply and lm_head_logits call SGLang's own function with these
    # (positional, then out= by keyword), and read the LM head's plain branch off them.
    apply = _resolve("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply")
    assert list(inspect.signature(apply).parameters) == ["self", "layer", "x", "bias"]
    head = inspect.signature(_resolve("sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"))
    assert list(head.parameters) == ["self", "hidden_states", "lm_head", "embedding_bias", "out"]
    assert head.parameters["out"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_rotary_classes_torch_cpu_serves_share_the_base_forward():
    # cpu_forwards.rotary_forward rotates as RotaryEmbedding.forward_native does: a class with
    # its own forward_native (a variant that rotates otherwise) must not be in the list.
    base = _resolve("sglang.srt.layers.rotary_embedding.base.RotaryEmbedding")
    for cls in ROTARY_CLASSES:
        own = _resolve(f"sglang.srt.layers.rotary_embedding.{cls}")
        assert own.forward_native is base.forward_native, f"{cls} has its own forward_native"


def test_sglangs_fused_ops_dispatch_to_a_forward_registered_for_the_platform_key():
    # plugin.py registers torch_cpu's C RMSNorm and rotary under this key and this call.
    from sglang.kernels.fused_op import BaseFusedOp

    assert list(inspect.signature(BaseFusedOp.register_oot_forward).parameters) == ["op_cls", "fn", "platform_key"]
    assert "_oot_forward_registry" in vars(BaseFusedOp)


@cache
def _resolve(path: str):
    return pkgutil.resolve_name(path)


@cache
def _launcher_namespace():
    import argparse

    parser = argparse.ArgumentParser()
    _resolve(SERVER_ARGS).add_cli_args(parser)
    return parser.parse_args(["--model-path", "m"])


@cache
def _real_node():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    node_cls = _resolve(NODE)
    return node_cls((ComponentType.FULL,))


def _assigned_in_source(cls: type, name: str) -> bool:
    # ``self.name = ...``, ``self.name: T = ...`` or ``self.name, self.other = ...`` in the class or a base.
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+|(?:,\s*self\.\w+\s*)+)?=(?!=)")
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


def has_name(owner: str, name: str) -> bool:
    """Whether SGLang's ``owner`` (a class or module path) has ``name``."""
    if owner == NODE:
        return hasattr(_real_node(), name)
    if owner == COMPONENT_DATA:
        return hasattr(_resolve(owner)(), name)
    if owner == LAUNCHER_ARGS:
        return hasattr(_launcher_namespace(), name)
    target = _resolve(owner)
    if inspect.ismodule(target) or hasattr(target, name):
        return hasattr(target, name)
    if dataclasses.is_dataclass(target):
        return name in {f.name for f in dataclasses.fields(target)}
    return _assigned_in_source(target, name)


def _describe(n: Name) -> str:
    return f"{n.owner}.{n.name} (used in {n.used_in})"


@pytest.mark.parametrize("relied", ATTRIBUTES + PRIVATE, ids=lambda n: f"{n.owner.rsplit('.', 1)[-1]}.{n.name}")
def test_sglang_still_has_every_name_the_plugin_relies_on(relied):
    assert has_name(relied.owner, relied.name), f"SGLang moved or renamed {_describe(relied)}"


@pytest.mark.parametrize("target", HOOK_TARGETS, ids=lambda t: t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1])
def test_every_hook_target_resolves(target):
    try:
        _resolve(target)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"SGLang moved hook target {target}: {err}")


def test_every_hook_target_in_plugin_py_is_checked_here():
    # The targets of plugin.py's table (backend and policy rows register names, not targets).
    from sgl_importance import plugin

    literal = {h.path for h in plugin.HOOKS if h.kind not in ("backend", "policy")}
    missing = sorted(literal - set(HOOK_TARGETS))
    assert not missing, f"plugin.py registers hooks this contract does not check: {missing}"


def test_every_private_name_is_listed_in_plugin_py():
    doc = importlib.import_module("sgl_importance.plugin").__doc__
    # Each as ``Owner._name`` in backquotes, e.g. `UnifiedRadixCache._all_reduce`.
    missing = [_describe(n) for n in PRIVATE if f"{n.owner.rsplit('.', 1)[-1]}.{n.name}`" not in doc]
    assert not missing, f"private SGLang names missing from plugin.py's touch-point table: {missing}"


# Private names of the standard library the plugin uses (not SGLang's).
STDLIB_PRIVATE = {"_exit"}  # os._exit in the trace writer process
STDLIB_PRIVATE |= {"_parser", "_constants"}  # re's parser, to bound stop regexes (request_check/stop.py)


def test_every_private_name_the_plugin_reads_is_in_this_contract():
    # A scan of python/: every ``x._name`` read, and every ``_name`` imported from
    # sglang, that the plugin does not define itself (def, class, assignment, slot) is
    # SGLang's, so it must be in PRIVATE (and so in plugin.py's table).
    sources = [p.read_text() for p in PLUGIN.parent.rglob("*.py")]
    own = set(STDLIB_PRIVATE)
    used: set[str] = set()
    for text in sources:
        own |= set(re.findall(r"\b(?:def|class|as) (_\w+)", text))
        own |= set(re.findall(r"^\s*(?:[\w.]+\.)?(_\w+)\s*(?::[^=\n]+)?=(?!=)", text, re.M))
        own |= set(re.findall(r'^\s*"(_\w+)",?$', text, re.M))  # __slots__ entries
        code = re.sub(r"#.*", "", re.sub(r'"""[\s\S]*?"""', "", text))
        used |= set(re.findall(r"\.(_[a-zA-Z]\w*)\b", code))
        for names in re.findall(r"from sglang[\w.]* import ([^\n]+)", code):
            used |= set(re.findall(r"\b(_[a-zA-Z]\w*)", names))
    unlisted = sorted(used - own - {n.name for n in PRIVATE})
    assert not unlisted, f"private SGLang names the plugin uses but PRIVATE (and plugin.py) lacks: {unlisted}"


def test_the_plugins_node_attribute_is_not_one_of_sglangs():
    from sgl_importance.node_state import NODE_STATE

    assert not hasattr(_real_node(), NODE_STATE), f"SGLang's tree node now has {NODE_STATE!r}"


def test_sglangs_real_node_accepts_the_plugins_state():
    from sgl_importance.node_state import node_importance, node_state, peek_state

    node = _real_node()
    assert peek_state(node) is None and node_importance(node) == 0.0
    node_state(node).importance = 0.5
    assert node_importance(node) == 0.5 and peek_state(node) is node_state(node)


def test_sglangs_disaggregation_off_is_the_value_the_prefetch_compares():
    from sglang.srt.disaggregation.utils import DisaggregationMode

    assert DisaggregationMode.NULL.value == "null"


# What the plugin reads off SGLang's runtime parallel context (get_parallel()).
PARALLEL = [
    ("attn_dcp_size", "cache/components.py"),
    ("tp_rank", "trace/recorder.py, attention/torch_backend.py"),
    ("attn_tp_size", "attention/hot_set_attention.py"),
    ("dp_rank", "trace/recorder.py"),
]


@pytest.mark.parametrize("name, used_in", PARALLEL, ids=[n for n, _ in PARALLEL])
def test_sglangs_parallel_context_still_has_every_name_the_plugin_reads(name, used_in):
    # Outside a server nothing is published: a known name raises RuntimeError or
    # ValueError (cache/components.py treats that as no DCP), a renamed one AttributeError.
    from sglang.srt.runtime_context import get_parallel

    try:
        value = getattr(get_parallel(), name)
    except (RuntimeError, ValueError):
        return
    except AttributeError as err:
        pytest.fail(f"SGLang moved or renamed get_parallel().{name} (used in {used_in}): {err}")
    assert value is None or isinstance(value, int)


def _public_fields(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


@pytest.mark.parametrize(
    "fake, owner",
    [
        (lambda: FakeNode(1, None, 4), NODE),
        (lambda: FakeTreeCore(), CORE),
        (lambda: FakeCache(FakeTreeCore()), CACHE),
    ],
    ids=["node", "tree_core", "cache"],
)
def test_the_unit_tests_fake_tree_uses_only_sglangs_names(fake, owner):
    # Helpers a test calls itself (``add``, ``loaded``, ...) are the fakes' own.
    own = {"add", "nodes", "loaded", "free", "evictable_tokens"}
    foreign = sorted(n for n in _public_fields(fake()) - own if not has_name(owner, n))
    assert not foreign, f"the fake {owner.rsplit('.', 1)[-1]} has names SGLang's lacks: {foreign}"


def test_sglangs_triton_extend_takes_the_arguments_the_staged_extend_passes():
    # attention/triton_backend.py calls TritonAttnBackend.extend_attention_fwd over prefixes
    # staged from the host pool: sixteen positional arguments, then keywords.
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    names = list(inspect.signature(extend_attention_fwd).parameters)
    positional = ["q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr"]
    positional += ["kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend", "k_scale", "v_scale"]
    assert names[: len(positional) + 1] == [*positional, "sm_scale"]
    keywords = {"logit_cap", "sliding_window_size", "sinks", "window_kv_offsets", "xai_temperature_len", "page_size"}
    keywords |= {"score_mod", "aux_tensors", "extend_seq_lens_cpu", "identity_kv_indices"}
    assert keywords <= set(names)


def test_the_scheduler_takes_its_request_limits_from_the_workers_info_as_attributes():
    # scheduler/long_requests.py raises them after __init__: they must be the attributes
    # SGLang reads each request against, unpacked from get_worker_info (no plain assignment).
    source = inspect.getsource(_resolve(SCHEDULER))
    assert re.search(r"self\.max_req_len,\s*self\.max_req_input_len,", source)
    assert re.search(r"self\.max_total_num_tokens,", source) and "self.max_req_input_len," in source
    assert "len(req.origin_input_ids) >= self.max_req_input_len" in inspect.getsource(_resolve(SCHEDULER))
