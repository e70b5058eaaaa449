"""The registry of model families holds what each needs, and only families transformers has."""

import pytest
from transformers import AutoConfig

from kvasir.errors import ModelSourceError
from kvasir.model.families import FAMILIES, GGUF_ARCHITECTURES, check_gguf, family_of
from kvasir.model.moe_layout import MoeLayout


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_family_names_config_attributes_its_transformers_config_has(model_type):
    config = AutoConfig.for_model(model_type)
    spec = FAMILIES[model_type].moe
    layout = MoeLayout.of(config)
    assert (layout is None) == (spec is None)
    if spec is not None and layout is not None:
        for name in (spec.experts, spec.inter, spec.sparse_step, spec.dense_layers):
            assert name is None or hasattr(config, name), name
        assert layout.num_experts > 0 and layout.inter > 0 and layout.top_k > 0


def test_unknown_families_and_gguf_architectures_are_refused_naming_the_supported():
    with pytest.raises(ModelSourceError, match=r"model x: architecture 'bert' is not supported \(supported: llama, "):
        family_of("bert", "model x")
    with pytest.raises(ModelSourceError, match="GGUF architecture 'mixtral' is not supported"):
        check_gguf("mixtral", "file.gguf")
    assert GGUF_ARCHITECTURES == ("llama", "mistral", "qwen2", "qwen3")
