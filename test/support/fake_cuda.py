"""A CPU stand-in for a CUDA device, to find host/device mixing without a GPU.

Under :class:`FakeCuda` (a ``TorchFunctionMode``) some CPU tensors are *tagged* as
living on ``cuda:0``: they report that device, factories asked for a CUDA device make
tagged tensors, ``.to("cuda")`` tags and ``.cpu()`` untags (a copy), and an op's result
is tagged when its inputs are. An op CUDA would refuse because it mixes devices (a
tagged tensor with an untagged one of dim > 0, a host tensor indexed by a device
index, a host value written into a device tensor or the reverse) is recorded, with
the line of ``python/sgl_importance`` that ran it, instead of raised, so one run lists
every site.

It models PyTorch's device rules, not CUDA: whatever runs under
``torch._C.DisableTorchFunction()`` (a Triton kernel under the interpreter) is not seen.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("cuda", 0)
CPU = torch.device("cpu")
# Ops whose tensor arguments must all share the first one's device (indices included).
SAME_DEVICE = {
    "index_select",
    "gather",
    "scatter",
    "scatter_",
    "scatter_add_",
    "index_put_",
    "index_add_",
    "index_fill_",
    "masked_fill",
    "masked_fill_",
    "take_along_dim",
}
# Results that are not tensors living anywhere.
HOST_RESULTS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__len__", "numel", "dim", "size"}


def _cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _device_like(value: Any) -> bool:
    return isinstance(value, torch.device) or (isinstance(value, str) and (value == "cpu" or value.startswith("cuda")))


class FakeCuda(TorchFunctionMode):
    """Tags tensors as device tensors and records where host and device tensors mix.

    Attributes:
        violations: ``"file:line code" -> what mixed``, first occurrence of each site.
    """

    def __init__(self, source: str = "/sgl_importance/") -> None:
        super().__init__()
        self.source = source
        self._tagged: dict[int, torch.Tensor] = {}
        self.violations: dict[str, str] = {}

    def tag(self, value: Any) -> Any:
        """Mark ``value`` (a tensor, or tensors in a tuple) as living on the device."""
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                self._tagged[id(t)] = t  # held, so an id is never reused for another tensor
        return value

    def on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self._tagged.get(id(t)) is t

    def _untag(self, t: torch.Tensor) -> None:
        self._tagged.pop(id(t), None)

    def _note(self, why: str) -> None:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if self.source in frame.filename and "/test/" not in frame.filename:
                where = f"{frame.filename.split('python/')[-1]}:{frame.lineno} {frame.line}"
                self.violations.setdefault(where, why)
                return

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: C901
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        prop = getattr(getattr(func, "__self__", None), "__name__", None)
        if name == "__get__" and prop in ("device", "is_cuda"):
            if prop == "is_cuda":
                return self.on_device(args[0])
            return FAKE if self.on_device(args[0]) else func(*args, **kwargs)
        if name == "to":
            return self._to(func, args, kwargs)
        if name == "cpu":
            out = func(*args, **kwargs)
            if self.on_device(args[0]):
                out = out.clone() if out is args[0] else out
                self._untag(out)
            return out
        if _cuda(kwargs.get("device")):
            kwargs["device"] = CPU
            return self.tag(func(*args, **kwargs))
        if (name.startswith("new_") or name.endswith("_like")) and "device" not in kwargs:
            out = func(*args, **kwargs)
            return self.tag(out) if self.on_device(args[0]) else out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tags = [self.on_device(t) for t in tensors]
        if name == "__getitem__":
            index = [i for i in tree_flatten(args[1])[0] if isinstance(i, torch.Tensor)]
            if not self.on_device(args[0]) and any(self.on_device(i) for i in index):
                self._note("host tensor indexed by a device tensor")
            out = func(*args, **kwargs)
            return self.tag(out) if self.on_device(args[0]) else out
        if name == "copy_":
            return func(*args, **kwargs)
        if any(tags) and not all(tags):
            self._check_mixed(name, args, tensors, tags)
        out = func(*args, **kwargs)
        if not any(tags) or name in HOST_RESULTS:
            return out
        if isinstance(out, torch.Tensor) and args and out is args[0] and not self.on_device(args[0]):
            return out  # in place on a host tensor: it stays on the host
        tree_map(lambda t: self.tag(t) if isinstance(t, torch.Tensor) else t, out)
        return out

    def _to(self, func, args, kwargs):
        src, target, rest = args[0], kwargs.pop("device", None), []
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                target, rest = (FAKE if self.on_device(a) else CPU), [a.dtype]
            elif _device_like(a):
                target = a
            else:
                rest.append(a)
        out = func(src, *rest, **kwargs)
        if target is None:
            return self.tag(out) if self.on_device(src) else out
        if _cuda(target):
            # A host tensor moved over is a new tensor: the host one stays on the host.
            return self.tag(out.clone() if out is src and not self.on_device(src) else out)
        if self.on_device(src):
            out = out.clone() if out is src else out
            self._untag(out)
        return out

    def _check_mixed(self, name, args, tensors, tags) -> None:
        if name == "__setitem__":
            dest, value = args[0], args[2] if len(args) > 2 else None
            index = [i for i in tree_flatten(args[1])[0] if isinstance(i, torch.Tensor)]
            if self.on_device(dest):
                bad = isinstance(value, torch.Tensor) and not self.on_device(value) and value.dim() > 0
            else:
                bad = self.on_device(value) or any(self.on_device(i) for i in index)
            if bad:
                self._note("a value written across devices")
        elif name in SAME_DEVICE:
            first = self.on_device(args[0])
            if any(self.on_device(t) != first and (t.dim() > 0 or not first) for t in tensors[1:]):
                self._note(f"{name} across devices")
        else:
            host = [tuple(t.shape) for t, g in zip(tensors, tags) if not g and t.dim() > 0]
            if host:
                self._note(f"{name} mixes device tensors with host tensors of shapes {host}")
