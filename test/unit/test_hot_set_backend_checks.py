"""What the hot set asks of a backend: which backends take it, CUDA graphs, promotions' stream."""

from __future__ import annotations

import argparse

import pytest
import torch

from sgl_importance.config import from_namespace
from sgl_importance.hot_set.promotion import PromotionStream, StreamedPagePools


def _args(backend: str, decode_backend=None) -> argparse.Namespace:
    return argparse.Namespace(
        hot_set_policy="importance", attention_backend=backend, decode_attention_backend=decode_backend
    )


@pytest.mark.parametrize("backend", ["importance_torch", "importance_triton"])
def test_both_importance_backends_take_the_hot_set(backend):
    assert from_namespace(_args(backend)).hot_set_policy == "importance"
    assert from_namespace(_args("fa3", decode_backend=backend)).hot_set_policy == "importance"


def test_a_backend_without_the_hot_set_is_refused_at_start_up():
    with pytest.raises(ValueError, match="--hot-set-policy importance needs the decode attention backend"):
        from_namespace(_args("triton"))


def test_the_triton_backend_refuses_cuda_graphs_with_the_hot_set():
    from sgl_importance.attention.triton_backend import refuse_cuda_graphs_with_hot_set

    refuse_cuda_graphs_with_hot_set(False)
    with pytest.raises(ValueError, match="--cuda-graph-backend-decode disabled"):
        refuse_cuda_graphs_with_hot_set(True)


@pytest.mark.parametrize(
    "serves,window,kv_dtype,match",
    [
        (False, None, torch.bfloat16, "MLA, decode context parallelism"),
        (True, 4096, torch.bfloat16, "sliding-window attention"),
        (True, None, torch.float8_e4m3fn, "KV cache dtype"),
    ],
)
def test_the_triton_backend_refuses_a_hot_set_some_layer_could_not_serve(serves, window, kv_dtype, match):
    from sgl_importance.attention.triton_backend import check_hot_set_serves

    check_hot_set_serves(True, sliding_window=None, kv_cache_dtype=torch.bfloat16, model_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        check_hot_set_serves(serves, sliding_window=window, kv_cache_dtype=kv_dtype, model_dtype=torch.bfloat16)


class _Pools:
    page_size = 4

    def __init__(self) -> None:
        self.device = torch.zeros(8)
        self.host = torch.arange(8, dtype=torch.float32) + 1

    def to_device(self, host_slots, device_slots):
        self.device[device_slots.to(self.device.device)] = self.host[host_slots].to(self.device.device)

    def alloc_device(self, num_pages):
        return torch.arange(num_pages * self.page_size)


def test_promotions_off_cuda_copy_where_issued_and_leave_nothing_to_fence():
    tiers = _Pools()
    promotions = PromotionStream("cpu")
    streamed = StreamedPagePools(tiers, promotions)
    streamed.to_device(torch.tensor([6, 7]), torch.tensor([0, 1]))
    assert tiers.device[:2].tolist() == [7.0, 8.0]
    assert not promotions.pending
    promotions.fence()
    # Everything but the promotion is the wrapped pools' own.
    assert streamed.page_size == 4 and streamed.alloc_device(1).tolist() == [0, 1, 2, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream needs a CUDA device")
def test_promotions_on_cuda_run_on_a_side_stream_and_land_before_the_fence_returns():
    tiers = _Pools()
    tiers.device = torch.zeros(1 << 20, device="cuda")
    tiers.host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    promotions = PromotionStream("cuda")
    slots = torch.arange(1 << 20)
    StreamedPagePools(tiers, promotions).to_device(slots, slots)
    assert promotions.pending and promotions.stream != torch.cuda.current_stream()
    promotions.fence()
    # Ordered on the current stream after the copy: reads what it wrote.
    assert torch.equal(tiers.device.cpu(), tiers.host)
    assert not promotions.pending
