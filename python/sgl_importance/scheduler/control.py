"""SGLang control requests that took the scheduler down, answered instead (``plugin.py`` wraps them).

SGLang 0.5.23's scheduler exits on an exception from a request it handles, and the server with
it. Found by probing the admin endpoints of a running server with edge-case bodies:

- ``/update_weights_from_disk`` with a ``load_format`` that is no ``LoadFormat`` raised before
  SGLang's own try; one whose loader fails, or a checkpoint that does not fit the model, failed
  inside it, and SGLang's rollback then re-read the *new* path (it records the path before
  loading) and raised again. Here an unknown format is answered as a failure with nothing
  loaded, and any other failure restores the path that was serving and reloads its weights
  (the rollback SGLang meant); only a failed reload of the serving weights still raises, as a
  server that cannot hold its own weights should not answer.
- ``/update_weights_from_tensor`` (between ``begin_weight_update`` and ``end_weight_update``)
  with tensors that do not deserialize (an empty list, bytes that are no pickle) raised before
  anything was loaded; a payload that deserializes to something else than SGLang's pairs or
  bucket (an int, a dict, a list of numbers) raised while loading: answered as failures, the
  second saying that the weights before the failing one may be loaded (SGLang loads in order
  and keeps no copy to roll back to; the client resends or reloads).
- ``/send_weights_to_remote_instance`` naming a group never initialised (``KeyError``), or with
  the wrong number of ports (an assertion): answered as a failure; sending reads the weights
  only, so nothing is left half done.
- ``/release_memory_occupation`` while requests run failed SGLang's assertion that the server is
  idle: refused (SGLang's own idleness test, so a release after ``/pause_generation`` passes as
  before) and logged; the answer has no field for the refusal, so the client reads success. On
  torch_cpu the release ended with ``torch.get_device_module().synchronize()``, which with no GPU
  names the build's accelerator, CUDA, and raised: with no CUDA device there is nothing to wait
  for, so the release runs with the CPU as the default device module (the cache flushed, the
  tags kept as SGLang keeps them, the memory saver's pause a no-op as on a GPU without
  ``--enable-memory-saver``).
- ``/resume_memory_occupation`` of a tag never released raised ``KeyError`` (SGLang removes each
  tag from its released set): only the released tags are resumed; with none, answered as done.
- A generate request in a session with ``replace`` and no ``rid`` (start the session afresh)
  cleared the session's nodes while iterating over them (``RuntimeError``): the nodes are
  cleared here first, from the roots of their trees, so SGLang's loop finds none.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def update_weights_from_disk(
    original: Callable[..., tuple], updater: Any, model_path: str, load_format: Any, *args: Any, **kwargs: Any
) -> tuple:
    """Around ``WeightUpdater.update_weights_from_disk``: ``(False, message)`` for a format SGLang
    has not, or a load that failed (the serving weights reloaded); SGLang's answer otherwise."""
    from sglang.srt.configs.load_config import LoadFormat

    known = {f.value for f in LoadFormat}
    if isinstance(load_format, str) and load_format.lower() not in known:
        return False, f"Unknown load_format {load_format!r}; allowed: {', '.join(sorted(known))}. Nothing was loaded."
    serving_path = updater.model_config.model_path
    serving_format = updater.get_model_runner().load_config.load_format
    try:
        return original(updater, model_path, load_format, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- any failure of the load, answered after the rollback
        logger.warning("update_weights_from_disk failed (%s: %s); reloading %s", type(e).__name__, e, serving_path)
        updater.model_config.model_path = serving_path
        ok, message = original(updater, serving_path, serving_format, *args, **kwargs)
        if not ok:
            raise RuntimeError(f"the serving weights could not be reloaded from {serving_path}: {message}") from e
        return False, f"Failed to update weights from {model_path}: {type(e).__name__}: {e}. Reloaded {serving_path}."


def create_req(original: Callable[..., Any], session: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Around ``Session.create_req``: a ``replace`` with no ``rid`` clears the session's request
    trees from their roots (each clear takes its subtree), then SGLang's call."""
    params = req.session_params
    if not session.streaming and params is not None and params.replace and params.rid is None:
        nodes = session.req_nodes
        roots = [n for n in nodes.values() if n.parent is None or n.parent.req.rid not in nodes]
        for root in roots:
            root.clear(nodes)
    return original(session, req, *args, **kwargs)


class _Unreadable(ValueError):
    """Tensors of a weight update that did not deserialize (nothing loaded yet)."""


def update_weights_from_tensor(original: Callable[..., Any], manager: Any, recv_req: Any) -> Any:
    """Around ``SchedulerWeightUpdaterManager.update_weights_from_tensor``: a failure answered
    where the tensors do not deserialize or do not load; SGLang's answer otherwise."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqOutput

    worker = manager.tp_worker
    read = worker.deserialize_own_rank

    def checked(serialized: Any) -> Any:
        try:
            return read(serialized)
        except Exception as e:  # noqa: BLE001 -- whatever the payload raised, before any load
            raise _Unreadable(f"the serialized tensors do not deserialize: {type(e).__name__}: {e}") from e

    worker.deserialize_own_rank = checked  # for this call (SGLang reads it through the worker)
    try:
        return original(manager, recv_req)
    except _Unreadable as e:
        message = f"{e}; nothing was loaded"
    except Exception as e:  # noqa: BLE001 -- a load that raised: answered, not fatal
        message = (
            f"the tensors did not load: {type(e).__name__}: {e}; weights listed before the failing "
            "one may be loaded (no rollback: resend them, or reload from disk)"
        )
    finally:
        del worker.deserialize_own_rank
    logger.warning("update_weights_from_tensor failed: %s", message)
    return UpdateWeightsFromTensorReqOutput(success=False, message=message)


def send_weights_to_remote_instance(original: Callable[..., tuple], exporter: Any, *args: Any, **kwargs: Any) -> tuple:
    """Around ``WeightExporter.send_weights_to_remote_instance``: ``(False, message)`` for what
    SGLang raised (a group never initialised, a ports list of the wrong length)."""
    try:
        return original(exporter, *args, **kwargs)
    except (AssertionError, KeyError, ValueError) as e:
        return False, f"Failed to send weights: {type(e).__name__}: {e}"


def release_memory_occupation(original: Callable[..., Any], manager: Any, recv_req: Any) -> Any:
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


def resume_memory_occupation(original: Callable[..., Any], manager: Any, recv_req: Any) -> Any:
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
