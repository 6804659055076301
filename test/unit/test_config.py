import argparse
import re

import pytest

from sgl_importance.config import ImportanceConfig, add_cli_args, from_namespace
from sgl_importance.hot_set.params import hot_set_params, request_hot_set_params
from sgl_importance.runtime import config_of


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_defaults_apply_when_no_flag_is_given():
    assert from_namespace(parse()) == ImportanceConfig()


def test_flags_reach_the_config():
    config = from_namespace(parse("--importance-reduce", "max", "--importance-sample-interval", "4"))
    assert (config.reduce, config.sample_interval) == ("max", 4)


def test_invalid_choice_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        parse("--importance-reduce", "median")


@pytest.mark.parametrize("value", [0, -3, 10**7])
def test_out_of_range_interval_error_names_flag_value_and_range(value):
    with pytest.raises(ValueError) as err:
        ImportanceConfig(sample_interval=value)
    assert f"--importance-sample-interval {value}" in str(err.value)
    assert "[1, 1000000]" in str(err.value)


def test_config_of_falls_back_to_defaults_for_args_built_without_the_cli():
    class Bare:
        pass

    assert config_of(Bare()) == ImportanceConfig()


def test_hot_set_is_off_by_default():
    config = from_namespace(parse())
    assert config.hot_set_policy == "off" and hot_set_params(config) is None


def test_hot_set_flags_reach_the_policy_parameters():
    args = parse(
        "--hot-set-policy", "quest", "--hot-set-budget", "0.3", "--hot-set-window", "2",
        "--hot-set-sinks", "0", "--hot-set-threshold", "100", "--hot-set-guard-threshold", "0.5",
    )  # fmt: skip
    params = hot_set_params(from_namespace(args))
    assert (params.policy, params.budget, params.window, params.sinks, params.guard_threshold) == (
        "quest",
        0.3,
        2,
        0,
        0.5,
    )


def test_hot_set_budget_is_pages_without_a_dot_and_a_fraction_with_one():
    assert from_namespace(parse("--hot-set-budget", "40")).hot_set_budget == 40
    assert from_namespace(parse("--hot-set-budget", "1.0")).hot_set_budget == 1.0
    assert hot_set_params(from_namespace(parse("--hot-set-budget", "40"))) is None  # still off


@pytest.mark.parametrize(
    "field, value, flag, allowed",
    [
        ("hot_set_budget", 0, "--hot-set-budget", "an integer number of pages >= 1"),
        ("hot_set_budget", 1.5, "--hot-set-budget", "a fraction in (0, 1]"),
        ("hot_set_budget", 0.0, "--hot-set-budget", "a fraction in (0, 1]"),
        ("hot_set_window", 0, "--hot-set-window", "[1, 1048576]"),
        ("hot_set_sinks", 65, "--hot-set-sinks", "[0, 64]"),
        ("hot_set_threshold", -1, "--hot-set-threshold", "[0, 1073741824]"),
        ("hot_set_guard_threshold", 0.0, "--hot-set-guard-threshold", "(0, 1]"),
        ("hot_set_guard_threshold", 1.5, "--hot-set-guard-threshold", "(0, 1]"),
        ("hot_set_reduce", "sum", "--hot-set-reduce", "mean, max"),
        ("hot_set_read_cap", 0.0, "--hot-set-read-cap", "(0, 1]"),
        ("hot_set_read_cap", 1.5, "--hot-set-read-cap", "(0, 1]"),
        ("hot_set_top_p", 0.0, "--hot-set-top-p", "(0, 1]"),
        ("hot_set_policy", "belady", "--hot-set-policy", "importance"),
        ("hot_set_graph_rows", -1, "--hot-set-graph-rows", "[0, 4096]"),
    ],
)
def test_invalid_hot_set_value_error_names_flag_value_and_range(field, value, flag, allowed):
    with pytest.raises(ValueError) as err:
        ImportanceConfig(**{field: value})
    assert f"{flag} {value!r}" in str(err.value) and allowed in str(err.value)


def test_the_captured_hot_set_step_is_off_unless_asked_for():
    assert ImportanceConfig().hot_set_graph_rows == 0
    assert from_namespace(parse("--hot-set-graph-rows", "8")).hot_set_graph_rows == 8


def test_unparseable_hot_set_budget_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        parse("--hot-set-budget", "ten")


def test_hot_set_needs_the_importance_torch_decode_backend():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    parser.add_argument("--attention-backend")
    parser.add_argument("--decode-attention-backend")
    with pytest.raises(ValueError, match="--hot-set-policy lru needs .*importance_torch.*'torch_native'"):
        from_namespace(parser.parse_args(["--hot-set-policy", "lru", "--attention-backend", "torch_native"]))
    ok = parser.parse_args(
        [
            "--hot-set-policy",
            "lru",
            "--attention-backend",
            "torch_native",
            "--decode-attention-backend",
            "importance_torch",
        ]
    )
    assert from_namespace(ok).hot_set_policy == "lru"
    # None named: the platform's default decides, checked once chosen (runtime.py).
    assert from_namespace(parser.parse_args(["--hot-set-policy", "lru"])).hot_set_policy == "lru"


def test_a_request_may_override_the_servers_hot_set_settings():
    config = ImportanceConfig(hot_set_policy="importance", hot_set_budget=0.2, hot_set_window=4)
    params = request_hot_set_params(config, {"policy": "quest", "budget": 40, "guard_threshold": 1.0})
    assert (params.policy, params.budget, params.window, params.guard_threshold) == ("quest", 40, 4, 1.0)
    assert params.reduce == "max"  # the server's --hot-set-reduce
    assert request_hot_set_params(config, {"reduce": "mean"}).reduce == "mean"
    assert hot_set_params(ImportanceConfig(hot_set_policy="lru", hot_set_reduce="mean")).reduce == "mean"


@pytest.mark.parametrize(
    "value,message",
    [
        ({"budget": 1.5}, "custom_params.hot_set.budget 1.5 is invalid"),
        ({"budget": True}, "custom_params.hot_set.budget True is invalid"),
        ({"policy": "off"}, "custom_params.hot_set.policy 'off' is invalid; allowed: dense, window"),
        ({"window": 0}, "custom_params.hot_set.window 0 is invalid"),
        ({"guard_threshold": 2}, "custom_params.hot_set.guard_threshold 2 is invalid"),
        ({"threshold": 10}, "custom_params.hot_set has unknown keys ['threshold']"),
        ({"reduce": "sum"}, "custom_params.hot_set.reduce 'sum' is invalid; allowed: mean, max"),
        ({"read_cap": 0}, "custom_params.hot_set.read_cap 0 is invalid"),
        ({"top_p": 1.01}, "custom_params.hot_set.top_p 1.01 is invalid"),
        ({"budget": 4, "sinks": 1}, "custom_params.hot_set.budget 4 is invalid; allowed: at least"),
        ("quest", "custom_params.hot_set 'quest' is invalid"),
    ],
)
def test_a_bad_request_hot_set_value_names_the_key_the_value_and_the_range(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        request_hot_set_params(ImportanceConfig(hot_set_policy="importance"), value)


def test_request_hot_set_settings_need_a_server_with_the_hot_set_on():
    with pytest.raises(ValueError, match="needs a server started with --hot-set-policy"):
        request_hot_set_params(ImportanceConfig(), {"policy": "dense"})


def test_a_budget_in_pages_must_hold_the_sinks_and_the_window():
    with pytest.raises(ValueError, match=re.escape("--hot-set-budget 4 is invalid; allowed: at least --hot-set-sinks")):
        ImportanceConfig(hot_set_policy="importance", hot_set_budget=4, hot_set_sinks=1, hot_set_window=4)
    assert ImportanceConfig(hot_set_policy="importance", hot_set_budget=5, hot_set_sinks=1).hot_set_budget == 5
    assert ImportanceConfig(hot_set_budget=4).hot_set_budget == 4  # no hot set: nothing to hold


def test_a_request_cannot_ask_for_a_guard_the_server_reserved_no_pool_for():
    config = ImportanceConfig(hot_set_policy="importance", hot_set_guard_threshold=1.0)
    with pytest.raises(ValueError, match="runs no guard"):
        request_hot_set_params(config, {"guard_threshold": 0.1})
    params = request_hot_set_params(ImportanceConfig(hot_set_policy="importance"), {"read_cap": 0.5, "top_p": 0.9})
    assert (params.read_cap, params.top_p) == (0.5, 0.9)
