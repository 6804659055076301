"""PageImportanceTable: how much attention each physical KV page received.

The decode backends hand over, once per layer, the page importance of every running
request (``[bs, max_pages]``, a request's page ``j`` = its tokens
``[j * page_size, (j + 1) * page_size)``); the table files it under the physical page
that holds those tokens (``slot // page_size``), reduces the layers of one decode
step (mean or max, ``--importance-reduce``), and keeps:

- ``last``: the most recent recorded step, one value per physical page;
- ``accumulated``: the sum of ``last`` over the recorded steps since the allocator
  last freed the page.

A page shared by several running requests (a common prefix) gets the sum of their
masses in ``mean`` mode and the largest in ``max`` mode.

Every tensor is allocated once, and the per-step work (``add_layer``,
``finish_step``) only launches tensor ops on them, reading nothing back to the host,
so a CUDA graph can capture it. For the same reason the step counter and the
``--importance-sample-interval`` gate live on the device: a captured graph always
runs the same kernels, and the gate decides on the device whether the step lands in
``last``/``accumulated``.

``reset_pages`` is host code the allocator hooks call between forwards (on the
scheduler's stream; under overlap scheduling it may run beside a forward that no
longer reads the freed page).

Not SGLang's page table (request -> token slots): this is importance per physical
page. Plain torch over ``sgl_kernel_ext``; nothing here imports SGLang. The
per-process table lives in a :class:`PageImportanceHolder` the runtime owns, which
also hands each table its observer (the tracer's capture, wired by the runtime).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol

import torch

from sgl_importance.choices import REDUCTIONS
from sgl_importance.env import DUMP_DIR_ENV
from sgl_kernel_ext import scatter_page_importance


class StepObserver(Protocol):
    """What watches a table's decode path (the tracer's ``StepCapture``): called after
    each ``add_layer`` with its arguments and after each ``finish_step``."""

    def add_layer(
        self, table: PageImportanceTable, importance: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
    ) -> None: ...

    def finish_step(self, table: PageImportanceTable) -> None: ...


# Device bytes per page of the KV pool: three float32 (last step, accumulated, step in progress).
TABLE_BYTES_PER_PAGE = 12


class PageImportanceTable:
    """Per-physical-page importance of the last recorded decode step and its sum.

    Args:
        num_pages: table entries, page 0 (SGLang's padding page) included.
        page_size: tokens per page (SGLang ``--page-size``).
        reduce: how one step's layers combine: ``"mean"`` or ``"max"``.
        sample_interval: record every N-th decode step (1 = every step).
        device: where the table lives (the KV pool's device).
        observer: called after each layer and step (None: nobody watches).
    """

    def __init__(
        self,
        num_pages: int,
        *,
        page_size: int,
        reduce: str = "mean",
        sample_interval: int = 1,
        device: torch.device | str = "cpu",
        observer: Optional[StepObserver] = None,
    ) -> None:
        if num_pages < 1 or page_size < 1 or sample_interval < 1:
            raise ValueError(
                f"num_pages={num_pages}, page_size={page_size}, sample_interval={sample_interval} must all be >= 1"
            )
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce={reduce!r}; allowed: {', '.join(REDUCTIONS)}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reduce = reduce
        self.sample_interval = sample_interval
        self.device = torch.device(device)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.last = torch.zeros(num_pages, **f32)
        self.accumulated = torch.zeros(num_pages, **f32)
        # The step in progress: layers summed (mean) or maxed into it.
        self._step = torch.zeros(num_pages, **f32)
        self._steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self._recorded = torch.zeros((), dtype=torch.int64, device=self.device)
        # Host-side, so the mean's divisor is a constant a captured graph keeps.
        self._layers_in_step = 0
        # On a CPU, layers that share one page mapping are reduced per request first
        # ([bs, max_pages]) and scattered once per mapping (see add_layer).
        self._pending: Optional[torch.Tensor] = None
        self._pending_lists: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        # Host-side count of resets, so a dump can tell the table changed.
        self.resets = 0
        self.observer = observer

    @classmethod
    def for_pool(cls, pool_tokens: int, *, page_size: int, **settings: Any) -> "PageImportanceTable":
        """A table for a KV pool of ``pool_tokens`` slots: pages 1..N plus padding page 0
        (``settings``: the constructor's other keywords)."""
        return cls(pool_tokens // page_size + 1, page_size=page_size, **settings)

    # -- the decode path (graph-capturable) --------------------------------------

    def add_layer(self, importance: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
        """Fold one layer's per-request page importance into the step in progress.

        Args:
            importance: ``[bs, max_pages]`` float32, what the decode kernel returned.
            kv_indptr: int32 ``[>= bs + 1]``; kv_indices: the token slots the kernel read.

        On a CPU the layers of a step that pass the same ``kv_indptr`` / ``kv_indices``
        objects (a dense step: every layer reads the same pages) are summed (or maxed)
        per request and scattered once, when the mapping changes or the step closes:
        the same table, one scatter per step instead of one per layer. A GPU keeps the
        scatter per layer, which a captured graph replays as it is.
        """
        if self.device.type == "cpu":
            lists = self._pending_lists
            if lists is not None and (lists[0] is not kv_indptr or lists[1] is not kv_indices):
                self._flush_pending()
            if self._pending is None or self._pending.shape != importance.shape:
                self._flush_pending()
                self._pending = importance.to(torch.float32, copy=True)
                self._pending_lists = (kv_indptr, kv_indices)
            elif self.reduce == "mean":
                self._pending.add_(importance)
            else:
                torch.maximum(self._pending, importance, out=self._pending)
        else:
            self._scatter(importance, kv_indptr, kv_indices)
        self._layers_in_step += 1
        if self.observer is not None:
            self.observer.add_layer(self, importance, kv_indptr, kv_indices)

    def _scatter(self, importance: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
        scatter_page_importance(
            importance,
            kv_indptr,
            kv_indices,
            self._step,
            page_size=self.page_size,
            reduce="add" if self.reduce == "mean" else "max",
        )

    def _flush_pending(self) -> None:
        if self._pending is not None:
            self._scatter(self._pending, *self._pending_lists)
        self._pending = self._pending_lists = None

    def finish_step(self) -> None:
        """Close the decode step: record it if the sample interval says so."""
        self._flush_pending()
        if self.reduce == "mean" and self._layers_in_step > 1:
            self._step.mul_(1.0 / self._layers_in_step)
        record = torch.remainder(self._steps, self.sample_interval) == 0
        torch.where(record, self._step, self.last, out=self.last)
        self.accumulated.addcmul_(self._step, record.to(torch.float32))
        self._recorded.add_(record.to(torch.int64))
        self._steps.add_(1)
        self._step.zero_()
        self._layers_in_step = 0
        if self.observer is not None:
            self.observer.finish_step(self)

    # -- the allocator side (host code, outside graphs) ---------------------------

    def reset_pages(self, page_ids: torch.Tensor) -> None:
        """Forget the importance of pages the allocator just freed."""
        if page_ids.numel() == 0:
            return
        self._flush_pending()  # what the step's layers so far gave them goes too
        ids = page_ids.to(device=self.device, dtype=torch.int64)
        # An id outside the table (another pool's page) maps to the padding page,
        # which nothing reads, instead of failing or syncing to filter it out.
        ids = torch.where((ids >= 0) & (ids < self.num_pages), ids, torch.zeros_like(ids))
        for values in (self.last, self.accumulated, self._step):
            values.index_fill_(0, ids, 0.0)
        self.resets += 1

    def reset_all(self) -> None:
        """Forget everything per page (the allocator cleared its free list)."""
        self._pending = self._pending_lists = None
        for values in (self.last, self.accumulated, self._step):
            values.zero_()
        self.resets += 1

    # -- consumers ----------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Device bytes of the table's per-page state (``TABLE_BYTES_PER_PAGE`` per page)."""
        return sum(t.numel() * t.element_size() for t in (self.last, self.accumulated, self._step))

    @property
    def steps(self) -> int:
        """Decode steps finished (reads the device counter: syncs on a GPU)."""
        return int(self._steps.item())

    @property
    def recorded_steps(self) -> int:
        """Decode steps that landed in ``last`` / ``accumulated`` (syncs on a GPU)."""
        return int(self._recorded.item())

    def matches(self, num_pages: int, page_size: int, device: torch.device | str) -> bool:
        return self.num_pages == num_pages and self.page_size == page_size and self.device == torch.device(device)

    def snapshot(self) -> dict[str, Any]:
        """A CPU copy of the table's state, for dumps and tests."""
        return {
            "last": self.last.detach().cpu().clone(),
            "accumulated": self.accumulated.detach().cpu().clone(),
            "steps": self.steps,
            "recorded_steps": self.recorded_steps,
            "page_size": self.page_size,
            "reduce": self.reduce,
            "sample_interval": self.sample_interval,
        }


# Opt-in debug dump, so tests and people can see the table from outside the server.


def dump_path(directory: str, pid: Optional[int] = None) -> str:
    return os.path.join(directory, f"page_table-{os.getpid() if pid is None else pid}.pt")


class PageImportanceHolder:
    """Holds the process's one ``PageImportanceTable`` (``current``): one, since SGLang
    runs one target model runner per scheduler process, and the decode backends, the
    allocator hooks and the fold must all reach the same object, created when the first
    backend knows the pool's size. Owned by the runtime (``runtime.py``).

    Attributes:
        observer: handed to every table it creates (the runtime wires the tracer here).
    """

    def __init__(self) -> None:
        self.current: Optional[PageImportanceTable] = None
        self.observer: Optional[StepObserver] = None
        # (table, steps, resets) of the last dump, to skip unchanged ones.
        self._dumped: Optional[tuple[int, int, int]] = None
        # The fold warns once when a policy needs a table no backend made.
        self.warned_missing = False

    def get_or_create(
        self, pool_tokens: int, *, page_size: int, device: torch.device | str = "cpu", **settings: Any
    ) -> PageImportanceTable:
        """The table for a pool of ``pool_tokens``, created on first use (several backends
        may share it); ``settings``: ``PageImportanceTable``'s ``reduce`` and ``sample_interval``."""
        if self.current is None or not self.current.matches(pool_tokens // page_size + 1, page_size, device):
            self.current = PageImportanceTable.for_pool(
                pool_tokens, page_size=page_size, device=device, observer=self.observer, **settings
            )
        return self.current

    def dump(self, *, directory: Optional[str] = None) -> Optional[str]:
        """Write the table's snapshot to ``$SGL_IMPORTANCE_DUMP_DIR`` when it changed.

        Written to a temporary name and renamed, so a reader never sees half a file.
        Returns the path written, or None when there was nothing new.
        """
        directory = directory or os.environ.get(DUMP_DIR_ENV)
        table = self.current
        if not directory or table is None:
            return None
        state = table.snapshot()
        version = (id(table), state["steps"], table.resets)
        if version == self._dumped:
            return None
        os.makedirs(directory, exist_ok=True)
        path = dump_path(directory)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        self._dumped = version
        return path
