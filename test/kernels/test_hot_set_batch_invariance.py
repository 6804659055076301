"""A long request's hot-set decode does not depend on the requests beside it.

importance_torch decodes one request alone and, in a second world over the same pool
shape, beside a shorter one fed its own tokens; every layer's output of the first
request must be the same bits in both, with the guard off and on, its pages kept on the
device or released to a host pool. Before the C kernel split a request's list into
fixed runs of pages, a request's split depended on the batch's longest list and size, and
a near tie in the logits (issue 67's key-value prompts) went one way alone and the other
in a batch.

The worlds (``support/hot_set_world.py``) stand in only for SGLang's parents' metadata
and the KV pool.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang", reason="the backend subclasses SGLang's")

from sgl_importance.hot_set import HotSetParams  # noqa: E402
from support.hot_set_world import DIM, KV_HEADS, LAYERS, Q_HEADS, World, parents_metadata  # noqa: E402

LONG, SHORT = 180, 120  # tokens: 45 and 30 pages of 4, both past the threshold


def decode(params: HotSetParams, *, beside: bool, release: bool, steps: int) -> list[torch.Tensor]:
    """The long request's outputs, every layer of every step, alone or beside the short one."""
    world = World("torch", params, device_pages=400, host_pages=400 if release else 0, release=release, device="cpu")
    mine, other = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)

    def tokens(g: torch.Generator, n: int) -> list[torch.Tensor]:
        return [torch.randn(LAYERS, n, KV_HEADS, DIM, generator=g) for _ in range(2)]

    world.place("long", *tokens(mine, LONG))
    if beside:
        world.place("short", *tokens(other, SHORT))
    outputs = []
    for _ in range(steps):
        k, v = tokens(mine, 1)
        q = 3 * torch.randn(LAYERS, 1, Q_HEADS, DIM, generator=mine)
        if beside:
            k2, v2 = tokens(other, 1)
            q2 = 3 * torch.randn(LAYERS, 1, Q_HEADS, DIM, generator=other)
            k, v, q = torch.cat([k, k2], 1), torch.cat([v, v2], 1), torch.cat([q, q2], 1)
        outputs.append(torch.stack([layer[0] for layer in world.step(k, v, q)]))
    return outputs


@pytest.mark.parametrize("guard,release", [(1.0, False), (0.05, True)])
def test_a_long_request_decodes_to_the_same_bits_alone_and_beside_another(guard, release):
    params = HotSetParams(policy="importance", budget=0.2, window=1, sinks=1, guard_threshold=guard)
    with parents_metadata():
        alone = decode(params, beside=False, release=release, steps=12)
        together = decode(params, beside=True, release=release, steps=12)
    for step, (a, b) in enumerate(zip(alone, together)):
        assert torch.equal(a, b), f"step {step}: differs by {float((a - b).abs().max()):.3g}"
