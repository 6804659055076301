"""The one place where sgl-importance touches SGLang: a table, and one loop that applies it.

SGLang calls ``load()`` (entry point ``sglang.srt.plugins``) in every process it starts (a child forked on torch_cpu
adds its rows at the fork). Each row of ``HOOKS`` is one touch-point: (SGLang target, our function, kind, process).
Functions (``"module:attribute"`` under ``sgl_importance``) are imported on first call; ``state`` names what the
process's runtime (``runtime.py``) passes first. A function gets as many of SGLang's arguments as it declares (an
``after`` hook's result as ``result`` if it asks). Rows on one target apply in order, each wrapping the ones before it
(the last ``before`` runs first). Ours on SGLang's objects: ``NodeState``, ``server_args._importance``, ``CacheState``.
Private SGLang names relied on (``test/unit/test_sglang_contract.py`` checks them and every public attribute read):
- read or written: `mem_cache.utils._EVICTION_POLICY_FACTORIES` (plugin.py), `components.base._LAST_ACCESS_TIME_COUNTER_FLOAT` (cache/strategy.py),
  `Scheduler._engine_paused` (scheduler/control.py), `UnifiedRadixCache._all_reduce`, `UnifiedRadixCache._apply_cache_actions` (cache/prefetch.py,
  scheduler/hot_set_release.py), `HiCacheFile._get_suffixed_key`, `HiCacheFile._evictor` (storage/file.py), `HiCacheStorageFailureInjector._backend` (storage/factory.py), `TritonAttnBackend._set_kv_buffer` (attention/);
- hooked: `PagedTokenToKVPoolAllocator._release_page_ids` (importance/), `TokenizerManager._validate_one_request`
  (request_check/), `DualGemm._select_mode`, `LogitsProcessor._compute_lm_head`, `EagerRunner._execute_decode`, `engine._set_envs_and_config` (platform/);
- overridden (scheduler/admission.py): `PrefillAdder._get_running_request_total_token_offset`,
  `PrefillAdder._select_prefill_admission`, `PrefillAdder._commit_prefill_admission`, `PrefillAdder._update_prefill_budget`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import sys
from typing import Any, Callable, NamedTuple, Optional

from sgl_importance.env import ANNOUNCE_ENV, CHECKS_ENV, DUMP_DIR_ENV, PLATFORM_ENV, TRACE_DIR_ENV
from sgl_importance.platform import CPU_OPS, DISPATCH_KEY, NATIVE_PLATFORMS


class Hook(NamedTuple):
    target: str  # SGLang's attribute under sglang.srt (kind "backend"/"policy": the name)
    call: str  # "module:attribute" under sgl_importance
    kind: str  # before | after | around | check (launcher, parsed args) | backend | policy | forward (a fused op's) | inline
    process: str  # any | http | scheduler | dump | trace | checks | torch_cpu | torch_cuda | native (either)
    state: tuple[str, ...] = ()  # runtime attributes passed first ("runtime": itself)

    @property
    def path(self) -> str:  # the target's full name (kinds but backend and policy)
        return f"sglang.srt.{self.target}"


HOOKS = (
    Hook("server_args.ServerArgs.add_cli_args", "config:add_cli_args", "after", "any"),
    Hook("server_args.ServerArgs.from_cli_args", "config:from_cli_args", "around", "any"),
    Hook("entrypoints.openai.serving_base.OpenAIServingBase.handle_request", "request_check.openai:check_openai_request", "around", "any"),
    Hook("managers.tokenizer_manager.TokenizerManager.__init__", "runtime:start", "before", "http"),  # wherever a tokenizer manager may run (the scheduler never builds one); its runtime holds the config
    *(Hook("managers.tokenizer_manager.TokenizerManager._validate_one_request", f"request_check.prompt:{fn}", "before", "http", state) for fn, state in (("check_hot_set_request", ("config",)), ("check_before_validation", ()))),
    Hook("managers.tokenizer_manager.TokenizerManager.generate_request", "request_check.hook:checked_generate", "around", "http", ("config",)),  # around: it raises on the generator's first step, where SGLang's own errors do
    Hook("entrypoints.http_server.ORJSONRequest.json", "request_check.openai:checked_json", "around", "http"),
    *(Hook(f"managers.tokenizer_manager.TokenizerManager.{m}", f"request_check.control:{m}", "around", "http") for m in ("slow_down", "configure_logging", "start_profile", *(f"{a}_expert_distribution_record" for a in ("start", "stop", "dump")))),  # a 400 where the scheduler would die
    *(Hook(f"importance_{b}", f"attention.{b}_backend:Importance{b.title()}AttnBackend", "backend", "any", ("runtime",)) for b in ("torch", "triton")),
    Hook("mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids", "importance.allocator_reset:pages_released", "after", "any", ("page_importance",)),
    Hook("mem_cache.allocator.token.TokenToKVPoolAllocator.free", "importance.allocator_reset:slots_freed", "after", "any", ("page_importance",)),
    *(Hook(f"mem_cache.allocator.{a}.clear", "importance.allocator_reset:allocator_cleared", "after", "any", ("page_importance",)) for a in ("paged.PagedTokenToKVPoolAllocator", "token.TokenToKVPoolAllocator")),
    Hook("managers.scheduler.Scheduler.process_batch_result", "importance.page_importance:PageImportanceHolder.dump", "after", "dump", ("page_importance",)),
    Hook("importance", "runtime:Runtime.eviction_strategy", "policy", "any", ("runtime",)),
    Hook("server_args.ServerArgs.from_cli_args", "cache.strategy:check_cli_args", "check", "any"),
    Hook("managers.scheduler.Scheduler.__init__", "runtime:start", "before", "scheduler"),  # before the pool, cache, backend
    Hook("mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget", "attention.table_reserve:reserve_table", "around", "scheduler", ("runtime",)),  # the KV pool less the page importance table
    Hook("model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph", "attention.hot_set_graphs:eager_with_hot_set_requests", "around", "scheduler", ("config",)),
    Hook("model_executor.runner.decode_cuda_graph_runner.create_attention_graph_variants", "attention.hot_set_graphs:graph_variants", "around", "scheduler", ("runtime",)),
    Hook("mem_cache.unified_radix_cache.UnifiedRadixCache.__init__", "cache.components:use_importance_components", "before", "scheduler"),
    Hook("managers.scheduler.Scheduler.process_batch_result", "scheduler.fold:fold_after_batch", "after", "scheduler", ("runtime",)),
    Hook("mem_cache.unified_radix_cache.UnifiedRadixCache.write_backup_storage", "cache.admission:gate_storage_write", "around", "scheduler"),
    Hook("mem_cache.unified_radix_cache.UnifiedRadixCache.write_backup_storage", "cache.stored:grade_before_storage_write", "before", "scheduler", ("page_classes", "page_importance")),  # graded on the scheduler thread before the write is queued; the I/O thread seals in that class
    Hook("managers.scheduler.Scheduler.__init__", "runtime:Runtime.attach_scheduler", "after", "scheduler", ("runtime",)),
    Hook("managers.scheduler.Scheduler.__init__", "scheduler.hot_set_release:enable", "after", "scheduler", ("residency", "hot_set_params", "config")),
    Hook("managers.scheduler.Scheduler.__init__", "scheduler.long_requests:set_limits", "after", "scheduler", ("runtime",)),  # requests longer than the device pool
    Hook("managers.scheduler.Scheduler.init_req_max_new_tokens", "scheduler.long_requests:clip_new_tokens", "around", "scheduler", ("runtime",)),
    Hook("managers.scheduler.Scheduler.run_batch", "scheduler.hot_set_rows:around_batch", "around", "scheduler", ("runtime",)),  # rows' pages lent, then the step's moves
    Hook("managers.scheduler.Scheduler.process_batch_result", "scheduler.hot_set_release:reopen_admission", "after", "scheduler", ("residency",)),
    Hook("managers.scheduler.Scheduler.handle_generate_request", "scheduler.hot_set_requests:note_request", "before", "scheduler", ("request_params", "config")),
    Hook("mem_cache.common.checkpoint_kv_cache", "scheduler.hot_set_release:checkpoint_unless_released", "around", "scheduler", ("residency", "hot_set_attention", "hot_set_decoder", "row_pages")),
    Hook("managers.schedule_batch.ScheduleBatch.prepare_for_decode", "scheduler.hot_set_release:admit_grown", "after", "scheduler", ("residency",)),  # lengths set, before the forward
    Hook("managers.schedule_batch.ScheduleBatch.prepare_for_extend", "scheduler.returning:lend_history", "after", "scheduler", ("runtime",)),  # rows written, before the forward
    Hook("mem_cache.unified_radix_cache.UnifiedRadixCache.prefix_device_indices", "scheduler.returning:prefix_with_history", "around", "scheduler", ("residency",)),
    Hook("managers.schedule_batch.ScheduleBatch.check_decode_mem", "scheduler.decode_room:fits_after_releases", "around", "scheduler", ("runtime",)),  # before SGLang retracts
    Hook("mem_cache.common.release_kv_cache", "scheduler.hot_set_release:release_with_pages", "around", "scheduler", ("residency", "request_params")),
    Hook("mem_cache.common.release_kv_cache", "scheduler.hot_set_rows:release_rows", "around", "scheduler", ("runtime",)),  # its rows back
    Hook("mem_cache.base_prefix_cache.BasePrefixCache.free_kv_row", "scheduler.hot_set_release:free_row_around_released", "around", "scheduler", ("residency",)),
    Hook("managers.schedule_policy.PrefillAdder.__init__", "cache.prefetch:note_prefill_adder", "after", "scheduler"),
    Hook("managers.scheduler.Scheduler.get_prefill_adder_class", "scheduler.admission:footprint_adder", "around", "scheduler", ("runtime",)),
    Hook("mem_cache.unified_radix_cache.UnifiedRadixCache.ready_to_load_host_cache", "cache.prefetch:prefetch_with_batch_load", "around", "scheduler"),  # queued before SGLang merges the load queue into one copy
    Hook("mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.insert_host", "cache.stored:restore_after_insert_host", "after", "scheduler"),
    Hook("mem_cache.storage_prefetch.StoragePrefetchRetries.pop_ready", "cache.stored:rank_storage_retries", "around", "scheduler", ("scheduler",)),
    Hook("mem_cache.storage.backend_factory.StorageBackendFactory.create_backend", "runtime:Runtime.storage_backend", "around", "scheduler", ("runtime",)),  # outside SGLang's failure injector
    *(Hook("server_args.ServerArgs.from_cli_args", call, "check", "any") for call in ("trace.recorder:export_trace_dir", "storage.factory:check_cli_args")),  # launcher checks: a bad value stops start-up in one line, before any model loads
    Hook("managers.scheduler.Scheduler.__init__", "trace.tracing:Tracing.start", "after", "trace", ("tracing",)),
    Hook("managers.scheduler.Scheduler.process_batch_result", "trace.tracing:Tracing.around_batch_result", "around", "trace", ("tracing",)),
    Hook("mem_cache.pool_host.mha.get_mha_host_pool_cls", "platform.host_pool:host_pool_cls", "around", "native"),
    Hook("mem_cache.l2_transfer.L2TransferEngine.__init__", "platform.streams:use_cpu_streams", "after", "torch_cpu"),
    Hook("entrypoints.engine._set_envs_and_config", "platform.torch_cpu:fork_children", "after", "torch_cpu"),  # the launcher forks its children; theirs added at the fork (_register)
    *(Hook(t, f"scheduler.control:{t.rpartition('.')[2]}", "around", "scheduler") for t in (*(f"managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.{m}" for m in ("release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor")), "model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_disk", "model_executor.model_runner_components.weight_exporter.WeightExporter.send_weights_to_remote_instance", "session.session_controller.Session.create_req")),  # SGLang raised: a busy or CPU release, nothing to resume, a failed load, unreadable tensors, no send group, a session replaced
    *(Hook(target, f"platform.cpu_forwards:{fn}", kind, "torch_cpu") for target, fn, kind in CPU_OPS),  # one C call each
    *(Hook(f"mem_cache.{t}", "platform.torch_cuda:no_compiled_kernel", "around", "torch_cuda") for t in ("memory_pool.can_use_store_cache", "pool_host.mha.can_use_hicache_jit_kernel")),
    Hook("layers.dual_gemm.DualGemm._select_mode", "platform.torch_cuda:no_dual_gemm", "around", "torch_cuda"),
    Hook("server_args.ServerArgs.from_cli_args", "platform.torch_cuda:graph_backends", "check", "torch_cuda"),
    Hook("model_executor.model_runner.ModelRunner.forward", "checks:ForwardCheck.around_forward", "around", "checks", ("checks",)),  # checks.py
    *(Hook(f"mem_cache.{t}", "checks:ForwardCheck.no_page_move", "before", "checks", ("checks",)) for t in ("allocator.paged.PagedTokenToKVPoolAllocator.alloc", "allocator.paged.PagedTokenToKVPoolAllocator.free", "unified_radix_cache.UnifiedRadixCache.evict")),  # never inside a forward (checks.py)
)  # fmt: skip
SCHEDULER = ("scheduler", "dump", "trace", "checks")  # process kinds a scheduler is and a launcher is not


def _in_process(process: str) -> bool:
    in_scheduler = "sglang.srt.managers.scheduler" in sys.modules  # imported before load()
    platform = os.environ.get(PLATFORM_ENV)
    return {
        "any": True,
        "http": not in_scheduler,
        "scheduler": in_scheduler,
        "dump": in_scheduler and bool(os.environ.get(DUMP_DIR_ENV)),
        "trace": in_scheduler and bool(os.environ.get(TRACE_DIR_ENV)),
        "checks": in_scheduler and os.environ.get(CHECKS_ENV, "") not in ("", "0"),
        **{name: platform == name for name in NATIVE_PLATFORMS},  # torch_cpu, torch_cuda
        "native": platform in NATIVE_PLATFORMS,  # either
    }[process]


def _resolve(call: str) -> Callable[..., Any]:
    module, _, attribute = call.partition(":")
    return functools.reduce(getattr, attribute.split("."), importlib.import_module(f"sgl_importance.{module}"))


def _fitted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with the positional arguments and keywords it declares (an ``after`` hook's ``result``)."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params}
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    positional: Optional[int] = None  # None: it takes *args, so all of them
    if not any(p.kind is p.VAR_POSITIONAL for p in params):
        positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "result" for p in params)

    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs and not any_keyword:
            kwargs = {k: v for k, v in kwargs.items() if k in names}
        return fn(*args[:positional], **kwargs)

    return call


def _bind(hook: Hook) -> Callable[..., Any]:
    """The function SGLang calls for ``hook``: imports on first call, prepends the state."""
    fitted: list[Callable[..., Any]] = []

    def target(*args: Any, **kwargs: Any) -> Any:
        if not fitted:
            fitted.append(_fitted(_resolve(hook.call)))
        if hook.state:
            from sgl_importance import runtime

            rt = runtime.current()
            args = (*(rt if name == "runtime" else getattr(rt, name) for name in hook.state), *args)
        return fitted[0](*args, **kwargs)

    def none(*args: Any, **kwargs: Any) -> None:  # SGLang takes a before/after hook's value as new arguments/result
        target(*args, **kwargs)

    wrappers = {"after": lambda result, *a, **kw: none(*a, **kw, result=result), "before": none}  # check: below
    return {**wrappers, "check": lambda cls, args: none(args)}.get(hook.kind, target)  # before from_cli_args(cls, args)


def load() -> None:
    """Register every row of ``HOOKS`` that belongs in this process; idempotent per process."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    if "importance_torch" in ATTENTION_BACKENDS:
        return
    _register(HOOKS)
    if _in_process("torch_cpu") and not _in_process("scheduler"):  # a launcher: the children it forks add their rows
        os.register_at_fork(after_in_child=lambda: _register([h for h in HOOKS if h.process in SCHEDULER], forked=True))


def _register(rows: tuple[Hook, ...] | list[Hook], forked: bool = False) -> None:
    from sglang.kernels.fused_op import BaseFusedOp
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices, add_radix_eviction_policy_choices

    kinds = {"before": HookType.BEFORE, "check": HookType.BEFORE, "after": HookType.AFTER, "around": HookType.AROUND}
    for hook in (row for row in rows if _in_process(row.process)):
        if hook.kind == "backend":
            register_attention_backend(hook.target)(_bind(hook))
            add_attention_backend_choices([hook.target])
        elif hook.kind == "policy":
            _EVICTION_POLICY_FACTORIES[hook.target] = _bind(hook)
            add_radix_eviction_policy_choices([hook.target])
        elif hook.kind == "forward":  # called per layer: the function itself, not _bind's wrapper
            BaseFusedOp.register_oot_forward(pkgutil.resolve_name(hook.path), _resolve(hook.call), DISPATCH_KEY)
        else:  # inline: an around hook called per layer, the function itself with every argument
            fn = _resolve(hook.call) if hook.kind == "inline" else _bind(hook)
            HookRegistry.register(hook.path, fn, kinds.get(hook.kind, HookType.AROUND))
    if forked:  # SGLang's load_plugins() returns at once in a forked child: its flag came with the fork
        HookRegistry.apply_hooks()
    if os.environ.get(ANNOUNCE_ENV) == "1":  # before SGLang configures logging: "is the plugin loaded here?"
        print(f"[sgl-importance] plugin loaded (pid {os.getpid()})", file=sys.stderr, flush=True)
