"""SGLang's scheduler as the plugin uses it: a request (its sampling parameters, its KV and
its clock), a request as it arrives, a batch, the prefill batch being built and the
admission ``PrefillAdder`` chose for a request, and the scheduler itself."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from sgl_importance.sglang_types.model import ForwardMode, ModelConfig, ReqToTokenPool
    from sgl_importance.sglang_types.server import ServerArgs
    from sgl_importance.sglang_types.tree import NodeHandle, NodeId, TreeCache, TreeLock


class SamplingParams(Protocol):
    """``sampling.sampling_params.SamplingParams``."""

    max_new_tokens: Optional[int]
    min_new_tokens: int
    ignore_eos: bool
    custom_params: Optional[dict[str, Any]]  # JSON from the request


class ReqKvInfo(Protocol):
    """``managers.schedule_batch.ReqKvInfo``: the device KV a request holds (``Req.kv``)."""

    req_pool_idx: Optional[int]  # its ``req_to_token`` row
    cache_protected_len: int  # the tree owns [0, here) of the row
    kv_committed_len: int

    @property
    def holds_kv(self) -> bool: ...


class ReqTimeStats(Protocol):
    """``observability.req_time_stats.SchedulerReqTimeStats``: a request's clock in the scheduler."""

    scheduler_recv_time: float  # when the scheduler received it (0.0: not yet)


class Req(Protocol):
    """``managers.schedule_batch.Req``: a request in the scheduler."""

    rid: str
    sampling_params: SamplingParams
    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    full_untruncated_fill_ids: Sequence[int]  # the prompt, then what it generated
    extend_end: Optional[int]  # end of this extend; None outside one
    prefix_len: int  # matched prefix on the device
    host_hit_length: int
    swa_host_hit_length: int
    mamba_host_hit_length: int
    host_loaded_length: int
    kv: ReqKvInfo
    last_node: Optional[NodeHandle]
    best_match_node: NodeId
    lock: Optional[TreeLock]
    skip_radix_cache_insert: bool
    extra_key: Optional[str]
    cache_salt: Optional[str]
    cached_tokens: int  # of its prompt, matched in the cache
    time_stats: ReqTimeStats

    @property
    def auxiliary_swa_host_hit_length(self) -> int: ...

    @property
    def seqlen(self) -> int: ...

    def finished(self) -> bool: ...

    def refresh_fill_ids(self) -> None: ...

    def owned_kv_len(self) -> int: ...

    def set_finish_with_abort(self, error_msg: str) -> None: ...


class GenerateReqInput(Protocol):
    """``managers.io_struct.TokenizedGenerateReqInput``: a request as it reaches the scheduler."""

    rid: Optional[str]
    sampling_params: SamplingParams


class ScheduleBatch(Protocol):
    """``managers.schedule_batch.ScheduleBatch``."""

    reqs: list[Req]
    seq_lens_cpu: Optional[torch.Tensor]
    forward_mode: ForwardMode
    req_to_token_pool: ReqToTokenPool
    tree_cache: TreeCache
    batch_is_full: bool


class PrefillAdmission(Protocol):
    """``managers.schedule_policy._PrefillAdmission``: the shape ``PrefillAdder`` chose for a prefill."""

    max_new_tokens: int
    is_chunked: bool


class PrefillBudget(Protocol):
    """``mem_cache.prefill_budget.PrefillBudget``: the device tokens a prefill batch being built may take."""

    @property
    def remaining_total(self) -> int: ...  # free and evictable tokens the admitted requests left unpromised

    @property
    def remaining_current(self) -> int: ...


class PrefillAdder(Protocol):
    """``managers.schedule_policy.PrefillAdder``: the prefill batch being built (what the
    prefetch reads of it; the footprint adder subclasses SGLang's class)."""

    tree_cache: TreeCache
    memory_budget: PrefillBudget
    can_run_list: list[Req]  # the requests admitted so far


class Scheduler(Protocol):
    """``managers.scheduler.Scheduler``."""

    server_args: ServerArgs
    tree_cache: TreeCache
    running_batch: ScheduleBatch
    model_config: ModelConfig
    max_total_num_tokens: int  # the device KV pool's tokens
    max_req_len: int
    max_req_input_len: int
    chunked_prefill_size: Optional[int]
    max_new_tokens_limit: Optional[int]  # SGLANG_MAX_NEW_TOKENS_LIMIT
    waiting_queue: list[Req]  # head first
    disaggregation_mode: enum.Enum  # ``disaggregation.utils.DisaggregationMode``
