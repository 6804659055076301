"""Tracing: the scheduler process's recording, behind ``plugin.py``'s trace hooks.

Holds the step capture and the recorder (``trace/recorder.py``) for the runtime, and
is what the hooks call: the recorder starts after ``Scheduler.__init__`` (rank 0,
flag on), the capture watches the page importance table's ``add_layer`` /
``finish_step`` (the runtime makes it the table's observer), and the recorder runs
around ``Scheduler.process_batch_result``. A recording fault stops
recording and closes the trace; serving goes on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from sgl_importance.config import ImportanceConfig, resolved_flag
from sgl_importance.env import TRACE_DIR_ENV
from sgl_importance.trace.recorder import Recorder, StepCapture, recording_requested

if TYPE_CHECKING:
    from sgl_importance.sglang_types.scheduler import ScheduleBatch, Scheduler

logger = logging.getLogger(__name__)


class Tracing:
    """The capture and the recorder of one scheduler process.

    Args:
        config: the process's flags (``--importance-trace-dir`` and what the trace
            records about the table); defaults when None.
    """

    def __init__(self, config: Optional[ImportanceConfig] = None) -> None:
        self.config = config if config is not None else ImportanceConfig()
        self.capture = StepCapture()
        self.recorder: Optional[Recorder] = None

    @property
    def requested(self) -> bool:
        """Whether this process records: the flag is on and the launcher exported it."""
        return self.config.trace_dir is not None and recording_requested()

    def start(self, scheduler: Scheduler) -> Optional[Recorder]:
        """After ``Scheduler.__init__``: start the writer for rank 0 when the flag is on."""
        from sglang.srt.runtime_context import get_parallel

        server_args = scheduler.server_args
        config = self.config
        if config.trace_dir is None or self.recorder is not None:
            return self.recorder
        # SGLang keeps a process's ranks in its runtime context, not on the scheduler.
        parallel = get_parallel()
        if parallel.tp_rank != 0 or (parallel.dp_rank or 0) != 0:
            return None
        out = os.environ.get(TRACE_DIR_ENV) or str(Path(config.trace_dir).expanduser().resolve())
        meta = {
            # As SGLang resolved them: with no --page-size given the field stays None (config.resolved_flag).
            "page_size": int(resolved_flag(server_args, "page_size")),
            "model": str(resolved_flag(server_args, "served_model_name") or server_args.model_path),
            "workload": "live",
            "extra": {
                "source": "sgl_importance.trace.recorder",
                "reduce": config.reduce,
                "sample_interval": config.sample_interval,
                "attention_backend": str(resolved_flag(server_args, "attention_backend")),
            },
        }
        self.recorder = Recorder(out, max_rows=config.trace_max_rows, meta=meta)
        logger.info("recording page importance to %s", out)
        return self.recorder

    def around_batch_result(
        self, original: Callable[..., Any], scheduler: Scheduler, batch: ScheduleBatch, *args: Any, **kwargs: Any
    ) -> Any:
        """Around ``Scheduler.process_batch_result``: record before (requests still hold
        their KV rows), file finished requests and push after (they are known, and inserted)."""
        # Only the unified radix cache has a tree core (see cache/state_of.py).
        tree_core = getattr(scheduler.tree_cache, "tree_core", None)
        self._guarded(lambda recorder: recorder.record_batch(self.capture, batch, tree_core))
        result = original(scheduler, batch, *args, **kwargs)
        # After: SGLang has inserted the finished requests (prompt and output) into the tree.
        self._guarded(lambda recorder: recorder.finish_requests(batch, self.capture.steps, tree_core))
        self._guarded(lambda recorder: recorder.push_if_due(batch))
        return result

    def _guarded(self, step: Callable[[Recorder], Any]) -> None:
        recorder = self.recorder
        if recorder is None:
            return
        try:
            step(recorder)
        except Exception:
            # A recording fault must not take serving down: stop recording, keep the trace so far.
            logger.exception("page-importance recording failed; recording stops, the trace is closed")
            self.recorder = None
            recorder.close()
