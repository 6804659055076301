"""CPU streams that SGLang's HiCache transfer engine can synchronise.

``L2TransferEngine`` calls ``stream.synchronize()`` when a transfer raises;
``torch.cpu.Stream`` has no such method, so the AttributeError would hide the
real error. CPU work has finished by the time the call returns, so there is
nothing to wait for.
"""

from __future__ import annotations

from typing import Any

import torch


class CpuStream(torch.cpu.Stream):
    def synchronize(self) -> None:
        return None


def use_cpu_streams(engine: Any) -> None:
    """Give a freshly built ``L2TransferEngine`` streams it can synchronise."""
    engine.device_to_host_stream = CpuStream()
    engine.host_to_device_stream = CpuStream()
