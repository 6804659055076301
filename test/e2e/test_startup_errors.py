"""Invalid configuration stops `python -m sglang.launch_server` with a clear message."""

from __future__ import annotations

import pytest

from support.server import launch_and_fail

pytestmark = pytest.mark.e2e


def test_unknown_value_of_a_plugin_choice_flag_names_the_flag(model_path):
    out = launch_and_fail(model_path, "--importance-reduce", "median")
    assert "--importance-reduce" in out and "median" in out


def test_out_of_range_plugin_value_names_the_flag_and_the_range(model_path):
    out = launch_and_fail(model_path, "--importance-sample-interval", "0")
    assert "--importance-sample-interval 0 is invalid" in out
    assert "[1, 1000000]" in out


def test_host_layout_that_torch_cpu_cannot_serve_is_refused(model_path):
    out = launch_and_fail(model_path, "--enable-hierarchical-cache", "--hicache-mem-layout", "page_head")
    assert "--hicache-mem-layout 'page_head' is not supported on the torch_cpu and torch_cuda platforms" in out
