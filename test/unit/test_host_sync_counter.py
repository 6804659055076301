"""The host round-trip counter (``support/host_syncs.py``) counts what it claims to.

Each call that would make a GPU wait on the host is counted once, by kind, at the line
that made it; calls that would not are not counted; calls without the code under test
on the stack are kept apart. The expected sites are read from this file's own
``# sync: KIND`` markers, not written down as numbers.
"""

from __future__ import annotations

import inspect
from collections import Counter

import torch

from support.host_syncs import ALLOC, LAUNCH, OUTSIDE, STEP, SYNC_KINDS, UPLOAD, HostSyncCounter


def _one_of_each(t: torch.Tensor) -> list:
    a = t[0].item()  # sync: item
    b = t.tolist()  # sync: tolist
    c = bool(t[1])  # sync: bool
    d = t.cpu()  # sync: cpu
    e = t.nonzero()  # sync: nonzero
    return [a, b, c, d, e]


def _data_dependent(t: torch.Tensor) -> list:
    mask = t > 1
    return [
        int(t[2]),  # sync: item
        t.to("cpu"),  # sync: cpu
        t.numpy(),  # sync: cpu
        torch.where(mask),  # sync: nonzero
        t.unique(),  # sync: data_shape
        t[mask],  # sync: data_shape
        t.masked_select(mask),  # sync: data_shape
        t.repeat_interleave(t),  # sync: data_shape
        torch.equal(t, t),  # sync: compare
        torch.tensor([1, 2]),  # sync: upload
    ]


def _none(t: torch.Tensor) -> list:
    # Device work whose shapes the host knows: queued, never waited on.
    mask = t > 1
    out = t + 1
    out[mask] = 0  # a 0-d value: masked_fill
    return [
        out,
        t.sum(),
        t.to(torch.float64),
        t[0],
        t[1:3],
        torch.where(mask, t, 0),
        t.repeat_interleave(2),
        torch.nonzero_static(t, size=4),
    ]


def _marked(fn) -> Counter:
    """(kind, site) -> 1 for every ``# sync: KIND`` line of ``fn``."""
    lines, first = inspect.getsourcelines(fn)
    want: Counter = Counter()
    for offset, line in enumerate(lines):
        if "# sync: " in line:
            want[(line.split("# sync: ")[1].strip(), f"{__name__.rsplit('.', 1)[-1]}.py:{first + offset}")] += 1
    return want


def _seen(counter: HostSyncCounter) -> Counter:
    return Counter({(e.kind, e.site): n for e, n in counter.counted().items()})


def test_each_round_trip_is_counted_once_at_its_line():
    counter = HostSyncCounter(roots=(__file__,))
    t = torch.tensor([0, 3, 2, 0, 5])
    with counter:
        counter.begin_step()
        _one_of_each(t)
    want = _marked(_one_of_each)
    assert sorted(k for k, _ in want) == sorted(["item", "tolist", "bool", "cpu", "nonzero"])
    assert _seen(counter) == want
    assert counter.total(step=0, where=STEP) == 5
    assert counter.by("kind") == Counter({k: 1 for k, _ in want})


def test_data_dependent_shapes_and_uploads_are_counted_by_kind():
    counter = HostSyncCounter(roots=(__file__,))
    t = torch.tensor([0, 3, 2, 0, 5])
    with counter:
        _data_dependent(t)
    want = _marked(_data_dependent)
    assert _seen(counter) == want
    uploads = sum(n for (kind, _), n in want.items() if kind == UPLOAD)
    assert uploads == 1 and counter.total() == sum(want.values()) - uploads
    assert counter.total(kinds=[UPLOAD]) == uploads


def test_code_without_round_trips_counts_zero():
    counter = HostSyncCounter(roots=(__file__,))
    t = torch.tensor([0, 3, 2, 0, 5])
    with counter:
        _none(t)
    assert counter.events == Counter()


def test_where_labels_and_steps_split_the_counts():
    counter = HostSyncCounter(roots=(__file__,))
    t = torch.tensor([1, 2])
    with counter:
        counter.begin_step()
        t.tolist()
        for layer in range(3):
            with counter.where(layer):
                t[0].item()
                if layer == 2:
                    bool(t[0])
        counter.begin_step()
        t.cpu()
    assert counter.by("where") == Counter({STEP: 2, "0": 1, "1": 1, "2": 2})
    assert counter.by("step") == Counter({0: 5, 1: 1})
    assert counter.total(step=0, where=2) == 2 and counter.total(step=0, where=2, kinds=["bool"]) == 1


def test_calls_outside_the_code_under_test_are_kept_apart():
    counter = HostSyncCounter(roots=("/nonexistent/elsewhere.py",))
    with counter:
        torch.tensor([1, 2]).tolist()
    assert counter.total(kinds=SYNC_KINDS) == 0 and not counter.counted()
    assert counter.kept_apart() == Counter({(OUTSIDE, "tolist"): 1, (OUTSIDE, UPLOAD): 1})


def test_the_device_view_counts_only_what_a_device_tensor_hands_to_the_host():
    counter = HostSyncCounter(roots=(__file__,))
    device = torch.device("cpu")  # the server's device, as a device object
    with counter:
        on_device = torch.arange(6, device=device)  # a factory naming the device
        derived = on_device * 2  # computed from a device tensor: on the device
        host = torch.arange(6)  # made on the host
        int(host[0])  # a host value: no wait on a GPU
        host.tolist()
        int(derived[0])  # sync: item
        back = derived.cpu()  # sync: cpu
        back.tolist()  # a host copy after the read: no wait
        buffer = torch.empty(6, dtype=torch.int64)
        buffer.copy_(on_device)  # sync: cpu
        on_device.copy_(host)  # an upload into a device tensor: no wait
    assert counter.by("kind", device_only=True) == Counter({"item": 1, "cpu": 2})
    # The every-tensor view (the upper bound) counts the host's calls too.
    assert counter.total() == counter.total(device_only=True) + 3
    assert counter.on_device(derived) and not counter.on_device(back) and back is not derived


def test_the_device_view_counts_an_upload_that_has_no_tensor_input():
    """The check behind "the captured step uploads nothing" can fail: ``torch.tensor(data,
    device=dev)`` has no tensor input to be on the device, so an upload is the device's by
    where its tensor lands (mutant: file uploads by their inputs only, and this fails)."""
    counter = HostSyncCounter(roots=(__file__,))
    device = torch.device("cpu")  # the server's device, as a device object
    with counter:
        on_device = torch.zeros(3, device=device)
        torch.tensor([0, 1, 2], device=device)  # an upload onto the device
        torch.as_tensor([0.5], device="cuda" if torch.cuda.is_available() else device)  # and another
        on_device.copy_(torch.ones(3))  # a host tensor copied into a device one
        torch.tensor([3, 4])  # host data staying on the host: the device never sees it
    assert counter.total(kinds=(UPLOAD,), device_only=True) == 3
    assert counter.total(kinds=(UPLOAD,)) == 4 and counter.total(device_only=True) == 0


def test_paused_counts_nothing_but_still_sees_where_tensors_come_from():
    counter = HostSyncCounter(roots=(__file__,))
    with counter:
        with counter.paused():
            made = torch.zeros(3, device=torch.device("cpu"))
            made.tolist()
        total = made.sum()
    assert counter.total() == 0 and counter.on_device(total)


def test_new_device_tensors_are_counted_as_allocations_views_and_in_place_writes_not():
    counter = HostSyncCounter(roots=(__file__,))
    with counter:
        on_device = torch.zeros(6, device=torch.device("cpu"))  # 1
        grown = on_device + 1  # 2
        grown.add_(1)  # in place: nothing new
        grown[1:3]  # a view: nothing new
        torch.zeros(6)  # on the host: not the device's
    assert counter.total(kinds=[ALLOC], device_only=True) == 2
    assert counter.total() == 0  # no round trip among them


def test_launches_count_computing_calls_not_an_input_handed_back():
    counter = HostSyncCounter(roots=(__file__,))
    device = torch.device("cpu")
    with counter:
        with counter.paused():
            made = torch.zeros(4, 6, device=device)
        made.to(device, torch.float32)  # already there, already float32: handed back
        made.contiguous()  # already contiguous: handed back
        made.t().contiguous()  # 1: a transposed copy
        made.to(torch.float64)  # 2: a cast
        made + 1  # 3
        made.add_(1)  # 4: in place
        made[1:3]  # a view: nothing computed
    assert counter.total(kinds=[LAUNCH], device_only=True) == 4
