"""SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``, kept from taking the
scheduler down (``plugin.py`` wraps ``SchedulerWeightUpdaterManager``'s two handlers).

SGLang 0.5.23's scheduler does not catch an exception from a control request: it exits, and the
server with it. Three of them a user could send:

- a release while requests run failed SGLang's assertion that the server is idle: it is refused
  (SGLang's own idleness test, so a release after ``/pause_generation`` passes as before) and said
  in the log; the answer has no field to carry the refusal, so the client reads success;
- a release on torch_cpu ended with ``torch.get_device_module().synchronize()``, which on a machine
  with no GPU names the build's accelerator, CUDA, and raised; with no CUDA device there is
  nothing to wait for, so the release runs with the CPU as the default device module (the cache
  flushed, the tags kept as SGLang keeps them, the memory saver's pause a no-op as on a GPU
  without ``--enable-memory-saver``);
- a resume of a tag never released raised ``KeyError`` (SGLang removes each tag from its released
  set): only the released tags are resumed, and a resume with none is answered as done.

Nothing else here is SGLang's to change; the request and answer types are SGLang's own.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def release(original: Callable[..., Any], manager: Any, recv_req: Any) -> Any:
    """Around ``release_memory_occupation``: refused, logged, while requests run (SGLang asserts);
    with no CUDA device, SGLang's release with the CPU as the default device module (its closing
    synchronisation named CUDA; nothing runs asynchronously on the CPU)."""
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqOutput

    scheduler = manager.scheduler
    if not manager.is_fully_idle(ignore_waiting=scheduler is not None and scheduler._engine_paused):
        logger.warning("release_memory_occupation refused: requests are running (release when the server is idle)")
        return ReleaseMemoryOccupationReqOutput()
    if torch.cuda.is_available():
        return original(manager, recv_req)
    default = torch.get_device_module

    def device_module(device: Any = None) -> Any:
        return torch.cpu if device is None else default(device)

    torch.get_device_module = device_module
    try:
        return original(manager, recv_req)
    finally:
        torch.get_device_module = default


def resume(original: Callable[..., Any], manager: Any, recv_req: Any) -> Any:
    """Around ``resume_memory_occupation``: only the tags a release offloaded (all of them when
    the request names none, as SGLang reads it); with none offloaded, nothing to resume."""
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
    from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqOutput

    asked = recv_req.tags or GPU_MEMORY_ALL_TYPES
    released = [tag for tag in asked if tag in manager.offload_tags]
    if not released:
        return ResumeMemoryOccupationReqOutput()
    recv_req.tags = released
    return original(manager, recv_req)
