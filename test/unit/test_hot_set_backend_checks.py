"""What the hot set asks of a backend: which backends take it, which batches replay CUDA graphs, promotions' stream."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from sgl_importance import plugin, runtime
from sgl_importance.config import ImportanceConfig, add_cli_args, from_namespace
from sgl_importance.hot_set.pages.copies import PageCopies


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


def _graph_runner(max_bs: int, mlp_sync: bool = False) -> SimpleNamespace:
    """What SGLang's ``DecodeCudaGraphRunner.can_run_graph`` reads of its runner, for plain decode:
    graphs captured up to ``max_bs`` requests, padded to the next captured size; with
    ``mlp_sync`` the ranks' vote (the batch's ``can_run_decode_cuda_graph``) must say yes too."""
    return SimpleNamespace(
        ragged_verify_mode=False, captured_req_width=1, require_mlp_tp_gather=False, enable_pdmux=False,
        disable_padding=False, max_bs=max_bs, require_mlp_sync=mlp_sync, is_encoder_decoder=False,
        enable_two_batch_overlap=False, _make_graph_key=lambda *args, **kwargs: None,
        _resolve_lora_variant=lambda batch: None,
        model_runner=SimpleNamespace(spec_algorithm=SimpleNamespace(is_ngram=lambda: False)),
    )  # fmt: skip


def _decode_batch(*lengths: int, host_lengths: bool = True) -> SimpleNamespace:
    seq_lens_cpu = torch.tensor(lengths, dtype=torch.int64) if host_lengths else None
    return SimpleNamespace(
        replace_embeds=None,
        spec_info=None,
        batch_size=len(lengths),
        seq_lens_cpu=seq_lens_cpu,
        can_run_decode_cuda_graph=True,  # the DP ranks' vote, where they sync
    )


@pytest.mark.parametrize(
    "policy,lengths,host_lengths,mlp_sync,replays",
    [
        ("importance", (8, 3, 1), True, False, True),  # at most the threshold, this step's token included
        ("importance", (3, 9), True, False, False),  # one request past it: eager
        ("importance", (9,), True, False, False),
        ("importance", (1, 2, 3, 4, 5), True, False, False),  # past the largest captured batch: SGLang's own no
        ("importance", (3, 4), False, False, False),  # no host copy of the lengths: eager
        ("importance", (3, 4), True, True, False),  # ranks must agree (DP attention): always eager
        ("off", (3, 9000), True, False, True),  # hot set off: SGLang's answer whatever the length
        ("off", (3, 9000), True, True, True),
    ],
)
def test_a_decode_batch_replays_a_cuda_graph_only_without_a_request_past_the_threshold(
    monkeypatch, policy, lengths, host_lengths, mlp_sync, replays
):
    # plugin.py's row around SGLang's own check, as SGLang calls it.
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    config = ImportanceConfig(hot_set_policy=policy, hot_set_threshold=8)
    monkeypatch.setattr(runtime, "_current", runtime.Runtime(config))
    (row,) = [h for h in plugin.HOOKS if h.target.endswith("DecodeCudaGraphRunner.can_run_graph")]
    can_run_graph = plugin._bind(row)
    batch = _decode_batch(*lengths, host_lengths=host_lengths)
    runner = _graph_runner(max_bs=4, mlp_sync=mlp_sync)
    assert can_run_graph(DecodeCudaGraphRunner.can_run_graph, runner, batch) is replays


def test_the_config_no_longer_asks_to_turn_cuda_graphs_off_for_the_hot_set():
    config = from_namespace(_args("importance_triton"))
    assert config.hot_set_policy == "importance"
    flags = argparse.ArgumentParser()
    add_cli_args(flags)
    (policy,) = [a for a in flags._actions if "--hot-set-policy" in a.option_strings]
    assert "importance_triton" in policy.help and "disabled" not in policy.help


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


def test_page_copies_off_cuda_run_where_issued_and_free_at_once():
    tiers, copies, freed = _Pools(), PageCopies("cpu"), []
    copies.run(lambda: tiers.to_device(torch.tensor([6, 7]), torch.tensor([0, 1])))
    assert tiers.device[:2].tolist() == [7.0, 8.0]
    copies.defer_free(lambda: freed.append(1))
    assert freed == [1] and not copies.pending
    copies.fence()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream needs a CUDA device")
def test_page_copies_on_cuda_run_on_a_side_stream_land_before_the_fence_and_free_after_them():
    tiers, copies, freed = _Pools(), PageCopies("cuda"), []
    tiers.device = torch.zeros(1 << 20, device="cuda")
    tiers.host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    slots = torch.arange(1 << 20)
    copies.run(lambda: tiers.to_device(slots, slots), slots)
    copies.defer_free(lambda: freed.append(1))
    assert copies.pending and copies.stream != torch.cuda.current_stream()
    copies.fence()
    # Ordered on the current stream after the copy: reads what it wrote.
    assert torch.equal(tiers.device.cpu(), tiers.host)
    assert not copies.pending
    copies.collect(wait=True)
    assert freed == [1]


class _Event:
    """A CUDA event's host side, passed when told (``done``)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        assert self.done, "collect waited for an event it had not found done"


def test_a_free_waits_for_its_copy_and_for_the_step_still_running():
    """``--hot-set-plan-ahead``: a page released while the step that reads it still runs goes back
    to the allocator only once that step is done, and once its copy out is (the side stream's
    bookkeeping, without a device: the stream is a stand-in, the events host-side fakes)."""
    copies, freed = PageCopies("cpu"), []
    copies.stream = object()  # as on CUDA: frees wait for events
    older, step = _Event(), _Event()
    copies.after(older)
    copies.after(step)  # steps end in order: the last one is what is waited for
    copies._event = copy_out = _Event()  # a release's copy issued after the step began
    copies.defer_free(lambda: freed.append("copied"))
    copies._event = None  # fenced: a page with a host copy already, released with no copy
    copies.defer_free(lambda: freed.append("no copy"))
    copy_out.done = True
    copies.collect()
    assert freed == []  # the step still runs
    step.done = True
    copies.collect()
    assert freed == ["copied", "no copy"]
    copies.after(None)  # a step with nothing to wait for (CPU) changes nothing
    assert copies._step is step
