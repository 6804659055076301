"""The wrapper that seals every page on its way to a storage backend and verifies it back.

``IntegrityStorage`` wraps any ``HiCacheStorage`` (the ``file`` backend, Mooncake,
...) and stores each page in the sealed format of ``page.py``. Every read is
verified; a page that is missing its trailer, short, foreign or whose checksum
disagrees is a *miss*: it is dropped (so a good copy can be written again),
counted, logged once per location, and the prefix is recomputed by prefill.

With ``--importance-storage-precision`` on, KV pages are encoded in the class
``precision.py`` picks for them. Encoded pages vary in size, so they are read
whole (``BackendOps.read``, the ``file`` and Mooncake adapters); a backend without
it is sealed and verified as before, unencoded.

Writes go through the write breaker (``breaker.py``); device and host tiers keep
serving while it holds writes. Reads never raise: an I/O error is a miss.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Union

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from sgl_importance.storage import encoding
from sgl_importance.storage.breaker import WriteBreaker
from sgl_importance.storage.page import (
    LAYOUT,
    SHORT,
    TRAILER_BYTES,
    UNREADABLE,
    bytes_of,
    check,
    check_whole,
    layout_fingerprint,
    page_geometry,
    seal,
    seal_encoded,
)
from sgl_importance.storage.precision import Precision

if TYPE_CHECKING:
    from sgl_importance.sglang_types.tree import HostPool

logger = logging.getLogger(__name__)


@dataclass
class BackendOps:
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
    read: Optional[Callable[[str], Union[bytes, bytearray, np.ndarray, None]]] = None


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
        ops: Optional[BackendOps] = None,
        on_corrupt: Optional[Callable[[str], None]] = None,
        breaker: Optional[WriteBreaker] = None,
        precision: Optional[Precision] = None,
        on_page: Optional[Callable[[str, int, int], None]] = None,
    ) -> None:
        self.inner = inner
        self.on_page = on_page
        self.identity = dict(identity)
        self.ops = ops or BackendOps()
        self.on_corrupt = on_corrupt
        self.breaker = breaker
        self._fingerprints: dict[int, int] = {}  # by id() of the pool
        self._logged: set[str] = set()
        # Damaged keys the backend cannot delete: answered as absent from now on.
        self._refused: set[str] = set()
        self.mem_pool_host: Optional[HostPool] = None
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

    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        self.mem_pool_host = mem_pool_host
        self.inner.register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: HostPool, host_pool_name: str) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.inner.register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        self.inner.on_host_pools_registered()

    def fingerprint_of(self, pool: HostPool, pool_name: str = "kv") -> int:
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

    def _geometry(self, pool: Optional[HostPool]) -> Optional[encoding.PageGeometry]:
        if pool is None:
            return None
        if id(pool) not in self._geometries:
            self._geometries[id(pool)] = page_geometry(pool)
        return self._geometries[id(pool)]

    def _read(
        self, key: str, target: torch.Tensor, fingerprint: int, kv_pool: Optional[HostPool] = None
    ) -> Optional[torch.Tensor]:
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
            np.copyto(bytes_of(target), scratch.numpy()[:payload_bytes])
        else:
            target.copy_(scratch[:payload_bytes].view(target.dtype).view(target.shape))
        if self.on_page is not None:
            self.on_page("read", encoding.FULL, payload_bytes)
        return target

    def _read_whole(
        self, key: str, target: torch.Tensor, fingerprint: int, kv_pool: Optional[HostPool]
    ) -> Optional[torch.Tensor]:
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
            page_bytes = bytes_of(page)
        if target.is_contiguous():
            np.copyto(bytes_of(target), page_bytes)
        else:
            target.copy_(torch.from_numpy(page_bytes.copy()).view(target.dtype).view(target.shape))
        if self.on_page is not None:
            self.on_page("read", cls, length)
        return target

    def _seal(
        self, key: str, value: torch.Tensor, fingerprint: int, kv_pool: Optional[HostPool]
    ) -> tuple[torch.Tensor, int]:
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

    def _write(self, key: str, value: torch.Tensor, fingerprint: int, kv_pool: Optional[HostPool] = None) -> bool:
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

    def _sweep(self, keys: List[str], pool: HostPool, fingerprint: int, kv_pool: Optional[HostPool] = None) -> None:
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

    def _sealing(self, pool: HostPool, pool_name: str) -> tuple[int, Optional[HostPool]]:
        """The fingerprint pages of ``pool`` are sealed with, and the pool whose geometry
        encodes them: ``pool`` for KV pages, None for a sidecar pool's (kept at their dtype)."""
        return self.fingerprint_of(pool, pool_name), (pool if str(pool_name) == "kv" else None)

    def _pages_into_pool(
        self, pool: HostPool, pool_name: str, keys: List[str], host_indices: torch.Tensor
    ) -> List[bool]:
        page_size = int(pool.page_size)
        fingerprint, kv_pool = self._sealing(pool, pool_name)
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

    def _pages_from_pool(
        self, pool: HostPool, pool_name: str, keys: List[str], host_indices: torch.Tensor
    ) -> List[bool]:
        page_size = int(pool.page_size)
        fingerprint, kv_pool = self._sealing(pool, pool_name)
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

    def clear(self) -> None:
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
