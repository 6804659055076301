"""A hot-set decode in the test world (``hot_set_world.World``), its host round trips counted.

Shared by the CI test of issue 34's targets (``test/kernels/test_hot_set_host_syncs.py``)
and ``benchmark/long_context/bench_host_syncs.py``. The counter is active from the world's
construction on (paused until the counted steps) so it sees where every tensor came from
(``host_syncs.py``'s device-aware view), and it files each call under:

- ``START``: the step's start (``init_forward_metadata``: the hot set's plan);
- the layer's index: that layer's ``forward_decode`` (KV write, summaries, attend);
- ``END``: ``HotSetAttention.end_step`` (the step's bookkeeping and the next step's plan),
  which runs inside the last layer's ``forward_decode`` and is filed apart from it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from sgl_importance.hot_set import HotSetParams
from support import array_pools
from support.host_syncs import HostSyncCounter
from support.hot_set_world import DIM, KV_HEADS, PAGE, Q_HEADS, World
from support.kernel_device import DEVICE, launches_wrapped

START = "host"  # the world's label for what runs before the layers
END = "end"


def counted_decode(
    backend: str,
    params: HotSetParams,
    *,
    release: bool,
    lengths: Sequence[int],
    layers: int,
    steps: int,
    warmup: int,
    seed: int = 0,
) -> tuple[HostSyncCounter, World]:
    """``warmup`` decode steps uncounted, then ``steps`` counted, of requests of ``lengths``
    prompt tokens; the counter (its steps numbered from 0) and the world."""
    pages = sum(-(-(n + warmup + steps) // PAGE) for n in lengths) + 4
    # The test pools stand in for SGLang's allocator and pools: their reads are SGLang's.
    counter = HostSyncCounter(stand_ins=[array_pools.__file__])
    with counter, counter.paused():
        world = World(
            backend, params, release=release, device=DEVICE, layers=layers,
            device_pages=pages, host_pages=pages if release else 0,
        )  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        for i, n in enumerate(lengths):
            world.place(f"r{i}", *(torch.randn(layers, n, KV_HEADS, DIM, generator=g) for _ in range(2)))
    hot_set = world.backend.hot_set
    end_step = hot_set.end_step

    def labelled_end_step():
        with counter.where(END):
            return end_step()

    hot_set.end_step = labelled_end_step
    bs = len(lengths)
    with triton_launches_counted(counter):
        for step in range(warmup + steps):
            kv = [torch.randn(layers, bs, KV_HEADS, DIM, generator=g) for _ in range(2)]
            q = torch.randn(layers, bs, Q_HEADS, DIM, generator=g) * 2
            if step < warmup:
                with counter.paused():
                    world.step(*kv, q, counter=counter)
                continue
            counter.begin_step()
            world.step(*kv, q, counter=counter)
    return counter, world


@contextmanager
def triton_launches_counted(counter: HostSyncCounter) -> Iterator[None]:
    """Each Triton kernel launched (interpreted or compiled) counted as a LAUNCH."""

    def counted(run, kernel, args, kwargs):
        counter.launch_kernel(kernel.__name__)
        return run(kernel, *args, **kwargs)

    with launches_wrapped(counted):
        yield
