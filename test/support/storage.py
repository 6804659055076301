"""The `file` tier's directory as tests see it: its page files, and waiting for writes to land.

SGLang writes pages to the file tier in the background after they reach the host pool; a test
that flushes the device and host pools and expects storage hits must first wait for those writes,
or on a slow machine (CI's 2 cores) the flush wins the race and the request finds nothing stored.
"""

from __future__ import annotations

import time
from pathlib import Path


def page_files(directory: Path) -> list[Path]:
    """The tier's page files (``.bin``), sorted; none if the directory does not exist yet."""
    return sorted(p for p in directory.iterdir() if p.suffix == ".bin") if directory.exists() else []


def settled(directory: Path, timeout: float = 120.0, quiet_s: float = 2.0) -> list[Path]:
    """The page files once there is at least one and their number stopped changing for ``quiet_s``."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(page_files(directory))
        if n != last:
            last, since = n, time.monotonic()
        elif n > 0 and time.monotonic() - since > quiet_s:
            break
        time.sleep(0.25)
    return page_files(directory)
