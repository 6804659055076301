"""The torch_cpu host pool's copies move exactly the requested tokens, per layout."""

import pytest
import torch

from sgl_importance.platform.host_pool import TorchMHAHostPool

LAYERS, HEADS, DIM, PAGE = 3, 2, 4, 4
HOST_PAGES, DEVICE_PAGES = 6, 5


def make_pool(layout: str) -> TorchMHAHostPool:
    # Only the attributes the transfer methods read; SGLang's constructor needs
    # a live device pool, which the e2e tests exercise.
    pool = object.__new__(TorchMHAHostPool)
    pool.layout, pool.page_size = layout, PAGE
    pool.layer_num = pool.target_layer_num = LAYERS
    tokens = HOST_PAGES * PAGE
    if layout == "layer_first":
        kv = torch.zeros(2, LAYERS, tokens, HEADS, DIM)
        refs = [[kv[c, layer] for layer in range(LAYERS)] for c in (0, 1)]
    elif layout == "page_first":
        kv = torch.zeros(2, tokens, LAYERS, HEADS, DIM)
        refs = [[kv[c].transpose(0, 1)[layer] for layer in range(LAYERS)] for c in (0, 1)]
    else:  # page_first_direct
        kv = torch.zeros(2, HOST_PAGES, LAYERS, PAGE, HEADS, DIM)
        refs = [[kv[c].transpose(0, 1)[layer] for layer in range(LAYERS)] for c in (0, 1)]
    pool.kv_buffer = kv
    pool.k_data_refs, pool.v_data_refs = refs
    pool.device_k_buffers = tuple(torch.randn(DEVICE_PAGES * PAGE, HEADS, DIM) for _ in range(LAYERS))
    pool.device_v_buffers = tuple(torch.randn(DEVICE_PAGES * PAGE, HEADS, DIM) for _ in range(LAYERS))
    return pool


def token_indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_backup_then_load_restores_the_same_tokens(layout, io_backend):
    pool = make_pool(layout)
    device_idx, host_idx = token_indices([3, 1]), token_indices([5, 2])
    original = [
        (k[device_idx].clone(), v[device_idx].clone()) for k, v in zip(pool.device_k_buffers, pool.device_v_buffers)
    ]
    pool.backup_from_device_all_layer(None, host_idx, device_idx, io_backend)

    for layer in range(LAYERS):
        pool.device_k_buffers[layer].zero_()
        pool.device_v_buffers[layer].zero_()
    target = token_indices([4, 0])
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(None, host_idx, target, layer, io_backend)

    for layer, (k, v) in enumerate(original):
        assert torch.equal(pool.device_k_buffers[layer][target], k)
        assert torch.equal(pool.device_v_buffers[layer][target], v)
        untouched = token_indices([1, 2, 3])
        assert not pool.device_k_buffers[layer][untouched].any()


def test_unknown_io_backend_is_refused():
    pool = make_pool("layer_first")
    with pytest.raises(ValueError, match="not supported on the torch_cpu and torch_cuda platforms"):
        pool.backup_from_device_all_layer(None, token_indices([0]), token_indices([0]), "kernel_ascend")


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_layers_page_views_read_what_a_gather_of_its_slots_copies(layout):
    """``layer_pages`` (the hot set's CPU decode reads released pages there, in place): page
    p of layer l is the host slots p * PAGE.. of that layer, the same rows ``gather_layer``
    copies, and a write to the pool shows through the view."""
    pool = make_pool(layout)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    for layer in range(LAYERS):
        k_pages, v_pages = pool.layer_pages(layer)
        assert k_pages.shape == (HOST_PAGES, PAGE, HEADS, DIM) and k_pages.stride()[2:] == (DIM, 1)
        for page in (0, 3, HOST_PAGES - 1):
            want_k, want_v = pool.gather_layer(layer, token_indices([page]))
            assert torch.equal(k_pages[page], want_k) and torch.equal(v_pages[page], want_v)
    pool.kv_buffer.zero_()
    assert not pool.layer_pages(1)[0].any()
