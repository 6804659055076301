"""importance_triton runs the hot set as importance_torch does, through the backends' own code.

Two worlds with the same pool, requests and queries: one drives
``ImportanceTorchAttnBackend``, the other ``ImportanceTritonAttnBackend``, through their
``init_forward_metadata`` and ``forward_decode`` (KV write, page summaries, hot-set
attend, the step's end on the last layer). Each layer's output must agree within
float32 rounding, the page importance tables must file the same importance, and the hot-set
counts (pages attended, estimated, guarded, promoted, released, read from the host)
must be equal, with the guard off and on and with pages released to a host pool.

Only the SGLang parents' parts are stood in for: their metadata (the torch parent's
is unused on decode; the Triton parent's ``kv_indptr``/``kv_indices`` are built here
the way it builds them, ``req_to_token[row, :seq_len]``) and the KV pool (plain
tensors). The backends are made with ``object.__new__`` and given what their
constructors would set: building SGLang's model runner needs a model and a device.
The prompt is written straight into the pool and summarised through the backends'
``_summarise``, what their ``forward_extend`` calls after the parent's write.

Runs under TRITON_INTERPRET=1 on a CPU (conftest.py), small shapes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton decode kernels cannot run")
pytest.importorskip("sglang", reason="the backends subclass SGLang's")

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sgl_importance.attention.hot_set_attention import HotSetAttention  # noqa: E402
from sgl_importance.attention.torch_backend import ImportanceTorchAttnBackend  # noqa: E402
from sgl_importance.attention.triton_backend import ImportanceTritonAttnBackend  # noqa: E402
from sgl_importance.hot_set import HotSetDecoder, HotSetParams, PageSummaries  # noqa: E402
from sgl_importance.hot_set.promotion import PromotionStream  # noqa: E402
from sgl_importance.hot_set.residency import ReleaseRegistry  # noqa: E402
from sgl_importance.importance.page_importance import PageImportanceTable  # noqa: E402
from sgl_kernel_ext import PagedDecodeWorkspace, TritonPageListDecode  # noqa: E402
from support.array_pools import ArrayPools  # noqa: E402
from support.kernel_device import DEVICE, EMPTY_PAGES_WARN  # noqa: E402

pytestmark = [EMPTY_PAGES_WARN]

PAGE = 4
KV_HEADS, GROUP, DIM = 2, 2, 16
Q_HEADS = KV_HEADS * GROUP
LAYERS = 2
SCALE = DIM**-0.5
THRESHOLD = 8
OUT_ATOL = 2e-5
IMP_ATOL = 2e-6


class ArrayKV(ArrayPools):
    """SGLang's KV pool (``set_kv_buffer``/``get_*_buffer``) over ``ArrayPools``' device pool."""

    def __init__(self, device_pages: int, host_pages: int, promotions: bool = True, device: str = "cpu") -> None:
        super().__init__(
            layers=LAYERS, kv_heads=KV_HEADS, dim=DIM, page_size=PAGE,
            device_pages=device_pages, host_pages=host_pages, promotions=promotions, device=device,
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


def _slot_lists(req_to_token, req_pool_indices, seq_lens):
    """The parent Triton backend's decode metadata: each request's slots, concatenated."""
    indptr = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(seq_lens, 0)
    rows = [req_to_token[r, :n] for r, n in zip(req_pool_indices.tolist(), seq_lens.tolist())]
    return indptr, torch.cat(rows).to(torch.int64)


class World:
    """One backend over its own pool, fed requests token by token (the same in both worlds)."""

    def __init__(
        self, kind: str, params: HotSetParams, *, device_pages, host_pages, release, promotions=True, device=DEVICE
    ):
        self.device = device
        self.kv = ArrayKV(device_pages, host_pages, promotions, device)
        self.releases = ReleaseRegistry()
        if release:
            self.releases.enable(self.kv, threshold=THRESHOLD)
        num_pages = self.kv.k.shape[1] // PAGE
        self.req_to_token = torch.zeros(8, 64 * PAGE, dtype=torch.int32, device=device)
        self.page_importance = PageImportanceTable(num_pages, page_size=PAGE, device=device)
        summaries = PageSummaries(LAYERS, num_pages, KV_HEADS, DIM, page_size=PAGE, device=device)
        exact = TritonPageListDecode() if kind == "triton" else None
        decoder = HotSetDecoder(
            params,
            summaries,
            page_size=PAGE,
            threshold=THRESHOLD,
            releases=self.releases,
            exact=exact,
            promotions=PromotionStream("cpu"),
        )
        hot_set = HotSetAttention(decoder, self.page_importance)
        self.backend = self._backend(kind, hot_set)
        self.layers = [_layer(i) for i in range(LAYERS)]
        self.rows: dict[str, int] = {}
        self.written: dict[str, int] = {}

    def _backend(self, kind: str, hot_set: HotSetAttention):
        common = dict(
            page_size=PAGE,
            page_importance=self.page_importance,
            last_layer_id=LAYERS - 1,
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
                page_indptr=None,
                page_ids=None,
                page_tokens=None,
                paged_workspace=PagedDecodeWorkspace(),
                swa_out_cache_loc=None,
            )
        else:
            backend = object.__new__(ImportanceTritonAttnBackend)
            state = dict(
                req_to_token=self.req_to_token,
                use_mla=False,
                dcp_size=1,
                kv_cache_dtype=torch.float32,
                decode_wrapper=None,
                eager_wrapper=None,
                graph_wrapper=None,
                forward_metadata=None,
            )
        backend.__dict__.update(common, **state)
        return backend

    def place(self, rid: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompt's tokens not yet in the pool, written and summarised (``k``/``v``: ``[LAYERS, n, KV, D]``)."""
        if rid not in self.rows:
            self.rows[rid] = len(self.rows) + 1
            self.releases.admit(rid, first_owned_page=0)
        slots = [self._slot(rid, pos) for pos in range(self.written.get(rid, 0), k.shape[1])]
        if slots:
            slots = torch.tensor(slots, device=self.device)
            start = self.written.get(rid, 0)
            for layer in self.layers:
                self.kv.k[layer.layer_id, slots] = k[layer.layer_id, start:].to(self.device)
                self.kv.v[layer.layer_id, slots] = v[layer.layer_id, start:].to(self.device)
                self.backend._summarise(layer, slots)
        self.written[rid] = k.shape[1]

    def _slot(self, rid: str, pos: int) -> int:
        row = self.req_to_token[self.rows[rid]]
        if pos % PAGE == 0:
            row[pos : pos + PAGE] = self.kv.alloc_device(1, for_tokens=True).to(torch.int32)
        return int(row[pos])

    def step(self, k_new: torch.Tensor, v_new: torch.Tensor, q: torch.Tensor) -> list[torch.Tensor]:
        """One decode token per request (``k_new``/``v_new``: ``[LAYERS, bs, KV, D]``), every layer."""
        rids = list(self.rows)
        new_slots = torch.tensor([self._slot(rid, self.written[rid]) for rid in rids], device=self.device)
        for rid in rids:
            self.written[rid] += 1
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            encoder_lens=None,
            rids=rids,
            req_pool_indices=torch.tensor([self.rows[r] for r in rids], device=self.device),
            seq_lens=torch.tensor([self.written[r] for r in rids], device=self.device),
            out_cache_loc=new_slots,
            out_cache_loc_is_physical=False,
        )
        self.backend.init_forward_metadata(batch)
        outs = []
        k_new, v_new, q = (t.to(self.device) for t in (k_new, v_new, q))
        for layer in self.layers:
            i = layer.layer_id
            o = self.backend.forward_decode(
                q[i].reshape(len(rids), -1), k_new[i], v_new[i], layer, batch, save_kv_cache=True
            )
            outs.append(o.view(len(rids), Q_HEADS, DIM))
        return outs


@pytest.fixture(autouse=True)
def _parents_metadata(monkeypatch):
    """The parents' ``init_forward_metadata``: the torch parent's is not read on decode;
    the Triton parent's leaves each request's slots in ``forward_metadata``."""

    def triton_parent(self, batch):
        kv_indptr, kv_indices = _slot_lists(self.req_to_token, batch.req_pool_indices, batch.seq_lens)
        self.forward_metadata = SimpleNamespace(kv_indptr=kv_indptr, kv_indices=kv_indices, swa_out_cache_loc=None)

    monkeypatch.setattr(TorchNativeAttnBackend, "init_forward_metadata", lambda self, batch: None)
    monkeypatch.setattr(TritonAttnBackend, "init_forward_metadata", triton_parent)


def run_both(params: HotSetParams, *, steps: int, lengths: list[int], **world) -> dict[str, int]:
    """Decode ``steps`` steps in both backends, comparing every layer; returns the summed counts."""
    worlds = [World("torch", params, **world), World("triton", params, **world)]
    g = torch.Generator().manual_seed(5)
    prompts = {
        f"r{i}": [torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) * s for s in (1.5, 1.0)]
        for i, n in enumerate(lengths)
    }
    for rid, (k, v) in prompts.items():
        for w in worlds:
            w.place(rid, k, v)
    bs = len(lengths)
    for step in range(steps):
        k_new, v_new = (torch.randn(LAYERS, bs, KV_HEADS, DIM, generator=g) for _ in range(2))
        q = torch.randn(LAYERS, bs, Q_HEADS, DIM, generator=g) * 2
        want, got = (w.step(k_new, v_new, q) for w in worlds)
        for layer, (a, b) in enumerate(zip(want, got)):
            assert torch.allclose(b, a, atol=OUT_ATOL, rtol=0), f"step {step} layer {layer}"
        tables = [w.page_importance for w in worlds]
        assert bool((tables[0].last > 0).any()), "the attended pages' masses are filed"
        assert torch.allclose(tables[1].last, tables[0].last, atol=IMP_ATOL, rtol=0), f"step {step}"
        assert not worlds[1].backend.hot_set.in_step, "the last layer ends the step"
    totals = [w.backend.hot_set.decoder.totals.as_dict() for w in worlds]
    assert totals[1] == totals[0]
    # Both backends rewrote their request rows the same way (releases and promotions).
    assert torch.equal(worlds[0].req_to_token, worlds[1].req_to_token)
    return totals[1]


@pytest.mark.parametrize("guard", [1.0, 0.05])
def test_triton_backend_decodes_the_hot_set_as_the_torch_backend(guard):
    # A short request (dense) beside two long ones; the device holds everything.
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=guard)
    totals = run_both(params, steps=3, lengths=[5, 30, 41], device_pages=64, host_pages=0, release=False)
    assert totals["steps"] == 6 and totals["pages_attended"] <= totals["pages_dense"]
    if guard < 1.0:
        # A 3-page budget leaves no room for a page sample: the guard reads what the
        # bound cannot vouch for, from the same pages in both backends.
        assert totals["guard_checks"] > 0 and totals["guard_reads"] > 0
    else:
        assert totals["pages_attended"] < totals["pages_dense"]


@pytest.mark.parametrize("guard,promotions", [(1.0, False), (0.05, True), (1.0, True)])
def test_triton_backend_releases_and_promotes_pages_as_the_torch_backend(guard, promotions):
    # Pages outside each request's 3-page hot set go to the host pool and come back when
    # planned; with no device page for a promotion they are read from the host copy.
    params = HotSetParams(policy="importance", budget=3, window=1, sinks=1, guard_threshold=guard)
    totals = run_both(
        params, steps=4, lengths=[33, 30], device_pages=40, host_pages=64, release=True, promotions=promotions
    )
    assert totals["pages_released"] > 0
    if promotions and guard == 1.0:
        assert totals["pages_copied_in"] > 0
    elif promotions:
        assert totals["guard_reads"] > 0
    else:
        assert totals["promotions_refused"] > 0 and totals["pages_read_from_host"] > 0


class _OnFakeCuda:
    """The Triton kernel run outside ``FakeCuda`` (the interpreter reads tensors on the
    host), its results tagged as the device tensors they are on a GPU."""

    def __init__(self, mode, reader) -> None:
        self.mode, self.reader = mode, reader

    def __call__(self, *args, **kwargs):
        with torch._C.DisableTorchFunction():
            result = self.reader(*args, **kwargs)
        return self.mode.tag(tuple(result)) and result


@pytest.mark.parametrize(
    "policy,guard,release,promotions",
    [("importance", 1.0, False, True), ("importance", 0.05, True, True), ("importance", 1.0, True, False),
     ("quest", 0.05, False, True)],
)  # fmt: skip
def test_triton_backend_hot_set_keeps_host_and_device_tensors_apart(policy, guard, release, promotions):
    # Everything SGLang keeps on the GPU (pool, req_to_token, page table, the batch, q/k/v)
    # is on a stand-in CUDA device; no op may mix it with host tensors, as CUDA refuses to.
    # Planning stays on the host; the layers' arithmetic and the step's tally on the device.
    from support.fake_cuda import FakeCuda

    params = HotSetParams(policy=policy, budget=3, window=1, sinks=1, guard_threshold=guard)
    pages = dict(device_pages=40, host_pages=64) if release else dict(device_pages=64, host_pages=0)
    g = torch.Generator().manual_seed(5)
    lengths = [5, 30, 41]
    prompts = [[torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) for _ in range(2)] for n in lengths]
    if DEVICE == "cuda":  # a real GPU refuses mixed devices itself; the stand-in is not needed
        world = World("triton", params, release=release, promotions=promotions, device="cuda", **pages)
        decoder = world.backend.hot_set.decoder
        for i, (k, v) in enumerate(prompts):
            world.place(f"r{i}", k, v)
        for _ in range(3):
            shapes = [(LAYERS, len(lengths), KV_HEADS, DIM)] * 2 + [(LAYERS, len(lengths), Q_HEADS, DIM)]
            world.step(*(torch.randn(*shape, generator=g) for shape in shapes))
        assert decoder.totals.steps > 0 and (not release or decoder.totals.pages_released > 0)
        return
    with FakeCuda() as mode:
        world = World("triton", params, release=release, promotions=promotions, device="cuda", **pages)
        decoder = world.backend.hot_set.decoder
        decoder._read = _OnFakeCuda(mode, decoder._read)
        for i, (k, v) in enumerate(prompts):
            world.place(f"r{i}", k, v)
        for _ in range(3):
            shapes = [(LAYERS, len(lengths), KV_HEADS, DIM)] * 2 + [(LAYERS, len(lengths), Q_HEADS, DIM)]
            world.step(*(torch.randn(*shape, generator=g) for shape in shapes))
    assert decoder.totals.steps > 0 and (not release or decoder.totals.pages_released > 0)
    if not promotions:
        assert decoder.totals.pages_read_from_host > 0  # staged from the host pool
    assert not mode.violations, "\n".join(f"{where}: {why}" for where, why in mode.violations.items())
