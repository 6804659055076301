"""SGLang control requests its scheduler died on, answered instead (scheduler/control.py)."""

from __future__ import annotations

import types

import pytest
from sglang.srt.session.session_controller import Session, SessionReqNode

from sgl_importance.scheduler.control import create_req, update_weights_from_disk


def _req(rid: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(rid=rid, finished_reason=None, to_finish=None)


def _session_with_two_trees() -> Session:
    session = Session(capacity_of_str_len=1000, session_id="s")
    a = SessionReqNode(_req("a"))
    b = SessionReqNode(_req("b"), parent=a)
    SessionReqNode(_req("c"), parent=b)
    d = SessionReqNode(_req("d"))
    for node in (a, b, *b.children, d):
        session.req_nodes[node.req.rid] = node
    return session


def _asking(rid, replace: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(session_params=types.SimpleNamespace(rid=rid, replace=replace))


def test_a_replace_without_a_rid_clears_every_tree_before_sglang_iterates_its_nodes():
    session = _session_with_two_trees()
    nodes = list(session.req_nodes.values())
    seen = []
    assert create_req(lambda s, req: seen.append(dict(s.req_nodes)) or "made", session, _asking(None, True)) == "made"
    assert seen == [{}]
    assert all(
        type(n.req.to_finish).__name__ == "FINISH_ABORT" for n in nodes
    )  # unfinished ones aborted, as SGLang's clear


@pytest.mark.parametrize("asking", [_asking("a", True), _asking(None, False), _asking("b", False)])
def test_other_session_requests_reach_sglang_with_their_nodes_untouched(asking):
    session = _session_with_two_trees()
    seen = []
    create_req(lambda s, req: seen.append(sorted(s.req_nodes)), session, asking)
    assert seen == [["a", "b", "c", "d"]]


def _updater(path: str = "/serving", fmt: str = "safetensors") -> types.SimpleNamespace:
    runner = types.SimpleNamespace(load_config=types.SimpleNamespace(load_format=fmt))
    return types.SimpleNamespace(model_config=types.SimpleNamespace(model_path=path), get_model_runner=lambda: runner)


def test_an_unknown_load_format_loads_nothing_and_is_answered_as_a_failure():
    calls = []
    ok, message = update_weights_from_disk(lambda *a: calls.append(a), _updater(), "/new", "nonsense")
    assert not ok and "nonsense" in message and "safetensors" in message
    assert calls == []


def test_a_failed_load_reloads_the_serving_weights_and_is_answered_as_a_failure():
    calls = []

    def sglangs(updater, path, fmt, *rest):
        calls.append((path, fmt, rest))
        updater.model_config.model_path = path  # as SGLang records it before loading
        if path == "/new":
            raise AssertionError("embed_tokens is [3, 3]")
        return True, "loaded"

    updater = _updater()
    ok, message = update_weights_from_disk(sglangs, updater, "/new", "auto", None, False)
    assert not ok and "embed_tokens" in message and "/serving" in message
    assert calls == [("/new", "auto", (None, False)), ("/serving", "safetensors", (None, False))]
    assert updater.model_config.model_path == "/serving"
    assert update_weights_from_disk(sglangs, updater, "/serving", "auto") == (True, "loaded")


def test_a_server_that_cannot_reload_its_own_weights_still_raises():
    def sglangs(updater, path, fmt):
        if path == "/new":
            raise ValueError("bad")
        return False, "gone too"

    with pytest.raises(RuntimeError, match="gone too"):
        update_weights_from_disk(sglangs, _updater(), "/new", "auto")


def test_tensors_that_do_not_deserialize_are_a_failure_and_the_worker_is_left_as_it_was():
    from sgl_importance.scheduler.control import update_weights_from_tensor

    class Worker:
        def deserialize_own_rank(self, serialized):
            return serialized[0]  # IndexError on an empty list, as SGLang's

    worker = Worker()
    manager = types.SimpleNamespace(tp_worker=worker)

    def sglangs(manager, recv_req):
        return ("loaded", manager.tp_worker.deserialize_own_rank(recv_req.serialized_named_tensors))

    answer = update_weights_from_tensor(sglangs, manager, types.SimpleNamespace(serialized_named_tensors=[]))
    assert not answer.success and "IndexError" in answer.message
    assert "deserialize_own_rank" not in vars(worker)
    assert update_weights_from_tensor(sglangs, manager, types.SimpleNamespace(serialized_named_tensors=["t"])) == (
        "loaded",
        "t",
    )

    def loads_a_number(manager, recv_req):
        dict(manager.tp_worker.deserialize_own_rank(recv_req.serialized_named_tensors))  # TypeError: an int

    answer = update_weights_from_tensor(loads_a_number, manager, types.SimpleNamespace(serialized_named_tensors=[5]))
    assert not answer.success and "TypeError" in answer.message and "may be loaded" in answer.message


def test_a_send_to_a_group_never_made_is_a_failure():
    from sgl_importance.scheduler.control import send_weights_to_remote_instance

    def sglangs(exporter, address, ports, group):
        return exporter[f"{group}_{ports}_0"]

    ok, message = send_weights_to_remote_instance(sglangs, {}, "127.0.0.1", "1", "never-made")
    assert not ok and "KeyError" in message
    assert send_weights_to_remote_instance(sglangs, {"g_1_0": (True, "sent")}, "127.0.0.1", "1", "g") == (True, "sent")
