"""The stored page: its bytes, a 32-byte trailer, and how the two are sealed and verified.

SGLang's storage backends move raw page bytes: nothing says which key, model or
layout they belong to, and a flipped bit on disk comes back as KV that attention
reads as if it were right. Every page that leaves the process (``wrapper.py``
writes and reads it) is stored as

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
for the ``file`` backend, format for Mooncake), dropped and recomputed. A reader
with the flag on reads both versions, whatever class the writer chose (a page
written by another server decodes by its own trailer), into the host pool's dtype.

The fingerprint hashes the model, dtype, page size, host layout and page shape,
so a page written by another configuration never reads as a hit.

xxh3-64 rather than CRC32C: it ships with SGLang already (no new wheel), runs at
memory bandwidth, and 64 bits make an undetected random corruption far less
likely than 32. It guards against accidents (media, truncation, stale files),
not against an attacker who can write the directory.
"""

from __future__ import annotations

import struct
from typing import Any, Optional

import numpy as np
import torch
import xxhash

from sgl_importance.storage import encoding

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


def bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array sharing its memory (CPU, contiguous)."""
    return tensor.contiguous().view(torch.uint8).reshape(-1).numpy()


def seal(key: str, payload: torch.Tensor, fingerprint: int) -> torch.Tensor:
    """The page as stored: its bytes followed by the trailer (a new uint8 tensor)."""
    data = bytes_of(payload)
    n = data.nbytes
    out = torch.empty(n + TRAILER_BYTES, dtype=torch.uint8)
    buf = out.numpy()
    buf[:n] = data
    checksum = _digest(key, fingerprint, memoryview(data))
    TRAILER.pack_into(buf, n, MAGIC, VERSION, 0, fingerprint, n, checksum)
    return out


def check(key: str, sealed: torch.Tensor, fingerprint: int, payload_bytes: int) -> Optional[str]:
    """Why ``sealed`` (as read back for ``key``) is not a good page, or None if it is."""
    buf = bytes_of(sealed)
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
    raw = bytes_of(data)
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
