"""The CPU kernels in C (``csrc/paged_decode.c``, ``csrc/layer_ops.c``, ``csrc/linear.c``), built on first use.

Why C and not torch: a decode step over page lists in torch must first gather the
listed pages into a contiguous copy (a read and a write of the whole context) and
then read that copy back in separate matmuls and softmax passes; the C kernel reads
each page once, straight from the pool, with an online softmax. It is compiled with
the system's C compiler (``$CC``, default ``cc``) for the machine it runs on
(``-march=native``) into a cache folder, and loaded with ctypes: no torch headers,
about a second to build. No compiler, or a failed build, leaves :func:`library`
returning None, and callers keep the torch path (one warning says why).

``SGL_KERNEL_EXT_NATIVE=0`` turns it off; ``SGL_KERNEL_EXT_CACHE`` moves the cache
(default ``~/.cache/sgl-kernel-ext``); both are read at a process's first call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

NATIVE_ENV = "SGL_KERNEL_EXT_NATIVE"
CACHE_ENV = "SGL_KERNEL_EXT_CACHE"
# The decode kernel, a layer's small ops (``layer_ops``) and its linear layers (``linear``), one library.
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(_CSRC / f"{name}.c" for name in ("paged_decode", "layer_ops", "linear"))
# Reassociation lets a dot product end in a tree of vector adds instead of 16 scalar
# adds in a row (the dominant cost without it); no -ffast-math: infinities stay.
FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno",
)  # fmt: skip

_lock = threading.Lock()
_loaded: dict[tuple[str, tuple[str, ...]], Optional[ctypes.CDLL]] = {}
# The default build once resolved (None included): the environment is read once a process.
_default: list[Optional[ctypes.CDLL]] = []


def enabled() -> bool:
    """False when ``$SGL_KERNEL_EXT_NATIVE`` is ``0``/``false``/``off``."""
    return os.environ.get(NATIVE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _cpu_signature() -> str:
    # -march=native code must not be reused on a CPU with fewer instructions.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together (TP ranks)
    # never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *flags, *map(str, SOURCES), "-o", str(out), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(out, target)


def library(defines: tuple[str, ...] = ()) -> Optional[ctypes.CDLL]:
    """The built kernel, or None where it is turned off or cannot be built.

    Args:
        defines: preprocessor names to build with (``-D``), each build cached apart:
            ``("SGL_PAGED_DECODE_NO_IMPORTANCE",)`` is the decode without its importance
            code, the baseline ``benchmark/kernel/bench_cpu_decode.py`` times against.
    """
    if not defines and _default:
        return _default[0]  # a decode calls this per layer: no environment read, no lock
    if not enabled():
        return None
    compiler = os.environ.get("CC", "cc")
    flags = (*FLAGS, *(f"-D{name}" for name in defines))
    with _lock:
        if (compiler, flags) in _loaded:
            return _loaded[(compiler, flags)]
        lib = None
        try:
            if shutil.which(compiler) is None:
                raise RuntimeError(f"no C compiler {compiler!r} on PATH")
            version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
            parts = [*(source.read_text() for source in SOURCES), " ".join(flags), version, _cpu_signature()]
            key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
            cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sgl-kernel-ext")
            target = cache / f"paged_decode-{key}.so"
            if not target.exists():
                _build(compiler, flags, target)
            lib = ctypes.CDLL(str(target))
            _declare(lib)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("sgl-kernel-ext: the C decode kernel is unavailable, using the torch path: %s", e)
            lib = None
        _loaded[(compiler, flags)] = lib
        if not defines:
            _default.append(lib)
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.sgl_paged_decode.restype = i32
    lib.sgl_paged_decode.argtypes = [
        p, i64, f32, p, p, p, p,  # q, q_stride, sm_scale, k_pool, v_pool, k_extra, v_extra
        p, p, p, p,  # table, tokens, live, sinks
        i64, i64,  # num_pages, extra_pages
        i64, i64, i64, i64,  # the extras' strides: K page, K token, V page, V token (elements)
        i64, i64,  # bs, max_pages
        i64, i64, i64, i64, i64,  # page_size, kv, group, d, dv
        i32, i32, i32, f32, i32,  # dtype, split_pages, splits, logit_cap, importance
        p, p, p, p, p,  # page_max, page_sum, split_max, split_sum, split_acc
        p, p, p,  # out, lse, mass
        i32,  # threads
    ]  # fmt: skip
    lib.sgl_rms_norm_f32.restype = i32
    lib.sgl_rms_norm_f32.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, f32]
    lib.sgl_rotary_f32.restype = i32
    lib.sgl_rotary_f32.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i32]
    lib.sgl_linear_f32.restype = i32
    # x, x_stride, rows, w, k, n, bias, y, y_stride, threads
    lib.sgl_linear_f32.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, i32]
    lib.sgl_store_kv.restype = i32
    lib.sgl_store_kv.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64]
    lib.sgl_key_code_pages.restype = i32
    lib.sgl_key_code_pages.argtypes = [
        p, p, p, p, p, p,  # q, codes, ids, low, step, valid
        i64, i64, i64, i64, i64, i64, i64, i64,  # kv, n, group, d, listed, page_size, stride_h, stride_r
        f32, f32,  # logit_cap, margin
        p, p,  # lse, err
        i32,  # threads
    ]  # fmt: skip
