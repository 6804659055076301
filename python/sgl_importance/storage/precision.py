"""The precision each stored page is sealed at: the flag's setting and the graded classes.

``--importance-storage-precision`` picks how the wrapper encodes KV pages
(``encoding.py``): ``uniform8`` / ``uniform4`` store every page at 8 or 4 bits,
``graded`` stores each page in the class its importance earned. Under ``graded``
the scheduler thread grades a node's pages when SGLang sends the node to storage
(``cache/stored.py``, before ``write_backup_storage``) and records each page's
class by hash in the process's :class:`PageClasses`; the storage I/O thread reads
the class by hash when it seals the page. The grading is the one record both
sides share: the scheduler writes it, the wrapper reads it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sgl_importance.storage import encoding

logger = logging.getLogger(__name__)

# Page hashes whose class is remembered (≈100 bytes each): 64 Ki pages ≈ 6.5 MB.
DEFAULT_CAPACITY = 1 << 16


@dataclass
class Precision:
    """How the wrapper encodes pages (``--importance-storage-precision`` other than off).

    Args:
        setting: the flag's value (graded, uniform8, uniform4).
        classify: the class of a page by its storage key (KV pages only).
    """

    setting: str
    classify: Callable[[str], int]


class PageClasses:
    """Page hash → storage class, decided when the page's node is sent to storage.

    Args:
        keep: fraction of a node's pages at the model's dtype (sinks included).
        cold: fraction of a node's pages at 4 bits.
        sink_pages: leading pages of a sequence that are attention sinks (kept).
        order: ``"importance"`` or ``"blind"`` (see ``encoding.grade``).
        capacity: page hashes remembered (written pages are sealed within
            moments of their node's grading, so this only has to cover the queue).
    """

    def __init__(
        self,
        *,
        keep: float,
        cold: float,
        sink_pages: int,
        order: str = "importance",
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self.keep = keep
        self.cold = cold
        self.sink_pages = sink_pages
        self.order = order
        self.capacity = capacity
        self._by_hash: "OrderedDict[str, int]" = OrderedDict()
        # The scheduler thread assigns, storage I/O threads read.
        self._lock = threading.Lock()
        # Pages sealed without a grading (written outside write_backup_storage).
        self.ungraded = 0

    def assign(self, hashes: Sequence[str], scores: Sequence[float], first_page: int) -> list[int]:
        """Grade one node's pages (``first_page``: the node's first page in its sequence)."""
        sink = [first_page + i < self.sink_pages for i in range(len(hashes))]
        classes = encoding.grade(scores, sink=sink, keep=self.keep, cold=self.cold, order=self.order, keys=hashes)
        with self._lock:
            for h, c in zip(hashes, classes):
                self._by_hash[h] = c
                self._by_hash.move_to_end(h)
            while len(self._by_hash) > self.capacity:
                self._by_hash.popitem(last=False)
        return classes

    def class_of(self, page_hash: str) -> int:
        """The class to seal ``page_hash`` in (int8 for a page never graded)."""
        with self._lock:
            cls = self._by_hash.get(page_hash)
        if cls is None:
            self.ungraded += 1
            return encoding.INT8
        return cls


def page_classes_for(setting: str, thresholds: Optional[dict]) -> Optional[PageClasses]:
    """The process's page grading under ``graded`` (None otherwise); the runtime owns it,
    the hook before ``write_backup_storage`` fills it and the wrapper reads it."""
    if setting != "graded":
        return None
    from sgl_importance.config import STORAGE_PRECISION_DEFAULTS

    t = {**STORAGE_PRECISION_DEFAULTS, **(thresholds or {})}
    return PageClasses(keep=t["keep"], cold=t["cold"], sink_pages=t["sink_pages"], order=t["order"])


def make_precision(setting: str, classes: Optional[PageClasses] = None) -> Optional[Precision]:
    """The wrapper's ``Precision`` for a flag value (None for off); under ``graded`` it
    seals each page in the class ``classes`` (the process's grading) holds for it."""
    if setting == "off":
        return None
    if setting == "uniform8":
        classify: Callable[[str], int] = lambda key: encoding.INT8  # noqa: E731
    elif setting == "uniform4":
        classify = lambda key: encoding.INT4  # noqa: E731
    elif setting == "graded":
        if classes is None:
            raise ValueError("storage precision 'graded' needs the process's page grading")
        classify = classes.class_of
    else:
        raise ValueError(f"unknown storage precision {setting!r}")

    logger.info("sgl-importance: storage tier pages are encoded (%s)", setting)
    return Precision(setting, classify)
