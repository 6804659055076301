"""Storage-tier page encodings: the model's dtype, 8 bits or 4 bits per element.

A page that leaves the process for the storage tier (``page.py`` seals it)
is stored in one of three *classes*:

| class  | code | elements                         | scales (float16, in the page)         |
|--------|------|----------------------------------|---------------------------------------|
| full   | 0    | the host pool's bytes, unchanged | none                                  |
| int8   | 1    | 8-bit codes                      | keys per channel, values per token    |
| int4   | 2    | 4-bit codes, two per byte        | keys per channel, values per token    |

Keys are quantised per channel (one scale and minimum per layer, head and channel,
over the page's tokens) and values per token (one per layer, head and token, over
the channels): keys have outlier channels, values do not, as KIVI (Liu et al.,
2024) found. Quantisation is asymmetric: ``x ≈ min + code * scale``, with ``min``
and ``scale`` stored as float16 and the codes computed against the stored
(rounded) values, so decoding needs nothing but the page. The scale is rounded up
to the next float16 so that the page's largest value stays within the codes; each
element is then off by at most ``scale / 2`` plus the float16 rounding of ``min``
(:func:`error_bound`).

Encoded bytes, in order: key codes, value codes (both in the canonical order
``layer, head, token, channel``), key scales, key minimums, value scales, value
minimums. The size depends only on the class and the page's geometry
(:func:`encoded_nbytes`). Encoding is deterministic: the same page and class give
the same bytes (plain elementwise torch ops on the CPU, no reduction whose order
could vary beyond min/max).

A page that float16 scales cannot describe (a non-finite element, a range beyond
float16) is not encoded: :func:`encode` returns None and the caller stores it at
the model's dtype.

Which pages get which class (:func:`grade`): attention-sink pages and the pages
with the highest importance at the model's dtype, the coldest at 4 bits, the rest
at 8 bits, by fractions of the pages graded together.

Pure torch; nothing here imports SGLang.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

FULL = 0
INT8 = 1
INT4 = 2
CLASS_NAMES = {FULL: "full", INT8: "int8", INT4: "int4"}
_BITS = {INT8: 8, INT4: 4}
_SCALE_DTYPE = torch.float16

# The canonical order of a page's axes: K/V, layer, head, token, channel.
CANONICAL = ("kv", "layer", "head", "token", "dim")
# The flat page's axes for each host-pool layout (SGLang's MHA host pool: the page
# as ``get_data_page(flat=True)`` returns it). "one" is a size-1 axis.
LAYOUT_AXES = {
    "layer_first": ("kv", "layer", "token", "head", "dim"),
    "page_first": ("kv", "token", "layer", "head", "dim"),
    "page_first_direct": ("kv", "one", "layer", "token", "head", "dim"),
    "page_head": ("kv", "one", "head", "token", "layer", "dim"),
}


@dataclass(frozen=True)
class PageGeometry:
    """How one MHA page's elements are arranged.

    Args:
        layers: layers in the page.
        tokens: tokens per page (the page size).
        heads: KV heads.
        dim: channels per head.
        layout: the host pool's layout (a key of ``LAYOUT_AXES``).
    """

    layers: int
    tokens: int
    heads: int
    dim: int
    layout: str = "layer_first"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUT_AXES:
            raise ValueError(f"page layout {self.layout!r} is not encodable; known: {', '.join(LAYOUT_AXES)}")

    @property
    def numel(self) -> int:
        return 2 * self.layers * self.tokens * self.heads * self.dim

    def _sizes(self) -> dict:
        return {"kv": 2, "one": 1, "layer": self.layers, "head": self.heads, "token": self.tokens, "dim": self.dim}

    def layout_shape(self) -> tuple[int, ...]:
        sizes = self._sizes()
        return tuple(sizes[a] for a in LAYOUT_AXES[self.layout])

    def to_canonical(self, flat: torch.Tensor) -> torch.Tensor:
        """The flat page as ``[2, layers, heads, tokens, dim]``."""
        axes = LAYOUT_AXES[self.layout]
        x = flat.reshape(self.layout_shape())
        if "one" in axes:
            x = x.squeeze(axes.index("one"))
            axes = tuple(a for a in axes if a != "one")
        return x.permute([axes.index(a) for a in CANONICAL])

    def from_canonical(self, x: torch.Tensor) -> torch.Tensor:
        """A canonical ``[2, layers, heads, tokens, dim]`` page, flat in the layout's order."""
        axes = [a for a in LAYOUT_AXES[self.layout] if a != "one"]
        out = x.permute([CANONICAL.index(a) for a in axes]).contiguous()
        return out.reshape(-1)


def _parts(geometry: PageGeometry, cls: int) -> list[tuple[str, int]]:
    """(part, bytes) of an encoded page, in storage order."""
    g = geometry
    half = g.layers * g.heads * g.tokens * g.dim
    codes = half * _BITS[cls] // 8
    key_groups = g.layers * g.heads * g.dim
    value_groups = g.layers * g.heads * g.tokens
    s = _SCALE_DTYPE.itemsize
    return [
        ("k", codes),
        ("v", codes),
        ("k_scale", key_groups * s),
        ("k_min", key_groups * s),
        ("v_scale", value_groups * s),
        ("v_min", value_groups * s),
    ]


def encoded_nbytes(geometry: PageGeometry, cls: int, dtype: torch.dtype) -> int:
    """Bytes of a page of ``geometry`` stored in class ``cls`` (``dtype``: the model's)."""
    if cls == FULL:
        return geometry.numel * dtype.itemsize
    if cls not in _BITS:
        raise ValueError(f"unknown page class {cls}")
    return sum(n for _, n in _parts(geometry, cls))


def bits_per_element(geometry: PageGeometry, cls: int, dtype: torch.dtype) -> float:
    """Stored bits per page element, scales included."""
    return 8.0 * encoded_nbytes(geometry, cls, dtype) / geometry.numel


def _quantise(x: torch.Tensor, dim: int, levels: int) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Codes, float16 scales and float16 minimums of ``x`` (float32) grouped over ``dim``."""
    low = x.amin(dim=dim, keepdim=True).to(_SCALE_DTYPE)
    if not bool(torch.isfinite(low).all()):
        return None
    low32 = low.float()
    span = x.amax(dim=dim, keepdim=True) - low32
    scale = (span / levels).to(_SCALE_DTYPE)
    if not bool(torch.isfinite(scale).all()):
        return None
    # Round up so that the largest element's code is at most ``levels``.
    short = (scale.float() * levels < span) & (span > 0)
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    if not bool(torch.isfinite(scale).all()):
        return None
    scale32 = scale.float()
    safe = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    codes = torch.round((x - low32) / safe).clamp_(0, levels)
    codes = torch.where(scale32 > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
    return codes, scale, low


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1, 2)
    return flat[:, 0] | (flat[:, 1] << 4)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=1).reshape(-1)


def encode(page: torch.Tensor, geometry: PageGeometry, cls: int) -> Optional[torch.Tensor]:
    """The stored bytes (uint8, 1-D) of ``page`` (flat, in the layout's order) in ``cls``.

    Returns None when the page cannot be encoded in ``cls`` (see the module
    docstring); the caller stores it at the model's dtype then.
    """
    if page.numel() != geometry.numel:
        raise ValueError(f"page of {page.numel()} elements, geometry says {geometry.numel}")
    if cls == FULL:
        return page.contiguous().view(torch.uint8).reshape(-1)
    if cls not in _BITS:
        raise ValueError(f"unknown page class {cls}")
    x = geometry.to_canonical(page).float()
    levels = (1 << _BITS[cls]) - 1
    keys = _quantise(x[0], dim=2, levels=levels)  # per channel: over tokens
    values = _quantise(x[1], dim=3, levels=levels)  # per token: over channels
    if keys is None or values is None:
        return None
    kc, ks, kl = keys
    vc, vs, vl = values
    if cls == INT4:
        kc, vc = _pack4(kc), _pack4(vc)
    pieces = [kc.reshape(-1), vc.reshape(-1)]
    pieces += [t.contiguous().view(torch.uint8).reshape(-1) for t in (ks, kl, vs, vl)]
    return torch.cat(pieces)


def decode(data: torch.Tensor, geometry: PageGeometry, cls: int, dtype: torch.dtype) -> torch.Tensor:
    """The page (flat, layout order, ``dtype``) that ``data`` encodes in ``cls``.

    Raises:
        ValueError: ``data`` is not the size the class and geometry need.
    """
    data = data.reshape(-1)
    expected = encoded_nbytes(geometry, cls, dtype)
    if data.numel() != expected:
        raise ValueError(f"encoded page of {data.numel()} bytes, class {CLASS_NAMES.get(cls, cls)} needs {expected}")
    if cls == FULL:
        return data.view(dtype).clone()
    g = geometry
    at = 0
    part: dict = {}
    for name, n in _parts(g, cls):
        part[name] = data[at : at + n]
        at += n
    half = (g.layers, g.heads, g.tokens, g.dim)

    def codes(name: str) -> torch.Tensor:
        raw = part[name]
        return (_unpack4(raw) if cls == INT4 else raw).reshape(half).float()

    def f16(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return part[name].clone().view(_SCALE_DTYPE).reshape(shape).float()

    key_shape = (g.layers, g.heads, 1, g.dim)
    value_shape = (g.layers, g.heads, g.tokens, 1)
    k = f16("k_min", key_shape) + codes("k") * f16("k_scale", key_shape)
    v = f16("v_min", value_shape) + codes("v") * f16("v_scale", value_shape)
    return g.from_canonical(torch.stack((k, v)).to(dtype))


def error_bound(page: torch.Tensor, geometry: PageGeometry, cls: int) -> torch.Tensor:
    """The largest error :func:`decode` (to float32) may make on each element of ``page``
    (canonical ``[2, layers, heads, tokens, dim]``): half a scale step, plus the float16
    rounding of the group's minimum and of the scale, for the groups the class uses."""
    if cls == FULL:
        return torch.zeros((2, geometry.layers, geometry.heads, geometry.tokens, geometry.dim))
    x = geometry.to_canonical(page).float()
    levels = (1 << _BITS[cls]) - 1
    out = []
    for half, dim in ((x[0], 2), (x[1], 3)):
        low = half.amin(dim=dim, keepdim=True)
        span = half.amax(dim=dim, keepdim=True) - low
        # float16 has 11 significant bits: the stored min is off by at most 2^-11 of
        # itself (or the subnormal step); the rounded-up scale by 2^-10 of itself.
        step = span / levels * (1 + 2.0**-9) + 2.0**-24
        slack = low.abs() * 2.0**-11 + 2.0**-24
        out.append((step / 2 + slack * (levels + 1) / levels).expand_as(half))
    return torch.stack(out)


def grade(
    scores: Sequence[float],
    *,
    sink: Sequence[bool],
    keep: float,
    cold: float,
    order: str = "importance",
    keys: Optional[Sequence[str]] = None,
) -> list[int]:
    """The class of each of a run of pages (one node's), by importance.

    Sink pages are kept at the model's dtype and count toward the ``keep`` fraction;
    the rest of the ``floor(keep * n)`` full pages are the most important ones; the
    ``floor(cold * n)`` least important non-full pages get 4 bits, the others 8.
    Ties keep page order (earlier pages rank higher). When every score is equal
    there is nothing to rank by: only sinks are kept, the pages that would have
    been cold are cold by position (the last ones).

    Args:
        scores: one importance per page (any non-negative scale).
        sink: whether each page is an attention-sink page.
        keep: fraction of pages at the model's dtype, in [0, 1].
        cold: fraction of pages at 4 bits, in [0, 1 - keep].
        order: ``"importance"``, or ``"blind"``: the same class fractions with pages
            ranked by a hash of their key instead (the control that tells what
            importance adds at equal bytes).
        keys: the pages' storage keys (needed for ``"blind"``).
    """
    n = len(scores)
    if len(sink) != n:
        raise ValueError("scores and sink differ in length")
    if order == "blind":
        if keys is None or len(keys) != n:
            raise ValueError("order 'blind' needs one key per page")
        rank_value = [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little") for k in keys]
    elif order == "importance":
        rank_value = list(scores)
    else:
        raise ValueError(f"unknown grading order {order!r}")
    classes = [INT8] * n
    n_keep = int(keep * n + 1e-9)
    n_cold = int(cold * n + 1e-9)
    informative = order == "blind" or (n > 0 and max(rank_value) > min(rank_value))
    # Descending by value; ties by page order.
    ranked = sorted(range(n), key=lambda i: (-rank_value[i], i))
    full = [i for i in range(n) if sink[i]]
    if informative:
        for i in ranked:
            if len(full) >= n_keep:
                break
            if not sink[i]:
                full.append(i)
    for i in full:
        classes[i] = FULL
    candidates = [i for i in reversed(ranked) if classes[i] != FULL] if informative else None
    if candidates is None:
        candidates = [i for i in reversed(range(n)) if classes[i] != FULL]
    for i in candidates[:n_cold]:
        classes[i] = INT4
    return classes
