"""What the runtime decides from the server's flags: whether anything reads page importance
(the CPU decode skips it otherwise), and that the hot set has a backend to run on."""

from types import SimpleNamespace

import pytest

from sgl_importance.config import ImportanceConfig
from sgl_importance.env import DUMP_DIR_ENV
from sgl_importance.runtime import Runtime


def server_args(**overrides):
    fields = dict(
        radix_eviction_policy="lru",
        enable_metrics=False,
        attention_backend="importance_torch",
        decode_attention_backend=None,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.fixture(autouse=True)
def no_dump(monkeypatch):
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)


def test_plain_serving_records_no_importance():
    assert Runtime(ImportanceConfig(), server_args()).records_importance is False


@pytest.mark.parametrize(
    "config,args",
    [
        (ImportanceConfig(), dict(radix_eviction_policy="importance")),
        (ImportanceConfig(hot_set_policy="importance"), {}),
        (ImportanceConfig(storage_precision="graded"), {}),
    ],
)
def test_a_reader_of_importance_turns_recording_on(config, args):
    assert Runtime(config, server_args(**args)).records_importance is True


def test_the_tables_dump_and_a_runtime_outside_a_server_record(monkeypatch, tmp_path):
    assert Runtime().records_importance is True  # tests and tools read the table directly
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    assert Runtime(ImportanceConfig(), server_args()).records_importance is True


def test_the_hot_set_on_a_backend_the_platform_chose_otherwise_stops_start_up():
    # A model importance_torch does not read exactly gets torch_native by default
    # (platform/attention_choice.py): the hot set cannot run there, and says so.
    with pytest.raises(ValueError, match="--hot-set-policy importance needs .*got 'torch_native'"):
        Runtime(ImportanceConfig(hot_set_policy="importance"), server_args(attention_backend="torch_native"))
