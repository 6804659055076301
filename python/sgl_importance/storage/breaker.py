"""The write breaker: storage writes pause after repeated failures and resume by themselves.

After ``max_failures`` consecutive failed writes (disk full, read-only, directory
gone, Mooncake master down) the wrapper stops writing, warns once, and tries again
after ``retry_s``; device and host tiers keep serving meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

# Consecutive failed page writes before writes pause (one batch of SGLang's backup
# stops at its first failure, so this is a few batches, not a few pages).
MAX_WRITE_FAILURES = 4


class WriteBreaker:
    """Stop writing after ``max_failures`` consecutive failures; retry after ``retry_s``.

    ``clock`` is injectable so tests can move time without sleeping.
    """

    def __init__(
        self,
        max_failures: int,
        retry_s: float,
        describe: str,
        clock: Callable[[], float] = time.monotonic,
        on_pause: Optional[Callable[[], None]] = None,
    ) -> None:
        self.max_failures = max_failures
        self.retry_s = retry_s
        self.describe = describe
        self.clock = clock
        self.on_pause = on_pause
        self._failures = 0
        self._open_until: Optional[float] = None
        self._warned = False
        self._lock = threading.Lock()

    @property
    def paused(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether a write may be tried now (True again once ``retry_s`` passed)."""
        with self._lock:
            return self._open_until is None or self.clock() >= self._open_until

    def record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                if self._open_until is not None:
                    logger.warning("sgl-importance: storage tier writes resumed (%s)", self.describe)
                self._failures = 0
                self._open_until = None
                self._warned = False
                return
            self._failures += 1
            if self._failures >= self.max_failures:
                self._open_until = self.clock() + self.retry_s
                if not self._warned and self.on_pause is not None:
                    self.on_pause()
                if not self._warned:
                    # One line per outage, not one per retry.
                    self._warned = True
                    logger.warning(
                        "sgl-importance: storage tier writes paused after %d consecutive failures "
                        "(%s); serving from device and host, retrying every %.0f s",
                        self._failures,
                        self.describe,
                        self.retry_s,
                    )
