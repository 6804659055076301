"""HiCache host pool for torch_cpu and torch_cuda: SGLang's MHA host pool with torch copies.

SGLang binds the host<->device copy functions of ``MHATokenToKVPoolHost`` from
compiled kernels (``sgl_kernel.kvcacheio``) on CUDA/HIP/XPU. Neither native
platform has them, so a transfer is an ``index_select`` from one per-layer view
and an ``index_copy_`` into the other. On torch_cpu both tiers are ordinary
memory; on torch_cuda the host buffer is pinned (SGLang registers it with
``cudaHostRegister``) and rows cross the bus in one copy per layer and per K/V.
Pages stay contiguous token runs in every layout, so the ``file`` storage
backend's page (de)serialisation, which is plain torch in SGLang, works unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

if TYPE_CHECKING:
    from sgl_importance.sglang_types.model import KVPool

# Layouts whose per-layer host views can be indexed by token (or by page) with
# plain torch ops. page_head interleaves heads inside a page and page_unified
# fuses K and V; both exist only for specific GPU kernels.
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# There are no compiled kernels here: "kernel" and "direct" both mean the torch
# copies below, so an explicit choice of either is honoured.
SUPPORTED_IO_BACKENDS = ("kernel", "direct")


def check_hicache_support(layout: str | None, io_backend: str | None) -> None:
    """Refuse, at start-up, a host layout or io backend the native platforms cannot serve."""
    if layout is not None and layout not in SUPPORTED_LAYOUTS:
        raise ValueError(
            f"--hicache-mem-layout {layout!r} is not supported on the torch_cpu and "
            f"torch_cuda platforms; choose one of {', '.join(SUPPORTED_LAYOUTS)}"
        )
    if io_backend is not None and io_backend not in SUPPORTED_IO_BACKENDS:
        raise ValueError(
            f"--hicache-io-backend {io_backend!r} is not supported on the torch_cpu and "
            f"torch_cuda platforms; choose one of {', '.join(SUPPORTED_IO_BACKENDS)}"
        )


def host_pool_cls(original: Callable[..., type], buffer_info: Any) -> type:
    """Around ``get_mha_host_pool_cls(buffer_info)``: the native platforms' host pool class."""
    return torch_host_pool_cls(original(buffer_info))


def torch_host_pool_cls(upstream: type) -> type:
    """The native platforms' replacement for the host pool class SGLang picked."""
    if upstream is not MHATokenToKVPoolHost:
        raise NotImplementedError(
            f"HiCache host pool {upstream.__name__} (quantised or asymmetric K/V) "
            "is not supported on the torch_cpu and torch_cuda platforms"
        )
    return TorchMHAHostPool


def copy_rows(dst: torch.Tensor, dst_indices: torch.Tensor, src: torch.Tensor, src_indices: torch.Tensor) -> None:
    """``dst[dst_indices] = src[src_indices]`` along dim 0, across devices if need be.

    Each index goes to its tensor's device; the gathered rows cross once. Only a
    host-to-device copy may be asynchronous: the rows are a fresh tensor the copy
    owns, while a device-to-host copy is read on the host right after.
    """
    rows = src.index_select(0, src_indices.to(src.device))
    if rows.device != dst.device:
        rows = rows.to(dst.device, non_blocking=dst.device.type != "cpu")
    dst.index_copy_(0, dst_indices.to(dst.device), rows)


class TorchMHAHostPool(MHATokenToKVPoolHost):
    """MHA host pool whose transfers are torch index ops (host memory pinned for a GPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # pin_memory is the sixth positional parameter upstream; SGLang's
        # assembler passes five positionally and never sets it.
        if len(args) > 5:
            raise TypeError("TorchMHAHostPool takes pin_memory only as a keyword")
        buffer_info = args[0] if args else kwargs["buffer_info"]
        kwargs["pin_memory"] = torch.device(buffer_info.device).type == "cuda"
        layout = args[4] if len(args) > 4 else kwargs.get("layout")
        check_hicache_support(layout, None)
        super().__init__(*args, **kwargs)
        # A checker of who holds each slot (``hot_set/pages/host_ledger.py``), set by the hot set
        # when the check is on: it sees every alloc and free, whoever calls.
        self.ledger: Any = None

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        slots = super().alloc(need_size)
        if slots is not None and self.ledger is not None:
            self.ledger.allocated(slots)
        return slots

    def free(self, indices: torch.Tensor) -> int:
        if self.ledger is not None:
            self.ledger.freed(indices)
        return super().free(indices)

    def clear(self) -> None:
        # /flush_cache empties the pool at once, without a free per slot.
        if getattr(self, "ledger", None) is not None:
            self.ledger.cleared()
        super().clear()

    def _page_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-layer device buffer seen as [pages, page_size, heads, dim]."""
        return tensor.view(-1, self.page_size, *tensor.shape[1:])

    def _host_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_data_refs[layer], self.v_data_refs[layer]

    def _copy_layer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        src_is_host: bool,
    ) -> None:
        if self.layout == "page_first_direct":
            # Host views are [pages, page_size, ...] and not flattenable without
            # a copy; move whole pages, as the layout intends.
            src_pages = src_indices[:: self.page_size] // self.page_size
            dst_pages = dst_indices[:: self.page_size] // self.page_size
            src = src if src_is_host else self._page_view(src)
            dst = self._page_view(dst) if src_is_host else dst
            copy_rows(dst, dst_pages, src, src_pages)
        else:
            copy_rows(dst, dst_indices, src, src_indices)

    def gather_layer(self, layer_id: int, host_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V at ``host_indices`` (whole pages), ``[n, heads, dim]`` copies.

        For the hot set, which attends a released page from its host copy when no
        device page is free for it.
        """
        host_indices = host_indices.to("cpu", torch.int64)
        out = []
        for host in self._host_layer(layer_id):
            if self.layout == "page_first_direct":
                pages = host_indices[:: self.page_size] // self.page_size
                rows = host.index_select(0, pages)
                out.append(rows.reshape(-1, *rows.shape[2:]))
            else:
                out.append(host.index_select(0, host_indices))
        return out[0], out[1]

    def layer_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V host buffers as ``[host_pages, page_size, heads, dim]`` views,
        no copy: the hot set's CPU decode reads a released page where it lies. In
        ``page_first`` a layer's tokens lie a token's layers apart, in ``page_first_direct``
        its pages a page's layers apart; each token's heads are side by side in every layout."""
        views = []
        for host in self._host_layer(layer_id):
            views.append(host if self.layout == "page_first_direct" else host.view(-1, self.page_size, *host.shape[1:]))
        return views[0], views[1]

    def _check_io_backend(self, io_backend: str) -> None:
        if io_backend not in SUPPORTED_IO_BACKENDS:
            check_hicache_support(None, io_backend)

    def load_to_device_per_layer(
        self,
        device_pool: KVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        if not is_draft and not 0 <= layer_id < self.target_layer_num:
            return
        self._check_io_backend(io_backend)
        host_k, host_v = self._host_layer(layer_id)
        host_indices = host_indices.to(torch.int64)
        device_indices = device_indices.to(torch.int64)
        for host, device in (
            (host_k, self.device_k_buffers[layer_id]),
            (host_v, self.device_v_buffers[layer_id]),
        ):
            self._copy_layer(host, device, host_indices, device_indices, src_is_host=True)

    def backup_from_device_all_layer(
        self,
        device_pool: KVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        self._check_io_backend(io_backend)
        host_indices = host_indices.to(torch.int64)
        device_indices = device_indices.to(torch.int64)
        for layer in range(self.layer_num):
            host_k, host_v = self._host_layer(layer)
            for device, host in (
                (self.device_k_buffers[layer], host_k),
                (self.device_v_buffers[layer], host_v),
            ):
                self._copy_layer(device, host, device_indices, host_indices, src_is_host=False)
