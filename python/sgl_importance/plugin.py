"""The one place where sgl-importance touches SGLang.

SGLang calls ``load()`` (entry point ``sglang.srt.plugins``) in every process
it starts: the HTTP server, the scheduler, the detokenizer. Each registration
below is one touch-point; the module it names holds the implementation.
Hook targets resolve in ``HookRegistry.apply_hooks`` after all plugins ran, and
the hook functions import their modules on first call, so ``load()`` itself
imports nothing heavy in processes that never reach them.

| touch-point                                      | module                        |
|--------------------------------------------------|-------------------------------|
| flags on SGLang's parser, `_importance`          | config.py                     |
| 404 for an unknown OpenAI `model`; prompt name   | serving.py                    |
| 400 for a chat body SGLang's model would 500 on  | serving.py                    |
| 400 for an empty prompt or out-of-vocab token id | prompt_check.py               |
| 400 for request fields the scheduler can't serve | request_check.py              |
| torch_cpu: HiCache host pool (torch copies)      | platform/host_pool.py         |
| torch_cpu: CPU streams for the L2 engine         | platform/streams.py           |
| backends `importance_torch`, `importance_triton` | attention/                    |
| `--hot-set-*`: hot-set decode in both backends  | hot_set/, attention/hot_set_attention.py |
| hot set: keep long prompts out of the tree, release pages, leave cleanly | scheduler/hot_set_release.py |
| hot set: a request's own `custom_params.hot_set` (400 if invalid) | prompt_check.py, scheduler/hot_set_requests.py |
| zero a page's importance when it is freed        | importance/allocator_reset.py |
| `SGL_IMPORTANCE_DUMP_DIR`: table after each step | importance/page_table.py      |
| eviction policy `importance` (+ config check)    | cache/strategy.py             |
| FULL component override under `importance`      | cache/components.py           |
| fold the page table into tree nodes per batch    | scheduler/fold.py             |
| L3 admission: gate writes to the storage tier    | cache/admission.py            |
| grade pages' storage precision before the write  | cache/stored.py, cache/encoding.py |
| prefetch host→device with the batch's load-back  | cache/prefetch.py             |
| importance back onto nodes rebuilt from storage  | cache/stored.py               |
| storage fetch retries, most important first      | cache/stored.py               |
| storage pages sealed + verified; writes pause    | cache/integrity.py            |
| `file` tier: directory check, leftovers, drops   | cache/file_tier.py            |
| `mooncake` tier: master check, whole sealed pages| cache/mooncake_tier.py        |
| importance shared next to pages in Mooncake Store| cache/shared_importance.py    |
| `--importance-trace-dir`: per-step page trace    | trace/recorder.py, writer_process.py |

Private SGLang names the plugin relies on (SGLang may change them without notice;
``test/unit/test_sglang_contract.py`` checks each of them, and every public attribute
the plugin reads on SGLang's objects, against the installed SGLang):

| private name                                              | module                      |
|-----------------------------------------------------------|-----------------------------|
| `mem_cache.utils._EVICTION_POLICY_FACTORIES` (policy name) | plugin.py                   |
| `components.base._LAST_ACCESS_TIME_COUNTER_FLOAT` (clock)  | cache/strategy.py           |
| `UnifiedRadixCache._all_reduce` (rank consensus)           | cache/prefetch.py           |
| `HiCacheFile._get_suffixed_key` (page file names)          | cache/file_tier.py          |
| `HiCacheFile._evictor` (forget a dropped page)             | cache/file_tier.py          |
| `HiCacheStorageFailureInjector._backend` (unwrap)          | cache/integrity.py          |
| `TritonAttnBackend._set_kv_buffer`                         | attention/triton_backend.py |
| hook `PagedTokenToKVPoolAllocator._release_page_ids`       | importance/allocator_reset.py |
| hook `TokenizerManager._validate_one_request`              | prompt_check.py             |

The plugin's own state on SGLang's objects: one ``NodeImportance`` per radix node
(``importance/node_state.py``), ``server_args._importance`` (config.py), and the
``importance`` strategy each cache's tree core holds (reached through
``cache/policy_state.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from sgl_importance.env import ANNOUNCE_ENV, DUMP_DIR_ENV, PLATFORM_ENV, TRACE_DIR_ENV

_loaded = False


def _add_cli_args(_result: Any, parser: Any) -> None:
    from sgl_importance.config import add_cli_args

    add_cli_args(parser)


def _from_cli_args(original: Callable[..., Any], cls: Any, args: Any) -> Any:
    from sgl_importance.config import from_namespace

    # Validate before SGLang builds anything, so a bad value stops start-up
    # with the flag's name instead of failing later in a child process.
    config = from_namespace(args)
    server_args = original(cls, args)
    server_args._importance = config
    return server_args


async def _handle_request(original: Callable[..., Any], *args: Any) -> Any:
    from sgl_importance.serving import check_openai_request

    return await check_openai_request(original, *args)


def _check_prompt(tokenizer_manager: Any, obj: Any, input_ids: Any) -> None:
    from sgl_importance.prompt_check import check_before_validation, check_hot_set_request

    # Before SGLang's own per-prompt checks: every tokenized prompt, on every
    # path, passes here before it is sent to the scheduler.
    check_before_validation(tokenizer_manager, obj, input_ids)
    check_hot_set_request(tokenizer_manager, obj)


async def _checked_json(original: Callable[..., Any], request: Any) -> Any:
    from sgl_importance.serving import checked_json

    return await checked_json(original, request)


def _check_generate_request(
    original: Callable[..., Any], tokenizer_manager: Any, obj: Any, *args: Any, **kwargs: Any
) -> Any:
    from sgl_importance.request_check import checked_generate

    # Around, not before: the check must raise on the first step of the async
    # generator, where SGLang's own request errors surface on every endpoint.
    return checked_generate(original, tokenizer_manager, obj, *args, **kwargs)


def _host_pool_cls(original: Callable[..., type], buffer_info: Any) -> type:
    from sgl_importance.platform.host_pool import torch_host_pool_cls

    return torch_host_pool_cls(original(buffer_info))


def _use_cpu_streams(result: Any, engine: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.platform.streams import use_cpu_streams

    use_cpu_streams(engine)


def _importance_torch_backend(model_runner: Any) -> Any:
    from sgl_importance.attention.torch_backend import ImportanceTorchAttnBackend

    return ImportanceTorchAttnBackend(model_runner)


def _importance_triton_backend(model_runner: Any) -> Any:
    from sgl_importance.attention.triton_backend import ImportanceTritonAttnBackend

    return ImportanceTritonAttnBackend(model_runner)


def _pages_released(_result: Any, allocator: Any, *page_ids: Any) -> None:
    from sgl_importance.importance.allocator_reset import pages_released

    pages_released(allocator, *page_ids)


def _slots_freed(_result: Any, allocator: Any, free_index: Any) -> None:
    from sgl_importance.importance.allocator_reset import slots_freed

    slots_freed(allocator, free_index)


def _allocator_cleared(_result: Any, allocator: Any) -> None:
    from sgl_importance.importance.allocator_reset import allocator_cleared

    allocator_cleared(allocator)


def _dump_page_table(_result: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.importance.page_table import dump_current_table

    dump_current_table()


def _importance_strategy(**config: Any) -> Any:
    from sgl_importance.cache.strategy import ImportanceStrategy

    return ImportanceStrategy(**config)


def _check_eviction_policy(cls: Any, args: Any) -> None:
    from sgl_importance.cache.strategy import check_cli_args

    # In the launcher, so a bad --radix-eviction-policy-config stops start-up
    # before any model loads (the scheduler would refuse it too, later).
    check_cli_args(args)


def _importance_tree_components(cache: Any, params: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.cache.components import use_importance_components

    use_importance_components(params)


def _gate_storage_write(original: Callable[..., Any], cache: Any, node_id: Any) -> Any:
    from sgl_importance.cache.admission import gate_storage_write

    return gate_storage_write(original, cache, node_id)


def _grade_storage_pages(cache: Any, node_id: Any) -> None:
    from sgl_importance.cache.stored import grade_before_storage_write

    # Before the write is queued, on the scheduler thread: the storage I/O thread
    # seals each page in the class graded here (--importance-storage-precision graded).
    grade_before_storage_write(cache, node_id)


def _seal_storage_pages(original: Callable[..., Any], factory: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_importance.cache.integrity import create_with_integrity

    # Around the factory, so every backend name (file, mooncake, dynamic) is wrapped
    # once, outside SGLang's own test failure injector.
    return create_with_integrity(original, factory, *args, **kwargs)


def _check_storage_dir(cls: Any, args: Any) -> None:
    from sgl_importance.cache.file_tier import check_cli_args

    # In the launcher: a storage path that is a regular file stops start-up in one line.
    check_cli_args(args)


def _check_mooncake_master(cls: Any, args: Any) -> None:
    from sgl_importance.cache.mooncake_tier import check_cli_args

    # In the launcher: an unreachable MOONCAKE_MASTER stops start-up in one line,
    # not in a scheduler traceback after the model loaded.
    check_cli_args(args)


def _note_scheduler(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.cache.prefetch import note_scheduler

    note_scheduler(scheduler)


def _note_prefill_adder(_result: Any, adder: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.cache.prefetch import note_prefill_adder

    note_prefill_adder(adder)


def _prefetch_with_batch_load(original: Callable[..., Any], cache: Any) -> Any:
    from sgl_importance.cache.prefetch import prefetch_with_batch_load

    # Around: the prefetches must be queued before SGLang merges the load queue
    # into the copy whose per-layer events the new prefill batch waits on.
    return prefetch_with_batch_load(original, cache)


def _restore_stored_importance(result: Any, tree_core: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.cache.stored import restore_after_insert_host

    restore_after_insert_host(tree_core, result)


def _rank_storage_retries(original: Callable[..., Any], retries: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_importance.cache.stored import rank_storage_retries

    return rank_storage_retries(original, retries, *args, **kwargs)


def _enable_hot_set_release(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.scheduler.hot_set_release import enable

    enable(scheduler)


def _note_hot_set_request(scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.scheduler.hot_set_requests import note_request

    note_request(scheduler, recv_req)


def _reopen_admission(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.scheduler.hot_set_release import reopen_admission

    reopen_admission(scheduler)


def _checkpoint_unless_released(original: Callable[..., Any], req: Any, tree_cache: Any) -> Any:
    from sgl_importance.scheduler.hot_set_release import checkpoint_unless_released

    return checkpoint_unless_released(original, req, tree_cache)


def _release_with_pages(original: Callable[..., Any], req: Any, tree_cache: Any, **kwargs: Any) -> Any:
    from sgl_importance.scheduler.hot_set_release import release_with_pages

    return release_with_pages(original, req, tree_cache, **kwargs)


def _free_row_around_released(original: Callable[..., Any], cache: Any, kv: Any, ranges: Any) -> Any:
    from sgl_importance.scheduler.hot_set_release import free_row_around_released

    return free_row_around_released(original, cache, kv, ranges)


def _fold_importance(_result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.scheduler.fold import fold_after_batch

    fold_after_batch(scheduler, batch)


def _export_trace_dir(cls: Any, args: Any) -> None:
    from sgl_importance.trace.recorder import export_trace_dir

    # Launcher: the scheduler inherits the environment, and its load() registers the
    # recording hooks only when this is set, so an unrecorded server runs none of them.
    export_trace_dir(args)


def _start_trace_recorder(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_importance.trace.recorder import start_recorder

    start_recorder(scheduler)


def _trace_layer(_result: Any, table: Any, importance: Any, kv_indptr: Any, kv_indices: Any) -> None:
    from sgl_importance.trace.recorder import on_add_layer

    on_add_layer(table, importance, kv_indptr, kv_indices)


def _trace_step(_result: Any, table: Any) -> None:
    from sgl_importance.trace.recorder import on_finish_step

    on_finish_step(table)


def _trace_batch(original: Callable[..., Any], scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_importance.trace.recorder import around_batch_result

    # Around: the batch's requests still hold their KV rows before the result is
    # processed, and the ones it finishes are known after.
    return around_batch_result(original, scheduler, batch, *args, **kwargs)


def _torch_cpu_selected() -> bool:
    from sgl_importance.platform import PLATFORM_NAME

    return os.environ.get(PLATFORM_ENV) == PLATFORM_NAME


def _announce() -> None:
    # Plugins load before SGLang configures logging, so a logger line would be
    # lost; this opt-in notice answers "is the plugin loaded in this process?".
    if os.environ.get(ANNOUNCE_ENV) == "1":
        print(f"[sgl-importance] plugin loaded (pid {os.getpid()})", file=sys.stderr, flush=True)


def load() -> None:
    """Register every hook this plugin needs; idempotent per process."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register = HookRegistry.register
    register("sglang.srt.server_args.ServerArgs.add_cli_args", _add_cli_args, HookType.AFTER)
    register("sglang.srt.server_args.ServerArgs.from_cli_args", _from_cli_args, HookType.AROUND)
    register(
        "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request",
        _handle_request,
        HookType.AROUND,
    )
    # Wherever a tokenizer manager may run; the scheduler never builds one and
    # would pay ~0.4 s to import it.
    if "sglang.srt.managers.scheduler" not in sys.modules:
        register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
            _check_prompt,
            HookType.BEFORE,
        )
        register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
            _check_generate_request,
            HookType.AROUND,
        )
        # FastAPI parses every body through it, before SGLang's request models.
        register("sglang.srt.entrypoints.http_server.ORJSONRequest.json", _checked_json, HookType.AROUND)
    # Backends register by name in every process: the scheduler builds them, the
    # launcher's parser must accept the names. (attention_registry costs ~0.4 s on
    # top of the hook registry's import; far less than a second hook layer.)
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.server_args import add_attention_backend_choices

    register_attention_backend("importance_torch")(_importance_torch_backend)
    register_attention_backend("importance_triton")(_importance_triton_backend)
    add_attention_backend_choices(["importance_torch", "importance_triton"])
    for target, hook in (
        ("paged.PagedTokenToKVPoolAllocator._release_page_ids", _pages_released),
        ("token.TokenToKVPoolAllocator.free", _slots_freed),
        ("paged.PagedTokenToKVPoolAllocator.clear", _allocator_cleared),
        ("token.TokenToKVPoolAllocator.clear", _allocator_cleared),
    ):
        register(f"sglang.srt.mem_cache.allocator.{target}", hook, HookType.AFTER)
    # Only the scheduler process (it loaded SGLang's scheduler before calling load()).
    if os.environ.get(DUMP_DIR_ENV) and "sglang.srt.managers.scheduler" in sys.modules:
        register(
            "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
            _dump_page_table,
            HookType.AFTER,
        )
    # Eviction policy `importance`: SGLang builds strategies by name from this dict
    # (get_eviction_strategy), and the flag's choices list must accept the name.
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
    from sglang.srt.server_args import add_radix_eviction_policy_choices

    _EVICTION_POLICY_FACTORIES["importance"] = _importance_strategy
    add_radix_eviction_policy_choices(["importance"])
    register("sglang.srt.server_args.ServerArgs.from_cli_args", _check_eviction_policy, HookType.BEFORE)
    # Tree and scheduler hooks only where SGLang's scheduler is loaded: it calls
    # load() from run_scheduler_process, and the HTTP server and detokenizer need
    # not import the scheduler and radix cache just to patch them.
    if "sglang.srt.managers.scheduler" in sys.modules:
        register(
            "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.__init__",
            _importance_tree_components,
            HookType.BEFORE,
        )
        register(
            "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
            _fold_importance,
            HookType.AFTER,
        )
        register(
            "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.write_backup_storage",
            _gate_storage_write,
            HookType.AROUND,
        )
        register(
            "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.write_backup_storage",
            _grade_storage_pages,
            HookType.BEFORE,
        )
        register("sglang.srt.managers.scheduler.Scheduler.__init__", _note_scheduler, HookType.AFTER)
        # Hot-set page release (a pass-through unless the hot set and HiCache are on).
        register("sglang.srt.managers.scheduler.Scheduler.__init__", _enable_hot_set_release, HookType.AFTER)
        register("sglang.srt.managers.scheduler.Scheduler.process_batch_result", _reopen_admission, HookType.AFTER)
        register(
            "sglang.srt.managers.scheduler.Scheduler.handle_generate_request",
            _note_hot_set_request,
            HookType.BEFORE,
        )
        register("sglang.srt.mem_cache.common.checkpoint_kv_cache", _checkpoint_unless_released, HookType.AROUND)
        register("sglang.srt.mem_cache.common.release_kv_cache", _release_with_pages, HookType.AROUND)
        register(
            "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.free_kv_row",
            _free_row_around_released,
            HookType.AROUND,
        )
        register(
            "sglang.srt.managers.schedule_policy.PrefillAdder.__init__",
            _note_prefill_adder,
            HookType.AFTER,
        )
        register(
            "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.ready_to_load_host_cache",
            _prefetch_with_batch_load,
            HookType.AROUND,
        )
        register(
            "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.insert_host",
            _restore_stored_importance,
            HookType.AFTER,
        )
        register(
            "sglang.srt.mem_cache.storage_prefetch.StoragePrefetchRetries.pop_ready",
            _rank_storage_retries,
            HookType.AROUND,
        )
        register(
            "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory.create_backend",
            _seal_storage_pages,
            HookType.AROUND,
        )
    register("sglang.srt.server_args.ServerArgs.from_cli_args", _export_trace_dir, HookType.BEFORE)
    register("sglang.srt.server_args.ServerArgs.from_cli_args", _check_storage_dir, HookType.BEFORE)
    register("sglang.srt.server_args.ServerArgs.from_cli_args", _check_mooncake_master, HookType.BEFORE)
    if os.environ.get(TRACE_DIR_ENV) and "sglang.srt.managers.scheduler" in sys.modules:
        table = "sgl_importance.importance.page_table.PageImportanceTable"
        register("sglang.srt.managers.scheduler.Scheduler.__init__", _start_trace_recorder, HookType.AFTER)
        register(f"{table}.add_layer", _trace_layer, HookType.AFTER)
        register(f"{table}.finish_step", _trace_step, HookType.AFTER)
        register("sglang.srt.managers.scheduler.Scheduler.process_batch_result", _trace_batch, HookType.AROUND)
    if _torch_cpu_selected():
        register(
            "sglang.srt.mem_cache.pool_host.mha.get_mha_host_pool_cls",
            _host_pool_cls,
            HookType.AROUND,
        )
        register(
            "sglang.srt.mem_cache.l2_transfer.L2TransferEngine.__init__",
            _use_cpu_streams,
            HookType.AFTER,
        )
    _announce()
