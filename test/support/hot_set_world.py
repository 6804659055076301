"""A hot-set world: one of the plugin's attention backends decoding over fake SGLang pools.

``World`` drives ``ImportanceTorchAttnBackend`` or ``ImportanceTritonAttnBackend``
through their ``init_forward_metadata`` and ``forward_decode`` (KV write, page
hot-set attend, the step's end on the last layer), as SGLang's model runner
would. Shared by the kernel tests (``test/kernels/test_hot_set_backends.py``) and the
host round-trip benchmark (``benchmark/long_context/bench_host_syncs.py``).

Only the SGLang parents' parts are stood in for: their metadata (the torch parent's
is unused on decode; the Triton parent's ``kv_indptr``/``kv_indices`` are built the
way it builds them, ``req_to_token[row, :seq_len]``: install both with
:func:`parents_metadata`) and the KV pool (plain tensors). The backends are made with
``object.__new__`` and given what their constructors would set: building SGLang's
model runner needs a model and a device. The prompt is written straight into the pool,
as the parent's extend writes it.

The Triton backend's kernels run compiled on a GPU, or under ``TRITON_INTERPRET=1``
(set before triton is imported) on a CPU.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from typing import Iterator, Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_importance.attention.hot_set_attention import HotSetAttention
from sgl_importance.attention.torch_backend import ImportanceTorchAttnBackend, plain_kv_pool
from sgl_importance.attention.triton_backend import ImportanceTritonAttnBackend
from sgl_importance.hot_set import HotSetDecoder, HotSetParams, KeyRanges
from sgl_importance.hot_set.residency import Residency
from sgl_importance.importance.page_importance import PageImportanceTable
from sgl_kernel_ext import PagedDecodeWorkspace, TritonPageListDecode
from support.array_pools import ArrayPools
from support.host_syncs import HostSyncCounter
from support.kernel_device import DEVICE

PAGE = 4
KV_HEADS, GROUP, DIM = 2, 2, 16
Q_HEADS = KV_HEADS * GROUP
LAYERS = 2
SCALE = DIM**-0.5
THRESHOLD = 8


class ArrayKV(ArrayPools):
    """SGLang's KV pool (``set_kv_buffer``/``get_*_buffer``) over ``ArrayPools``' device pool."""

    def __init__(
        self,
        device_pages: int,
        host_pages: int,
        promotions: bool = True,
        device: str = "cpu",
        layers: int = LAYERS,
        host_views: bool = True,
    ) -> None:
        super().__init__(
            layers=layers, kv_heads=KV_HEADS, dim=DIM, page_size=PAGE, device_pages=device_pages,
            host_pages=host_pages, promotions=promotions, device=device, host_views=host_views,
        )  # fmt: skip

    def set_kv_buffer(self, layer, loc, k, v, *args, **kwargs) -> None:
        slots = loc.loc.to(torch.int64)
        self.k[layer.layer_id, slots] = k.view(-1, KV_HEADS, DIM)
        self.v[layer.layer_id, slots] = v.view(-1, KV_HEADS, DIM)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id]


def _layer(layer_id: int) -> SimpleNamespace:
    """What the backends read on SGLang's ``RadixAttention``."""
    return SimpleNamespace(
        layer_id=layer_id, scaling=SCALE, logit_cap=0.0, logit_capping_method="tanh",
        tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM,
        is_cross_attention=False, sliding_window_size=None, k_scale=None, v_scale=None, xai_temperature_len=0,
    )  # fmt: skip


def _slot_lists(req_to_token, req_pool_indices, seq_lens, seq_lens_sum: int):
    """The parent Triton backend's decode metadata: each request's slots, concatenated.

    As SGLang builds it, without reading the device: the total is the host's
    ``seq_lens_sum``, so the gather has a shape the host knows.
    """
    indptr = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(seq_lens, 0)
    rows = req_to_token[req_pool_indices.to(torch.int64)]  # [bs, row width]
    live = torch.arange(rows.shape[1], device=rows.device)[None, :] < seq_lens[:, None]
    flat = torch.nonzero_static(live.flatten(), size=seq_lens_sum).flatten()
    return indptr, rows.flatten()[flat].to(torch.int64)


class World:
    """One backend (``kind``: "torch" or "triton") over its own pool, fed requests token by
    token; ``layers`` attention layers (``LAYERS`` by default)."""

    def __init__(
        self,
        kind: str,
        params: HotSetParams,
        *,
        device_pages: int,
        host_pages: int,
        release: bool,
        promotions: bool = True,
        device: str = DEVICE,
        layers: int = LAYERS,
        plan_ahead: bool = False,
        host_views: bool = True,
    ) -> None:
        # A device object, not a string: the host round-trip counter tells the server's
        # device tensors from host ones by it (support/host_syncs.py).
        device = self.device = torch.device(device)
        self.kv = ArrayKV(device_pages, host_pages, promotions, device, layers, host_views)
        self.residency = Residency()
        if release:
            self.residency.enable(self.kv, threshold=THRESHOLD)
        num_pages = self.kv.k.shape[1] // PAGE
        self.req_to_token = torch.zeros(8, 64 * PAGE, dtype=torch.int32, device=device)
        self.page_importance = PageImportanceTable(num_pages, page_size=PAGE, device=device)
        ranges = KeyRanges(layers, KV_HEADS, DIM, capacity_pages=4 * num_pages, device=device)
        exact = TritonPageListDecode() if kind == "triton" else None
        decoder = HotSetDecoder(
            params,
            ranges,
            pool_pages=num_pages,
            page_size=PAGE,
            threshold=THRESHOLD,
            residency=self.residency,
            exact=exact,
        )
        hot_set = HotSetAttention(decoder, self.page_importance, plan_ahead=plan_ahead)
        self.backend = self._backend(kind, hot_set, layers)
        self.layers = [_layer(i) for i in range(layers)]
        self.rows: dict[str, int] = {}
        self.written: dict[str, int] = {}

    def _backend(self, kind: str, hot_set: HotSetAttention, layers: int):
        common = dict(
            page_size=PAGE,
            page_importance=self.page_importance,
            last_layer_id=layers - 1,
            hot_set=hot_set,
            token_to_kv_pool=self.kv,
            req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token),
        )
        if kind == "torch":
            backend = object.__new__(ImportanceTorchAttnBackend)
            state = dict(
                kv_indptr=None,
                kv_indices=None,
                decode_impl="paged",
                decode_plan=None,
                decoding=False,
                page_indptr=None,
                page_ids=None,
                page_tokens=None,
                paged_workspace=PagedDecodeWorkspace(),
                swa_out_cache_loc=None,
                plain_pool=plain_kv_pool(self.kv),
            )
        else:
            backend = object.__new__(ImportanceTritonAttnBackend)
            state = dict(
                req_to_token=self.req_to_token,
                use_mla=False,
                dcp_size=1,
                kv_cache_dtype=torch.float32,
                # What _new_wrapper sizes the CUDA graph's wrapper by (init_cuda_graph_state).
                num_head=Q_HEADS,
                num_kv_head=KV_HEADS,
                head_dim=DIM,
                v_head_dim=DIM,
                max_pages=self.req_to_token.shape[1] // PAGE,
                max_kv_splits=8,
                model_dtype=torch.float32,
                device=self.device,
                decode_wrapper=None,
                eager_wrapper=None,
                graph_wrapper=None,
                forward_metadata=None,
            )
        backend.__dict__.update(common, **state)
        return backend

    def place(self, rid: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompt's tokens not yet in the pool, written and summarised (``k``/``v``: ``[layers, n, KV, D]``)."""
        if rid not in self.rows:
            self.rows[rid] = len(self.written) + 1  # a row of its own, even after others finished
            self.residency.admit(rid, self.req_to_token[self.rows[rid]], first_owned_page=0, page_size=PAGE)
        slots = [self._slot(rid, pos) for pos in range(self.written.get(rid, 0), k.shape[1])]
        if slots:
            slots = torch.tensor(slots, device=self.device)
            start = self.written.get(rid, 0)
            for layer in self.layers:
                self.kv.k[layer.layer_id, slots] = k[layer.layer_id, start:].to(self.device)
                self.kv.v[layer.layer_id, slots] = v[layer.layer_id, start:].to(self.device)
        self.written[rid] = k.shape[1]

    def finish(self, rid: str) -> None:
        """The request leaves the batch (its row and pages stay as they are)."""
        del self.rows[rid]

    def _slot(self, rid: str, pos: int) -> int:
        row = self.req_to_token[self.rows[rid]]
        if pos % PAGE == 0:
            row[pos : pos + PAGE] = self.kv.alloc_device(1, for_tokens=True).to(torch.int32)
        return int(row[pos])

    def step(
        self,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        q: torch.Tensor,
        graph: bool = False,
        counter: Optional[HostSyncCounter] = None,
    ) -> list[torch.Tensor]:
        """One decode token per request (``k_new``/``v_new``: ``[layers, bs, KV, D]``), every layer.

        ``graph``: the step as SGLang runs a CUDA graph's (``init_forward_metadata_out_graph``
        before the layers, no ``init_forward_metadata``); the Triton backend only, after
        ``init_cuda_graph_state``. ``counter``: counts the step's host round trips, each
        layer's filed under its id (what a captured graph holds), the rest under ``"host"``.
        """
        with counter if counter is not None else nullcontext():
            return self._step(k_new, v_new, q, graph, counter)

    def _step(self, k_new, v_new, q, graph, counter) -> list[torch.Tensor]:
        where = counter.where if counter is not None else lambda label: nullcontext()
        batch = self.next_batch()
        with where("host"):
            if graph:
                self.backend.init_forward_metadata_out_graph(batch)
            else:
                self.backend.init_forward_metadata(batch)
        outs = self.layers_forward(batch, k_new, v_new, q, where)
        with where("host"):
            # After the forward, as the scheduler does after a batch: the step ends, its moves are made.
            self.residency.apply(self.backend.hot_set.end_batch())
        return outs

    def next_batch(self) -> SimpleNamespace:
        """The next decode batch: one new token's slot per request, lengths grown by one."""
        rids = list(self.rows)
        new_slots = torch.tensor([self._slot(rid, self.written[rid]) for rid in rids], device=self.device)
        for rid in rids:
            self.written[rid] += 1
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            encoder_lens=None,
            rids=rids,
            req_pool_indices=torch.tensor([self.rows[r] for r in rids], device=self.device),
            seq_lens=torch.tensor([self.written[r] for r in rids], device=self.device),
            seq_lens_sum=sum(self.written[r] for r in rids),
            seq_lens_cpu=torch.tensor([self.written[r] for r in rids]),
            out_cache_loc=new_slots,
            out_cache_loc_is_physical=False,
            batch_size=len(rids),
        )

    def layers_forward(self, batch, k_new, v_new, q, where=lambda label: nullcontext()) -> list[torch.Tensor]:
        """Every layer's ``forward_decode`` of ``batch`` (each under ``where(layer_id)``)."""
        rids = batch.rids
        outs = []
        # Made on the device (a factory naming it), as SGLang's forward hands them over.
        k_new, v_new, q = (torch.empty_like(t, device=self.device).copy_(t) for t in (k_new, v_new, q))
        with self.kv.forward():  # no page moves inside the forward
            for layer in self.layers:
                i = layer.layer_id
                with where(i):
                    o = self.backend.forward_decode(
                        q[i].reshape(len(rids), -1), k_new[i], v_new[i], layer, batch, save_kv_cache=True
                    )
                outs.append(o.view(len(rids), Q_HEADS, DIM))
        return outs


@contextmanager
def parents_metadata() -> Iterator[None]:
    """The parents' metadata while inside: the torch parent's is not read on decode; the
    Triton parent's (eager, and before a CUDA graph's capture or replay) leaves each
    request's slots in ``forward_metadata``, and its graph state is not read."""

    def triton_parent(self, batch, in_capture: bool = False) -> None:
        kv_indptr, kv_indices = _slot_lists(
            self.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_sum
        )
        self.forward_metadata = SimpleNamespace(kv_indptr=kv_indptr, kv_indices=kv_indices, swa_out_cache_loc=None)

    names = ("init_forward_metadata", "init_forward_metadata_out_graph", "init_cuda_graph_state")
    saved = TorchNativeAttnBackend.init_forward_metadata, *(getattr(TritonAttnBackend, n) for n in names)
    TorchNativeAttnBackend.init_forward_metadata = lambda self, batch: None
    for name, parent in zip(names, (triton_parent, triton_parent, lambda self, *args, **kwargs: None)):
        setattr(TritonAttnBackend, name, parent)
    try:
        yield
    finally:
        TorchNativeAttnBackend.init_forward_metadata = saved[0]
        for name, parent in zip(names, saved[1:]):
            setattr(TritonAttnBackend, name, parent)
