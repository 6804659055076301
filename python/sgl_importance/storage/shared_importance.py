"""Page importance that travels with the pages, through a shared storage tier.

``cache/stored.py`` remembers, per process, the importance of pages dropped to the
storage tier. When the tier is shared (Mooncake Store: every instance reads what
any instance wrote), a server that fetches a prefix another instance computed
would rebuild its nodes at importance 0 and never see the other instance's hits.
This module keeps one small record per page next to the page in the store:

    key    "<page key>@imp" (the page key is the storage tier's own, prefixed by the
           backend with the model path, so records are shared exactly like pages)
    value  msgpack map {"v": 1, "i": importance, "t": unix time, "h": {writer: hits}}

Merge rule (:func:`merge`): importance decays with a half-life (``HALF_LIFE_S``)
from the time it was written, and two records combine to the larger decayed value
at the later time; hits are counted per writer (the larger count per writer, the
sum over writers), so a page hit twice here and three times elsewhere has five
hits, however often each instance republishes. Writers are bounded (the
``MAX_WRITERS`` with most hits are kept). Concurrent writers may overwrite each
other's merge (read-merge-upsert is not atomic in the store); the loss is one
instance's latest update, never the page.

Cost: the scheduler only puts (node hashes, value, hits) into a dict
(:meth:`SharedImportance.publish`, O(1) per node); a background thread drains it
every ``FLUSH_S`` with one batched read and one batched upsert. Reads happen on
SGLang's storage I/O thread, batched with the storage hit query
(:meth:`SharedImportance.fetch`), before the pages themselves are fetched. A
failing store (master gone) costs a log line per outage, never the scheduler.
Nothing here imports SGLang or Mooncake: the store is duck-typed
(``get_batch(keys) -> list[bytes]``, ``upsert_batch(keys, values) -> int``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import msgpack

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
KEY_SUFFIX = "@imp"
# Importance written an hour ago counts half: old enough to fade, recent enough
# that a document hot this morning is still ranked above a one-off.
HALF_LIFE_S = 3600.0
MAX_WRITERS = 16
FLUSH_S = 0.5
# Remote records kept in memory (one float and a dict per page hash).
DEFAULT_CAPACITY = 1 << 16


@dataclass
class ImportanceRecord:
    """One page's shared importance: value at ``time``, hits per writer."""

    importance: float
    time: float
    hits: dict = field(default_factory=dict)

    @property
    def total_hits(self) -> int:
        return int(sum(self.hits.values()))

    def decayed(self, now: float, half_life_s: float = HALF_LIFE_S) -> float:
        """The importance as of ``now`` (never grows: a clock behind is not the future)."""
        age = max(0.0, now - self.time)
        return self.importance * 0.5 ** (age / half_life_s)


def encode(record: ImportanceRecord) -> bytes:
    """The bytes stored for one page."""
    return msgpack.packb(
        {"v": FORMAT_VERSION, "i": float(record.importance), "t": float(record.time), "h": dict(record.hits)}
    )


def decode(data: Optional[bytes]) -> Optional[ImportanceRecord]:
    """The record in ``data``, or None for absent, empty, foreign or damaged bytes
    (importance is advice: a bad record is ignored, never raised)."""
    if not data:
        return None
    try:
        obj = msgpack.unpackb(bytes(data), strict_map_key=False)
    except (ValueError, msgpack.UnpackException, TypeError):
        return None
    if not isinstance(obj, dict) or obj.get("v") != FORMAT_VERSION:
        return None
    importance, stamp, hits = obj.get("i"), obj.get("t"), obj.get("h", {})
    if not isinstance(importance, (int, float)) or not isinstance(stamp, (int, float)) or not isinstance(hits, dict):
        return None
    if importance != importance or importance < 0:  # NaN or negative
        return None
    clean = {str(w): int(n) for w, n in hits.items() if isinstance(n, int) and n >= 0}
    return ImportanceRecord(float(importance), float(stamp), clean)


def merge(
    a: Optional[ImportanceRecord],
    b: Optional[ImportanceRecord],
    now: float,
    half_life_s: float = HALF_LIFE_S,
    max_writers: int = MAX_WRITERS,
) -> Optional[ImportanceRecord]:
    """Combine two records of one page (see the module docstring); either may be None."""
    if a is None or b is None:
        return a if b is None else b
    importance = max(a.decayed(now, half_life_s), b.decayed(now, half_life_s))
    hits = dict(a.hits)
    for writer, n in b.hits.items():
        hits[writer] = max(hits.get(writer, 0), n)
    if len(hits) > max_writers:
        hits = dict(sorted(hits.items(), key=lambda kv: (-kv[1], kv[0]))[:max_writers])
    return ImportanceRecord(importance, max(now, a.time, b.time), hits)


def record_key(page_key: str) -> str:
    return page_key + KEY_SUFFIX


class SharedImportance:
    """This instance's view of the shared records, and its pending updates.

    Args:
        writer: this instance's name in the records' hit counts (unique per server).
        key_of: the store key of a page hash (the backend's model prefix applied).
        store: the shared store (``get_batch``, ``upsert_batch``); None until set.
        clock: wall clock (records from different machines compare by it).
    """

    def __init__(
        self,
        writer: str,
        key_of: Callable[[str], str] = lambda h: h,
        store: Any = None,
        clock: Callable[[], float] = time.time,
        capacity: int = DEFAULT_CAPACITY,
        count: Optional[Callable[[str, int], None]] = None,
    ) -> None:
        self.writer = writer
        # count(event, pages): the metric, when metrics are on.
        self.count = count or (lambda event, pages: None)
        self.key_of = key_of
        self.store = store
        self.clock = clock
        self.capacity = capacity
        # page hash -> record read from the store (the latest seen).
        self._remote: "OrderedDict[str, ImportanceRecord]" = OrderedDict()
        # node key (hashes) -> (importance, hits) waiting for the flusher.
        self._pending: dict = {}
        # page hashes whose records the flusher should read.
        self._wanted: set = set()
        self._lock = threading.Lock()
        self._failing = False
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.published_pages = 0
        self.fetched_pages = 0

    # -- scheduler side (cheap, no I/O) ---------------------------------------------------

    def publish(self, hashes: Sequence[str], importance: float, hits: int) -> None:
        """Queue a node's importance and hit count for its pages (latest wins)."""
        if not hashes or (importance <= 0.0 and hits <= 0):
            return
        with self._lock:
            self._pending[tuple(hashes)] = (float(importance), int(hits))

    def want(self, hashes: Sequence[str]) -> None:
        """Ask the flusher to read these pages' records (e.g. a node L3 admission
        deferred: another instance's hits may qualify it)."""
        if hashes:
            with self._lock:
                self._wanted.update(hashes)

    def record(self, page_hash: str) -> Optional[ImportanceRecord]:
        """The last record read from the store for ``page_hash`` (None if none)."""
        return self._remote.get(page_hash)

    def importance(self, page_hash: str) -> Optional[float]:
        """The page's shared importance as of now, or None when unknown."""
        rec = self._remote.get(page_hash)
        return None if rec is None else rec.decayed(self.clock())

    def other_hits(self, hashes: Iterable[str]) -> int:
        """Hits other instances reported for these pages (the largest over the pages:
        a node is hit as a whole)."""
        best = 0
        for h in hashes:
            rec = self._remote.get(h)
            if rec is not None:
                best = max(best, sum(n for w, n in rec.hits.items() if w != self.writer))
        return best

    def __len__(self) -> int:
        return len(self._remote)

    # -- I/O side (storage threads, the flusher) ------------------------------------------

    def fetch(self, hashes: Sequence[str]) -> int:
        """Read the records of ``hashes`` in one batch; returns how many were found."""
        if not hashes or self.store is None:
            return 0
        keys = [record_key(self.key_of(h)) for h in hashes]
        try:
            values = self.store.get_batch(keys)
        except Exception as e:  # the master may be gone: importance is advice
            self._failed("read", e)
            return 0
        found = 0
        for h, data in zip(hashes, values):
            rec = decode(data)
            if rec is not None:
                self._keep(h, rec)
                found += 1
        self.fetched_pages += found
        self.count("fetched", found)
        return found

    def _keep(self, page_hash: str, rec: ImportanceRecord) -> None:
        self._remote[page_hash] = rec
        self._remote.move_to_end(page_hash)
        while len(self._remote) > self.capacity:
            self._remote.popitem(last=False)

    def flush(self) -> int:
        """Write the pending updates (merged with what the store holds); returns pages written."""
        with self._lock:
            pending, self._pending = self._pending, {}
            wanted, self._wanted = self._wanted, set()
        if wanted and self.store is not None:
            self.fetch(sorted(wanted))
        if not pending or self.store is None:
            return 0
        now = self.clock()
        mine: dict = {}
        for hashes, (importance, hits) in pending.items():
            for h in hashes:
                rec = ImportanceRecord(importance, now, {self.writer: hits} if hits > 0 else {})
                mine[h] = merge(mine.get(h), rec, now)
        page_hashes = list(mine)
        keys = [record_key(self.key_of(h)) for h in page_hashes]
        try:
            current = self.store.get_batch(keys)
            merged = [merge(decode(old), mine[h], now) for h, old in zip(page_hashes, current)]
            rc = self.store.upsert_batch(keys, [encode(r) for r in merged])
            if rc not in (0, None):
                raise RuntimeError(f"upsert_batch returned {rc}")
        except Exception as e:
            self._failed("write", e)
            return 0
        for h, rec in zip(page_hashes, merged):
            self._keep(h, rec)
        if self._failing:
            self._failing = False
            logger.warning("sgl-importance: shared importance store reachable again")
        self.published_pages += len(merged)
        self.count("published", len(merged))
        return len(merged)

    def _failed(self, what: str, error: BaseException) -> None:
        if not self._failing:
            # One line per outage; the pages themselves are handled by the storage tier.
            self._failing = True
            logger.warning(
                "sgl-importance: shared importance %s failed (%s); serving on, "
                "importance stays local until the store answers",
                what,
                error,
            )

    def start(self) -> None:
        """Flush in a daemon thread every ``FLUSH_S`` seconds."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="sgl-importance-shared", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_S):
            try:
                self.flush()
            except Exception as e:  # never let the thread die: next flush retries
                logger.debug("shared importance flush: %s", e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
