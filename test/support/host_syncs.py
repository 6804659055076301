"""Count the host round trips a piece of torch code would make on a GPU, on any machine.

On a GPU a decode step should queue work and never wait for it; every operation that
hands a device value to Python (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``)
or whose output shape depends on device data (``nonzero``, ``unique``, boolean-mask
indexing) blocks the host until the device catches up. :class:`HostSyncCounter` is a
``TorchFunctionMode`` that sees every such call and files it by kind, by *where* (a
label the caller sets, e.g. a layer index) and by *site* (the plugin's line that made
it).

The rule, chosen so that it holds on a CPU where every tensor is on the host:

- **Every** such call on **any** tensor counts, whatever its device. The CPU backend
  cannot tell a tensor that lives on the GPU in the server from one that is on the
  host by design, so the count is an upper bound on the step's GPU synchronisations;
  a target of 0 stated on it is a real 0.
- A call counts when a frame of the code under test (``roots``: by default the
  plugin's packages, ``sgl_importance`` and ``sgl_kernel_ext``) is on the stack, and is
  filed under the innermost such frame (``module.py:line``). Calls with no such frame
  (the test world's stand-ins for SGLang's own code) are kept apart as ``outside``.
- A call made by Triton's interpreter (a ``triton`` frame nearer to the call than any
  plugin frame) is the interpreter copying a kernel's arguments, what a compiled
  kernel does not do; kept apart as ``interpreter``.
- New device tensors (kind ``alloc``, device-aware view only: not views, not written
  in place) are what a step allocates on the device; reported, not a round trip.
- Uploads (``torch.tensor``/``as_tensor``/``from_numpy`` from host data) do not block
  the host, but a plan built in Python every layer shows up as them; counted as kind
  ``upload``, reported, and not part of :data:`SYNC_KINDS`. In the device-aware view an
  upload is the device's when its tensor lands there (a factory given the device), and a
  ``copy_`` of a host tensor into a device one is one too; ``.to(device)`` of a host tensor
  is not seen where the device is the CPU (below).

A second, device-aware view (``device_only=True`` in :meth:`HostSyncCounter.total` and
:meth:`HostSyncCounter.by`) counts only the calls whose tensor would live on the device in
the server, told apart on a CPU by where it came from:

- a tensor is *on the device* when the caller marks it (:meth:`HostSyncCounter.mark`:
  what SGLang hands the plugin), when a factory made it with a ``device=`` that is a
  ``torch.device`` (the server's device object) or a string other than ``"cpu"``, when
  ``.to()`` moved it to a device other than the CPU, or when any tensor it was computed
  from is on the device; ``.cpu()``, ``.to("cpu")``, ``.tolist()``/``.item()`` leave it.
  ``.to(torch.device("cpu"))`` keeps a tensor where it was: on a CPU the server's device
  and the host are one ``torch.device``, so an upload made that way is not seen (a value
  read back from it later is missed by this view; the every-tensor view still counts it);
- so host planning on tensors made on the host (from Python data, or after the one
  read a step makes) does not count there, and a ``copy_`` from a device tensor into a
  host one does (kind ``cpu``).

Run the code under test with the counter active from the start (construction included,
:meth:`HostSyncCounter.paused` while nothing should be counted) so that every tensor's
origin is seen. Not seen: ``torch.cuda.synchronize()``/event waits (not torch functions
on tensors).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

OUTSIDE = "outside"  # no frame of the code under test on the stack
INTERPRETER = "interpreter"  # Triton's interpreter copying a kernel's arguments
STEP = "step"  # the default where: outside any label the caller set

# Kinds that block the host on a GPU (``upload`` does not; it is reported beside them).
SYNC_KINDS = (
    "item",  # .item(), int(t), float(t), operator.index(t), f"{t}"
    "tolist",
    "bool",  # bool(t), `if t:`, `t and ...`
    "cpu",  # .cpu(), .to("cpu"), .numpy()
    "nonzero",  # nonzero/argwhere/where(cond) with no size
    "data_shape",  # unique, masked_select, boolean-mask indexing, repeat_interleave without output_size, bincount
    "compare",  # torch.equal / allclose: a Python bool from device data
)
UPLOAD = "upload"
# A new device tensor (not a view, not written in place): what the step allocates on the
# device, counted in the device-aware view only; reported beside the round trips.
ALLOC = "alloc"
# A device kernel launch (device-aware view only): a call that computes into a device
# tensor (a new one, or one written in place), not a view, not an uninitialised
# allocation and not an input handed back (``.to()`` where it is, ``.contiguous()`` of a
# contiguous tensor), plus each Triton kernel launched (``launch_kernel``). On a GPU an eager
# step's host time grows with them (each costs microseconds of host time to issue).
LAUNCH = "launch"

_ITEM = {"item", "__int__", "__float__", "__index__", "__complex__", "__format__"}
_CPU = {"cpu", "numpy", "__array__"}
_NONZERO = {"nonzero", "argwhere"}
_DATA_SHAPE = {"unique", "unique_consecutive", "masked_select", "bincount"}
_COMPARE = {"equal", "allclose"}
_UPLOAD = {"tensor", "as_tensor", "from_numpy"}

_PLUGIN_ROOTS = ("sgl_importance", "sgl_kernel_ext")


def _is_cpu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _bool_index(index: Any) -> bool:
    """A boolean tensor among ``t[index]``'s indices (its result's shape is the mask's count)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def kind_of(func: Callable, args: tuple, kwargs: dict) -> Optional[str]:
    """The kind of host round trip ``func(*args, **kwargs)`` is, or None if it is not one."""
    name = getattr(func, "__name__", "")
    if name in _ITEM:
        return "item"
    if name == "tolist":
        return "tolist"
    if name == "__bool__":
        return "bool"
    if name in _CPU:
        return "cpu"
    if name == "to":
        # .to(dtype) stays where it is; .to("cpu") / .to(device="cpu") comes back.
        return "cpu" if any(_is_cpu(a) for a in (*args[1:], kwargs.get("device"))) else None
    if name in _NONZERO or (name == "where" and len(args) + len(kwargs) == 1):
        return "nonzero"
    if name in _DATA_SHAPE:
        return "data_shape"
    if name == "__getitem__" and len(args) == 2 and _bool_index(args[1]):
        return "data_shape"
    if name in ("__setitem__", "index_put_", "index_put") and len(args) >= 3 and _bool_index(args[1]):
        # A 0-d value becomes masked_fill (no sync); anything else is nonzero + index_put.
        value = args[2]
        return "data_shape" if isinstance(value, torch.Tensor) and value.dim() > 0 else None
    if name == "repeat_interleave" and "output_size" not in kwargs:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None)
        return "data_shape" if isinstance(repeats, torch.Tensor) else None
    if name in _COMPARE:
        return "compare"
    if name in _UPLOAD and not (args and isinstance(args[0], torch.Tensor)):
        return UPLOAD
    return None


@dataclass(frozen=True)
class Event:
    """One counted call: its step, where (the caller's label), kind and site, and whether
    its tensor would be on the device in the server (the device-aware view)."""

    step: int
    where: str
    kind: str
    site: str
    device: bool = False


class _Marked:
    """A set of tensors by identity that does not keep them alive (a tensor's ``==`` is
    elementwise, so ``weakref.WeakSet`` cannot hold them)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        key = id(t)
        self._refs[key] = weakref.ref(t, lambda _, key=key, refs=self._refs: refs.pop(key, None))

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


_LEAVE_DEVICE = {"cpu", "numpy", "__array__", "tolist", "item", "pin_memory"}
# Device calls that launch no kernel: allocation only, or metadata.
_NO_KERNEL = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "record_stream", "__len__"}


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, one level into lists and tuples."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _names_device(device: Any) -> Optional[bool]:
    """True/False when ``device`` names the server's device / the host; None if it is no device."""
    if isinstance(device, torch.device):
        return True
    if isinstance(device, str):
        try:
            return torch.device(device).type != "cpu"
        except RuntimeError:
            return None
    return None


class HostSyncCounter(TorchFunctionMode):
    """A ``TorchFunctionMode`` counting host round trips (see the module's rule).

    Use::

        counter = HostSyncCounter()
        with counter:
            counter.begin_step()
            with counter.where(0):
                ...  # layer 0

    Args:
        roots: the code under test: package names (a frame whose file is under a
            directory of that name) or paths (a file, or a directory it lies under).
        stand_ins: files standing in for SGLang's code (test pools, allocators): a call
            made inside them is SGLang's, kept apart as OUTSIDE.
    """

    def __init__(self, roots: Iterable[str | Path] = _PLUGIN_ROOTS, stand_ins: Iterable[str | Path] = ()) -> None:
        super().__init__()
        # Files standing in for SGLang's own code (its allocator, pools): their calls are
        # SGLang's, kept apart as OUTSIDE even when the code under test called them.
        self._stand_ins = tuple(os.path.abspath(p) for p in stand_ins)
        roots = tuple(roots)
        # A bare name is a package; anything with a slash (or a Path) is a file or directory.
        self._packages = tuple(r for r in roots if isinstance(r, str) and "/" not in r)
        self._paths = tuple(os.path.abspath(r) for r in roots if r not in self._packages)
        self.events: Counter[Event] = Counter()
        self.step = -1  # calls before the first begin_step() are step -1
        self._where = STEP
        self._counting = True
        self._device = _Marked()  # tensors on the device
        self._sites: dict[str, Optional[str]] = {}  # filename -> its root-relative name, None if not ours
        self.functions: dict[str, str] = {}  # site -> the function it is in, for reports
        # Each device allocation's (step, where, site, bytes): what a step allocates, by size.
        self.allocations: list[tuple[int, str, str, int]] = []

    # -- labels -----------------------------------------------------------------

    def begin_step(self) -> int:
        """Calls from now on belong to the next step; returns its index (from 0)."""
        self.step += 1
        return self.step

    @contextmanager
    def where(self, label: Any) -> Iterator[None]:
        """Calls inside are filed under ``str(label)`` (e.g. a layer index)."""
        outer, self._where = self._where, str(label)
        try:
            yield
        finally:
            self._where = outer

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is counted inside (warm-up, construction); tensors' origins still are."""
        outer, self._counting = self._counting, False
        try:
            yield
        finally:
            self._counting = outer

    def mark(self, *tensors: torch.Tensor) -> None:
        """These tensors are on the device (what SGLang hands the code under test)."""
        for t in tensors:
            self._device.add(t)

    def on_device(self, t: torch.Tensor) -> bool:
        return t in self._device

    # -- counting ---------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = list(_tensors(args, kwargs))
        from_device = any(t in self._device for t in inputs)
        name = getattr(func, "__name__", "")
        kind = kind_of(func, args, kwargs)
        lands = self._lands_on_device(name, args, kwargs, from_device)
        # .to() a device tensor reads it back only where it goes to the host.
        device = from_device and not (name == "to" and lands)
        if kind == UPLOAD:
            # An upload has no tensor input: it is the device's when what it makes lands there
            # (``torch.tensor(data, device=dev)``), or the device view would never see one.
            device = lands
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            # A device tensor copied into a host one is a read back (what .cpu() is); a host
            # tensor copied into a device one is an upload.
            src, dst = args[1] in self._device, args[0] in self._device
            device = src != dst
            kind = ("cpu" if src else UPLOAD) if device else None
        if kind is not None and self._counting:
            self.events[Event(self.step, self._where, kind, self._site(), device)] += 1
        result = func(*args, **kwargs)
        handed_back = any(result is t for t in inputs)  # an input itself (.to(), .contiguous()): no kernel
        counted = self._counting and name not in _NO_KERNEL
        if counted and self._launches(name, args, kwargs, result, lands and not handed_back):
            self.events[Event(self.step, self._where, LAUNCH, self._site(), True)] += 1
        lands = lands and isinstance(result, torch.Tensor)
        if isinstance(result, torch.Tensor) and not lands and from_device and handed_back:
            # On a CPU ``.cpu()``/``.to("cpu")`` hand back the device tensor itself; on a GPU
            # they make a host copy: so does this, and the copy is on the host.
            result = result.clone()
        if lands:
            if self._counting and result._base is None and not handed_back:
                site = self._site()
                self.events[Event(self.step, self._where, ALLOC, site, True)] += 1
                self.allocations.append((self.step, self._where, site, result.numel() * result.element_size()))
            self._device.add(result)
        elif isinstance(result, (tuple, list)) and from_device and name not in _LEAVE_DEVICE:
            for r in result:
                if isinstance(r, torch.Tensor):
                    self._device.add(r)
        return result

    def _launches(self, name: str, args: tuple, kwargs: dict, result: Any, lands: bool) -> bool:
        """Whether a call computes into a device tensor (the LAUNCH rule)."""
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
            return bool(args) and isinstance(args[0], torch.Tensor) and args[0] in self._device
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):
            return out in self._device
        if not lands or not isinstance(result, torch.Tensor):
            return False
        return result._base is None  # a view shares its base's storage: nothing computed

    def launch_kernel(self, name: str) -> None:
        """Count one Triton kernel launch (the caller hooks the launcher)."""
        if self._counting:
            self.events[Event(self.step, self._where, LAUNCH, self._site(through_triton=True), True)] += 1

    def _lands_on_device(self, name: str, args: tuple, kwargs: dict, from_device: bool) -> bool:
        """Whether a call's tensor result is on the device (the module's rule)."""
        if name in _LEAVE_DEVICE:
            return False
        if name == "copy_":
            return args[0] in self._device
        targets = [kwargs.get("device")]
        if name == "to":
            targets += list(args[1:])
        for target in targets:
            if isinstance(target, torch.Tensor) and name == "to":
                return target in self._device
            if name == "to" and isinstance(target, torch.device) and target.type == "cpu":
                # On a CPU the server's device and the host are one torch.device: a move
                # to it keeps a tensor where it was (an upload is not seen as one).
                return from_device
            named = _names_device(target)
            if named is not None:
                return named
        return from_device

    def _ours(self, filename: str) -> Optional[str]:
        """``filename`` relative to its root if it is code under test, else None."""
        if filename not in self._sites:
            path = Path(filename)
            name = None
            for package in self._packages:
                if package in path.parts:
                    name = "/".join(path.parts[path.parts.index(package) :])
            for root in self._paths:
                if filename == root or filename.startswith(root + "/"):
                    name = str(path.relative_to(Path(root).parent))
            self._sites[filename] = name
        return self._sites[filename]

    def _site(self, through_triton: bool = False) -> str:
        """The innermost frame of the code under test, as ``file:line``; or OUTSIDE / INTERPRETER
        (``through_triton``: Triton's own frames are passed over, for its launches)."""
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename in self._stand_ins:
                return OUTSIDE
            ours = self._ours(filename)
            if ours is not None:
                site = f"{ours}:{frame.f_lineno}"
                self.functions.setdefault(site, frame.f_code.co_name)
                return site
            if "/triton/" in filename and not through_triton:
                return INTERPRETER
            frame = frame.f_back
        return OUTSIDE

    # -- reading ----------------------------------------------------------------

    def counted(self, *, device_only: bool = False) -> Counter[Event]:
        """The events of the code under test (neither OUTSIDE nor INTERPRETER); with
        ``device_only``, those on device tensors only (the device-aware view)."""
        return Counter(
            {
                e: n
                for e, n in self.events.items()
                if e.site not in (OUTSIDE, INTERPRETER) and (e.device or not device_only)
            }
        )

    def total(self, *, kinds: Iterable[str] = SYNC_KINDS, device_only: bool = False, **match: Any) -> int:
        """Counted calls of ``kinds`` whose fields equal ``match`` (e.g. ``step=0, where="1"``)."""
        kinds = set(kinds)
        return sum(
            n
            for e, n in self.counted(device_only=device_only).items()
            if e.kind in kinds and all(getattr(e, k) == (str(v) if k == "where" else v) for k, v in match.items())
        )

    def by(self, field: str, *, kinds: Iterable[str] = SYNC_KINDS, device_only: bool = False, **match: Any) -> Counter:
        """Counted calls of ``kinds`` whose fields equal ``match`` (as in ``total``), summed by
        one field (``kind``, ``where``, ``site``, ``step``)."""
        kinds = set(kinds)
        out: Counter = Counter()
        for e, n in self.counted(device_only=device_only).items():
            if e.kind in kinds and all(getattr(e, k) == (str(v) if k == "where" else v) for k, v in match.items()):
                out[getattr(e, field)] += n
        return out

    def kept_apart(self) -> Counter:
        """Calls not counted, by OUTSIDE / INTERPRETER and kind."""
        out: Counter = Counter()
        for e, n in self.events.items():
            if e.site in (OUTSIDE, INTERPRETER):
                out[(e.site, e.kind)] += n
        return out
