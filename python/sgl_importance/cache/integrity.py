"""Integrity of every page that leaves the process for the storage tier.

SGLang's storage backends move raw page bytes: nothing says which key, model or
layout they belong to, and a flipped bit on disk comes back as KV that attention
reads as if it were right. ``IntegrityStorage`` wraps any ``HiCacheStorage`` (the
``file`` tier, Mooncake, ...) and stores each page as

    payload (the page's bytes, unchanged, at offset 0) | trailer (32 bytes)
    trailer = magic "SGIK" | version u16 | reserved u16 | fingerprint u64
              | payload length u64 | xxh3-64(key | fingerprint | length | payload)

With ``--importance-storage-precision`` on, pages may be stored encoded
(``encoding.py``: the model's dtype, 8 or 4 bits) and the trailer is version 2:

    payload (the encoded bytes) | trailer (32 bytes)
    trailer = magic "SGIK" | version 2 u16 | class u16 | fingerprint u64
              | payload length u64 | xxh3-64(key | fingerprint | length | version | class | payload)

The class sits in the u16 that version 1 reserves, and the checksum covers it, so
a flipped class is a checksum miss, never a page decoded the wrong way. A reader
with the flag off accepts version 1 only: an encoded page is a miss to it (short
for the ``file`` tier, format for Mooncake), dropped and recomputed. A reader with
the flag on reads both versions, whatever class the writer chose (a page written by
another server decodes by its own trailer), into the host pool's dtype. Encoded
pages vary in size, so they are read whole (``TierOps.read``, the ``file`` and
Mooncake tiers); a backend without it is sealed and verified as before, unencoded.

The fingerprint hashes the model, dtype, page size, host layout and page shape,
so a page written by another configuration never reads as a hit. Every read is
verified; a page that is missing its trailer, short, foreign or whose checksum
disagrees is a *miss*: it is dropped (so a good copy can be written again),
counted, logged once per location, and the prefix is recomputed by prefill.

xxh3-64 rather than CRC32C: it ships with SGLang already (no new wheel), runs at
memory bandwidth, and 64 bits make an undetected random corruption far less
likely than 32. It guards against accidents (media, truncation, stale files),
not against an attacker who can write the directory.

Writes go through a breaker: after ``max_failures`` consecutive failed writes
(disk full, read-only, directory gone) the wrapper stops writing, warns once, and
tries again after ``retry_s``; device and host tiers keep serving meanwhile.
Reads never raise: an I/O error is a miss.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageFailureInjector

from sgl_importance.cache import encoding

logger = logging.getLogger(__name__)

MAGIC = b"SGIK"
VERSION = 1
# Pages sealed with --importance-storage-precision on: the class in the u16 after it.
ENCODED_VERSION = 2
TRAILER = struct.Struct("<4sHHQQQ")
TRAILER_BYTES = TRAILER.size  # 32

# Reasons a stored page is refused (the `reason` label of the corrupt counter).
SHORT = "short"  # fewer bytes than a sealed page: truncated, or a partial write
FORMAT = "format"  # no trailer of ours: zero-filled, overwritten, or a raw SGLang page
LAYOUT = "layout"  # sealed by another model / dtype / page size / layout
CHECKSUM = "checksum"  # bytes changed after they were written
UNREADABLE = "unreadable"  # the backend raised while reading


def layout_fingerprint(**fields: Any) -> int:
    """A 64-bit digest of the fields that decide how a page's bytes are read."""
    text = ";".join(f"{k}={fields[k]!r}" for k in sorted(fields))
    return xxhash.xxh3_64_intdigest(text.encode())


def _digest(key: str, fingerprint: int, payload: memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(key.encode())
    h.update(struct.pack("<QQ", fingerprint, len(payload)))
    h.update(payload)
    return h.intdigest()


def _digest_encoded(key: str, fingerprint: int, cls: int, payload: memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(key.encode())
    h.update(struct.pack("<QQHH", fingerprint, len(payload), ENCODED_VERSION, cls))
    h.update(payload)
    return h.intdigest()


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array sharing its memory (CPU, contiguous)."""
    return tensor.contiguous().view(torch.uint8).reshape(-1).numpy()


def seal(key: str, payload: torch.Tensor, fingerprint: int) -> torch.Tensor:
    """The page as stored: its bytes followed by the trailer (a new uint8 tensor)."""
    data = _bytes_of(payload)
    n = data.nbytes
    out = torch.empty(n + TRAILER_BYTES, dtype=torch.uint8)
    buf = out.numpy()
    buf[:n] = data
    checksum = _digest(key, fingerprint, memoryview(data))
    TRAILER.pack_into(buf, n, MAGIC, VERSION, 0, fingerprint, n, checksum)
    return out


def check(key: str, sealed: torch.Tensor, fingerprint: int, payload_bytes: int) -> Optional[str]:
    """Why ``sealed`` (as read back for ``key``) is not a good page, or None if it is."""
    buf = _bytes_of(sealed)
    if buf.nbytes < payload_bytes + TRAILER_BYTES:
        return SHORT
    magic, version, _, stored_fp, length, checksum = TRAILER.unpack_from(buf, payload_bytes)
    if magic != MAGIC or version != VERSION:
        return FORMAT
    if stored_fp != fingerprint or length != payload_bytes:
        return LAYOUT
    if _digest(key, fingerprint, memoryview(buf[:payload_bytes])) != checksum:
        return CHECKSUM
    return None


def seal_encoded(key: str, data: torch.Tensor, fingerprint: int, cls: int) -> torch.Tensor:
    """A version-2 page: ``data`` (the page's bytes in class ``cls``) and its trailer."""
    raw = _bytes_of(data)
    n = raw.nbytes
    out = torch.empty(n + TRAILER_BYTES, dtype=torch.uint8)
    buf = out.numpy()
    buf[:n] = raw
    checksum = _digest_encoded(key, fingerprint, cls, memoryview(raw))
    TRAILER.pack_into(buf, n, MAGIC, ENCODED_VERSION, cls, fingerprint, n, checksum)
    return out


def check_whole(key: str, stored: np.ndarray, fingerprint: int) -> tuple[Optional[str], int, int]:
    """Verify a whole stored object (either version) as read back for ``key``.

    Returns:
        (why it is not a good page or None, its class, its payload length). The
        caller still checks the length against what the class and pool need.
    """
    size = stored.nbytes
    if size < TRAILER_BYTES:
        return SHORT, encoding.FULL, 0
    magic, version, cls, stored_fp, length, checksum = TRAILER.unpack_from(stored, size - TRAILER_BYTES)
    if magic != MAGIC or version not in (VERSION, ENCODED_VERSION):
        return FORMAT, encoding.FULL, 0
    if length != size - TRAILER_BYTES:
        return SHORT, encoding.FULL, 0
    if stored_fp != fingerprint:
        return LAYOUT, encoding.FULL, 0
    payload = memoryview(stored[:length])
    if version == VERSION:
        ok = cls == 0 and _digest(key, fingerprint, payload) == checksum
        return (None if ok else CHECKSUM), encoding.FULL, length
    if _digest_encoded(key, fingerprint, cls, payload) != checksum:
        return CHECKSUM, encoding.FULL, 0
    if cls not in encoding.CLASS_NAMES:
        return FORMAT, encoding.FULL, 0
    return None, cls, length


def page_geometry(pool: Any) -> Optional[encoding.PageGeometry]:
    """The geometry of an MHA host pool's pages, or None for a pool whose pages are
    not one K and one V tensor per layer (those are stored at the model's dtype)."""
    try:
        layout = str(pool.layout)
        geometry = encoding.PageGeometry(
            layers=int(pool.layer_num),
            tokens=int(pool.page_size),
            heads=int(pool.head_num),
            dim=int(pool.head_dim),
            layout=layout,
        )
        page = pool.get_dummy_flat_data_page()
    except (AttributeError, ValueError, TypeError, NotImplementedError):
        return None
    if page.numel() != geometry.numel or not page.dtype.is_floating_point:
        return None
    return geometry


@dataclass
class Precision:
    """How the wrapper encodes pages (``--importance-storage-precision`` other than off).

    Args:
        setting: the flag's value (graded, uniform8, uniform4).
        classify: the class of a page by its storage key (KV pages only).
    """

    setting: str
    classify: Callable[[str], int]


@dataclass
class TierOps:
    """What the wrapper needs to know about one concrete backend beyond the interface.

    Args:
        where: a human-readable location of a key (a file path), for the log.
        drop: remove a damaged key so that the next write stores it again.
        prepare: called before writes resume after a pause (e.g. recreate a directory).
        read: the whole stored object of a key (any length; None when absent), which
            encoded pages need.
    """

    where: Callable[[str], str] = lambda key: key
    drop: Optional[Callable[[str], None]] = None
    prepare: Optional[Callable[[], None]] = None
    read: Optional[Callable[[str], Any]] = None


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


class IntegrityStorage(HiCacheStorage):
    """A ``HiCacheStorage`` that seals pages on write and verifies them on read.

    Every entry point SGLang's controllers call is served through the inner
    backend's ``get``/``set`` with sealed buffers; the zero-copy ``*_v1`` and
    per-pool ``*_v2`` calls copy through the host pool, so the checksum covers the
    exact bytes that come back (zero-copy backends trade one memcpy per page for it).

    Args:
        inner: the backend SGLang built.
        identity: fields of the fingerprint that do not come from the host pool
            (model name, ranks).
        ops: backend specifics (location for the log, dropping a damaged key).
        on_corrupt: called with the reason for each refused page (the metric).
        breaker: the write breaker (None: never pause).
        precision: page encoding (None: every page at the model's dtype, version 1).
        on_page: called with ("write" or "read", class, stored payload bytes) for each
            page written or served (the per-class metric).
    """

    def __init__(
        self,
        inner: HiCacheStorage,
        identity: dict,
        ops: Optional[TierOps] = None,
        on_corrupt: Optional[Callable[[str], None]] = None,
        breaker: Optional[WriteBreaker] = None,
        precision: Optional[Precision] = None,
        on_page: Optional[Callable[[str, int, int], None]] = None,
    ) -> None:
        self.inner = inner
        self.on_page = on_page
        self.identity = dict(identity)
        self.ops = ops or TierOps()
        self.on_corrupt = on_corrupt
        self.breaker = breaker
        self._fingerprints: dict[Any, int] = {}
        self._logged: set[str] = set()
        # Damaged keys the backend cannot delete: answered as absent from now on.
        self._refused: set[str] = set()
        self.mem_pool_host: Any = None
        self._local = threading.local()
        # Pages refused since start (the metric counts the same, when metrics are on).
        self.damaged_pages = 0
        if precision is not None and self.ops.read is None:
            logger.warning(
                "sgl-importance: --importance-storage-precision %s needs whole-page reads, which "
                "this storage backend lacks; its pages stay at the model's dtype",
                precision.setting,
            )
            precision = None
        self.precision = precision
        self._geometries: dict[int, Optional[encoding.PageGeometry]] = {}

    # -- host pools ---------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self.inner.register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.inner.register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        self.inner.on_host_pools_registered()

    def fingerprint_of(self, pool: Any, pool_name: Any = "kv") -> int:
        """The layout fingerprint of pages of ``pool`` (cached per pool)."""
        cached = self._fingerprints.get(id(pool))
        if cached is None:
            page = pool.get_dummy_flat_data_page()
            cached = layout_fingerprint(
                **self.identity,
                pool=str(pool_name),
                dtype=str(pool.dtype),
                page_size=int(pool.page_size),
                layout=str(pool.layout),
                page_shape=tuple(page.shape),
                page_dtype=str(page.dtype),
            )
            self._fingerprints[id(pool)] = cached
        return cached

    # -- single pages -------------------------------------------------------------------

    def _geometry(self, pool: Any) -> Optional[encoding.PageGeometry]:
        if pool is None:
            return None
        if id(pool) not in self._geometries:
            self._geometries[id(pool)] = page_geometry(pool)
        return self._geometries[id(pool)]

    def _read(self, key: str, target: torch.Tensor, fingerprint: int, kv_pool: Any = None) -> Optional[torch.Tensor]:
        if key in self._refused:
            return None
        if self.precision is not None:
            return self._read_whole(key, target, fingerprint, kv_pool)
        payload_bytes = target.numel() * target.element_size()
        scratch = self._scratch_for(payload_bytes + TRAILER_BYTES)
        try:
            got = self.inner.get(key, scratch)
        except Exception as e:  # a short file raises in HiCacheFile; EIO anywhere
            reason = SHORT if "short read" in str(e).lower() else UNREADABLE
            self._damaged(key, reason, e)
            return None
        if got is None:
            return None  # absent (evicted, or never written): an ordinary miss
        reason = check(key, scratch, fingerprint, payload_bytes)
        if reason is not None:
            self._damaged(key, reason)
            return None
        # numpy, not Tensor.copy_: one page is small, and torch's intra-op threads
        # cost more to wake than the copy itself on a busy CPU (10x in the benchmark).
        if target.is_contiguous():
            np.copyto(_bytes_of(target), scratch.numpy()[:payload_bytes])
        else:
            target.copy_(scratch[:payload_bytes].view(target.dtype).view(target.shape))
        if self.on_page is not None:
            self.on_page("read", encoding.FULL, payload_bytes)
        return target

    def _read_whole(self, key: str, target: torch.Tensor, fingerprint: int, kv_pool: Any) -> Optional[torch.Tensor]:
        """Read an object of any length, verify it and decode it into ``target``."""
        try:
            data = self.ops.read(key)
        except Exception as e:
            self._damaged(key, UNREADABLE, e)
            return None
        if data is None:
            return None
        stored = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        reason, cls, length = check_whole(key, stored, fingerprint)
        payload_bytes = target.numel() * target.element_size()
        geometry = self._geometry(kv_pool)
        if reason is None:
            if cls == encoding.FULL:
                fits = length == payload_bytes
            else:
                fits = geometry is not None and length == encoding.encoded_nbytes(geometry, cls, target.dtype)
            if not fits:
                reason = LAYOUT
        if reason is not None:
            self._damaged(key, reason)
            return None
        if cls == encoding.FULL:
            page_bytes = stored[:length]
        else:
            page = encoding.decode(torch.from_numpy(stored[:length].copy()), geometry, cls, target.dtype)
            page_bytes = _bytes_of(page)
        if target.is_contiguous():
            np.copyto(_bytes_of(target), page_bytes)
        else:
            target.copy_(torch.from_numpy(page_bytes.copy()).view(target.dtype).view(target.shape))
        if self.on_page is not None:
            self.on_page("read", cls, length)
        return target

    def _seal(self, key: str, value: torch.Tensor, fingerprint: int, kv_pool: Any) -> tuple[torch.Tensor, int]:
        """The stored object of a page, and its class."""
        if self.precision is None:
            return seal(key, value, fingerprint), encoding.FULL
        geometry = self._geometry(kv_pool)
        data: Optional[torch.Tensor] = None
        cls = encoding.FULL
        if geometry is not None and value.numel() == geometry.numel:
            cls = self.precision.classify(key)
            if cls != encoding.FULL:
                data = encoding.encode(value.reshape(-1), geometry, cls)
                if data is None:  # not representable with float16 scales
                    cls = encoding.FULL
        if data is None:
            data = value.contiguous().view(torch.uint8).reshape(-1)
        return seal_encoded(key, data, fingerprint, cls), cls

    def _scratch_for(self, nbytes: int) -> torch.Tensor:
        # One read buffer per I/O thread (prefetch and backup run on their own threads):
        # a fresh page-sized allocation per read faulted its memory in every time and
        # made verified reads 5x slower than raw ones in the benchmark.
        buf = getattr(self._local, "scratch", None)  # absent on a thread's first read
        if buf is None or buf.numel() != nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self._local.scratch = buf
        return buf

    def _write(self, key: str, value: torch.Tensor, fingerprint: int, kv_pool: Any = None) -> bool:
        if self.breaker is not None:
            if not self.breaker.allow():
                return False
            if self.breaker.paused and self.ops.prepare is not None:
                try:
                    self.ops.prepare()
                except OSError:
                    pass
        try:
            sealed, cls = self._seal(key, value, fingerprint, kv_pool)
            ok = bool(self.inner.set(key, sealed))
        except Exception as e:
            logger.debug("storage write of %s failed: %s", key, e)
            ok = False
        if ok:
            self._refused.discard(key)
            if self.on_page is not None:
                self.on_page("write", cls, sealed.numel() - TRAILER_BYTES)
        if self.breaker is not None:
            self.breaker.record(ok)
        return ok

    def _damaged(self, key: str, reason: str, error: Optional[BaseException] = None) -> None:
        where = self.ops.where(key)
        self.damaged_pages += 1
        if self.on_corrupt is not None:
            self.on_corrupt(reason)
        if where not in self._logged:
            self._logged.add(where)
            logger.warning(
                "sgl-importance: storage page refused (%s%s), recomputing it: %s",
                reason,
                f": {error}" if error is not None else "",
                where,
            )
        dropped = False
        if self.ops.drop is not None:
            try:
                self.ops.drop(key)
                dropped = True
            except OSError as e:
                logger.debug("could not drop %s: %s", where, e)
        if not dropped:
            self._refused.add(key)

    def _kv_fingerprint(self) -> int:
        return self.fingerprint_of(self.mem_pool_host)

    def get(
        self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> Optional[torch.Tensor]:
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self._read(key, target_location, self._kv_fingerprint(), self.mem_pool_host)

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        return self._write(key, value, self._kv_fingerprint(), self.mem_pool_host)

    def batch_get(
        self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> List[Optional[torch.Tensor]]:
        targets = target_locations or [None] * len(keys)
        out: List[Optional[torch.Tensor]] = []
        for i, (key, target) in enumerate(zip(keys, targets)):
            damaged_before = self.damaged_pages
            page = self.get(key, target)
            out.append(page)
            if page is None:
                # Storage is read as a prefix: nothing after a miss is used.
                out.extend([None] * (len(keys) - len(out)))
                if self.damaged_pages > damaged_before:
                    self._sweep(keys[i + 1 :], self.mem_pool_host, self._kv_fingerprint(), self.mem_pool_host)
                break
        return out

    def _sweep(self, keys: List[str], pool: Any, fingerprint: int, kv_pool: Any = None) -> None:
        """Verify (and drop if damaged) the pages after a damaged one.

        Damage rarely comes alone (a bad disk region, a stray process); without this
        only the first damaged page of a prefix would be found per request, and
        the rest would be kept, skipped on rewrite, and refused one request at a time.
        """
        for key in keys:
            self._read(key, pool.get_dummy_flat_data_page(), fingerprint, kv_pool)

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        for key, value in zip(keys, values):
            if not self.set(key, value):
                return False
        return True

    def exists(self, key: str) -> bool:
        return key not in self._refused and self.inner.exists(key)

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        if self._refused:
            for i, key in enumerate(keys):
                if key in self._refused:
                    keys = keys[:i]
                    break
        return self.inner.batch_exists(keys, extra_info) if keys else 0

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        return self.inner.batch_exists_v2(keys, pool_transfers, extra_info)

    # -- host-index paths (zero-copy backends, per-pool transfers) ----------------------

    def _pages_into_pool(self, pool: Any, pool_name: Any, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        page_size = int(pool.page_size)
        fingerprint = self.fingerprint_of(pool, pool_name)
        # Only KV pages are encoded; sidecar pools' pages stay at their dtype.
        kv_pool = pool if str(pool_name) == "kv" else None
        results = [False] * len(keys)
        for i, key in enumerate(keys):
            damaged_before = self.damaged_pages
            page = self._read(key, pool.get_dummy_flat_data_page(), fingerprint, kv_pool)
            if page is None:
                if self.damaged_pages > damaged_before:
                    self._sweep(keys[i + 1 :], pool, fingerprint, kv_pool)
                break
            pool.set_from_flat_data_page(int(host_indices[i * page_size]), page)
            results[i] = True
        return results

    def _pages_from_pool(self, pool: Any, pool_name: Any, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        page_size = int(pool.page_size)
        fingerprint = self.fingerprint_of(pool, pool_name)
        kv_pool = pool if str(pool_name) == "kv" else None
        results = [False] * len(keys)
        for i, key in enumerate(keys):
            page = pool.get_data_page(int(host_indices[i * page_size]), flat=True)
            if not self._write(key, page, fingerprint, kv_pool):
                break
            results[i] = True
        return results

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        return self._pages_into_pool(self.mem_pool_host, "kv", keys, host_indices)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        return self._pages_from_pool(self.mem_pool_host, "kv", keys, host_indices)

    def _v2(self, transfers: Iterable[Any], move: Callable[..., List[bool]]) -> dict:
        results: dict = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self.registered_pools[transfer.name]
            # The enum's value for a PoolName; a name given as a plain str has no .value.
            name = str(getattr(transfer.name, "value", transfer.name))
            # Sidecar pools get their own key per page, as SGLang's file tier names them.
            pool_keys = keys if name == "kv" else [f"{k}.{name}" for k in keys]
            page_size = int(pool.page_size)
            indices = transfer.host_indices
            if indices is None or indices.numel() != len(keys) * page_size:
                results[transfer.name] = [False] * len(keys)
                continue
            results[transfer.name] = move(pool, name, pool_keys, indices)
        return results

    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        return self._v2(transfers, self._pages_into_pool)

    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        return self._v2(transfers, self._pages_from_pool)

    # -- the rest is the backend's --------------------------------------------------------

    def clear(self) -> Any:
        self._refused.clear()
        return self.inner.clear()

    def get_stats(self) -> Any:
        return self.inner.get_stats()

    def close(self) -> None:
        # HiCacheStorage declares no close(); some backends (Mooncake, hf3fs) have one.
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:
        # Backend-specific attributes SGLang reads (e.g. HiCacheFile.file_path).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


# Consecutive failed page writes before writes pause (one batch of SGLang's backup
# stops at its first failure, so this is a few batches, not a few pages).
MAX_WRITE_FAILURES = 4


def wrap_backend(
    backend: HiCacheStorage,
    backend_name: str,
    storage_config: Any,
    *,
    retry_s: float,
    enable_metrics: bool,
    precision: str = "off",
    thresholds: Optional[dict] = None,
) -> IntegrityStorage:
    """``backend`` as SGLang built it, sealed and verified (see the module docstring).

    Args:
        backend: what ``StorageBackendFactory.create_backend`` returned.
        backend_name: ``--hicache-storage-backend``.
        storage_config: SGLang's ``HiCacheStorageConfig`` (model, ranks).
        retry_s: seconds writes stay paused after repeated failures.
        enable_metrics: count refused pages and pauses on ``/metrics``.
        precision: ``--importance-storage-precision`` (off: pages at the model's dtype).
        thresholds: the graded thresholds (``ImportanceConfig.storage_precision_thresholds``).
    """
    from sgl_importance.cache import file_tier

    ranks = {"tp_rank": storage_config.tp_rank, "pp_rank": storage_config.pp_rank}
    identity = {
        "model": storage_config.model_name or "",
        "tp_size": storage_config.tp_size,
        "pp_size": storage_config.pp_size,
        **ranks,
    }
    ops = TierOps()
    describe = f"backend {backend_name}"
    # The failure injector SGLang may put around the backend hides its attributes.
    concrete = backend._backend if isinstance(backend, HiCacheStorageFailureInjector) else backend
    if backend_name == "file" and hasattr(concrete, "file_path"):
        ops = file_tier.file_tier_ops(concrete)
        describe = f"directory {concrete.file_path}"
        if storage_config.tp_rank == 0:
            file_tier.remove_leftovers(concrete.file_path)
    elif backend_name == "mooncake" and hasattr(concrete, "store"):
        from sgl_importance.cache import mooncake_tier

        # Sealed pages need whole-object get/set; SGLang's zero-copy paths split
        # each page in two. Pages and their importance share the model prefix.
        backend = mooncake_tier.MooncakePages(concrete, storage_config.tp_rank)
        backend.shared = mooncake_tier.start_shared_importance(backend, storage_config.tp_rank)
        ops = mooncake_tier.mooncake_tier_ops(backend)
        describe = f"mooncake master {concrete.config.master_server_address}"
    metrics = None
    if enable_metrics:
        from sgl_importance.metrics import storage_integrity_metrics

        metrics = storage_integrity_metrics(ranks)
    breaker = WriteBreaker(
        MAX_WRITE_FAILURES,
        retry_s,
        describe,
        on_pause=metrics.paused if metrics is not None else None,
    )
    logger.info("sgl-importance: storage tier pages are sealed and verified (%s)", describe)
    return IntegrityStorage(
        backend,
        identity,
        ops=ops,
        on_corrupt=metrics.corrupt if metrics is not None else None,
        breaker=breaker,
        precision=make_precision(precision, thresholds),
        on_page=metrics.page_of_class if metrics is not None else None,
    )


def make_precision(setting: str, thresholds: Optional[dict]) -> Optional[Precision]:
    """The wrapper's ``Precision`` for a flag value (None for off). Under ``graded`` this
    also installs the process's page grading (``stored.PageClasses``), which the hook
    before ``write_backup_storage`` fills."""
    if setting == "off":
        return None
    if setting == "uniform8":
        classify: Callable[[str], int] = lambda key: encoding.INT8  # noqa: E731
    elif setting == "uniform4":
        classify = lambda key: encoding.INT4  # noqa: E731
    elif setting == "graded":
        from sgl_importance.cache import stored
        from sgl_importance.config import STORAGE_PRECISION_DEFAULTS

        t = {**STORAGE_PRECISION_DEFAULTS, **(thresholds or {})}
        classes = stored.PageClasses(keep=t["keep"], cold=t["cold"], sink_pages=t["sink_pages"], order=t["order"])
        stored.set_page_classes(classes)
        classify = classes.class_of
    else:
        raise ValueError(f"unknown storage precision {setting!r}")

    logger.info("sgl-importance: storage tier pages are encoded (%s)", setting)
    return Precision(setting, classify)


def create_with_integrity(
    original: Callable[..., HiCacheStorage],
    factory: Any,
    backend_name: str,
    storage_config: Any,
    mem_pool_host: Any,
    **kwargs: Any,
) -> HiCacheStorage:
    """Around ``StorageBackendFactory.create_backend``: every backend, wrapped unless
    ``--importance-storage-integrity off``."""
    from sglang.srt.runtime_context import get_server_args

    from sgl_importance.config import config_of

    backend = original(factory, backend_name, storage_config, mem_pool_host, **kwargs)
    try:
        server_args = get_server_args()
    except Exception:  # built outside a launched server (tests, tools)
        server_args = None
    config = config_of(server_args)
    if config.storage_integrity == "off":
        return backend
    return wrap_backend(
        backend,
        backend_name,
        storage_config,
        retry_s=config.storage_retry_s,
        enable_metrics=server_args is not None and bool(server_args.enable_metrics),
        precision=config.storage_precision,
        thresholds=config.storage_precision_thresholds(),
    )
