import argparse

import pytest

from sgl_importance.config import ImportanceConfig, add_cli_args, config_of, from_namespace


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
