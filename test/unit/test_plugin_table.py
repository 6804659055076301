"""plugin.py's table: every row names a function that exists, state the runtime has,
and the loop calls each function the way its docstring says."""

from __future__ import annotations

import inspect

import pytest

from sgl_importance import plugin, runtime
from sgl_importance.plugin import HOOKS, Hook

KINDS = {"before", "after", "around", "check", "backend", "policy", "forward", "inline"}
PROCESSES = {"any", "http", "scheduler", "dump", "trace", "checks", "torch_cpu", "torch_cuda", "native"}


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: f"{h.call}@{h.target.rsplit('.', 1)[-1]}")
def test_every_row_names_a_function_a_kind_a_process_and_runtime_state_that_exist(hook):
    assert hook.kind in KINDS and hook.process in PROCESSES
    fn = plugin._resolve(hook.call)
    assert callable(fn)
    rt = runtime.Runtime()
    for name in hook.state:
        assert name == "runtime" or hasattr(rt, name), name
    # The function takes the state first, then at least the arguments it reads.
    params = list(inspect.signature(fn).parameters)
    assert len(params) >= len(hook.state)


def test_an_after_hook_gets_the_state_the_arguments_it_declares_and_the_result_by_keyword(monkeypatch):
    seen = []

    def fold(page_importance, scheduler, batch, *, result):
        seen.append((page_importance, scheduler, batch, result))
        return 7  # a count for tests; SGLang must not take it as the new result

    monkeypatch.setattr(plugin, "_resolve", lambda call: fold)
    runtime.reset()
    try:
        bound = plugin._bind(Hook("x.y", "m:fold", "after", "scheduler", ("page_importance",)))
        assert bound("result", "scheduler", "batch", "extra positional", extra_keyword=1) is None
        assert seen == [(runtime.current().page_importance, "scheduler", "batch", "result")]
    finally:
        runtime.reset()


def test_a_before_hook_returns_nothing_so_sglang_keeps_its_arguments(monkeypatch):
    monkeypatch.setattr(plugin, "_resolve", lambda call: lambda tm, obj: ("new", "args"))
    bound = plugin._bind(Hook("x.y", "m:f", "before", "http"))
    assert bound("tokenizer_manager", "obj", "input_ids") is None


def test_a_launcher_check_gets_the_parsed_args_only(monkeypatch):
    seen = []
    monkeypatch.setattr(plugin, "_resolve", lambda call: seen.append)
    plugin._bind(Hook("x.y", "m:f", "check", "any"))("ServerArgs", "namespace")
    assert seen == ["namespace"]


def test_an_around_hook_passes_through_what_the_function_returns(monkeypatch):
    monkeypatch.setattr(plugin, "_resolve", lambda call: lambda original, *args, **kw: original(*args, **kw) + 1)
    bound = plugin._bind(Hook("x.y", "m:f", "around", "any"))
    assert bound(lambda a, b=0: a + b, 1, b=2) == 4


def test_a_forked_child_adds_rows_only_on_targets_its_launcher_left_alone():
    # A child the torch_cpu launcher forks registers its scheduler rows at the fork and applies
    # them; SGLang's apply_hooks() skips a target patched already, so a scheduler row sharing a
    # target with a row the launcher applied would be lost without a word.
    launcher = {h.target for h in HOOKS if h.process not in plugin.SCHEDULER and h.process != "torch_cuda"}
    shared = sorted({h.target for h in HOOKS if h.process in plugin.SCHEDULER} & launcher)
    assert shared == []
    assert set(plugin.SCHEDULER) < PROCESSES and "http" not in plugin.SCHEDULER
