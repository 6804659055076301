import pytest

from sgl_importance.request_check.openai import unknown_model

KNOWN = {"SmolLM2-135M-Instruct", "/models/smol", "my-adapter"}


@pytest.mark.parametrize(
    "model", ["SmolLM2-135M-Instruct", "/models/smol", "default", "", None, "SmolLM2-135M-Instruct:my-adapter"]
)
def test_served_names_path_adapters_and_omitted_model_are_accepted(model):
    assert not unknown_model(model, KNOWN)


@pytest.mark.parametrize("model", ["gpt-4", "SmolLM2-135M-Instruct:other-adapter", "smollm2"])
def test_other_names_are_unknown(model):
    assert unknown_model(model, KNOWN)
