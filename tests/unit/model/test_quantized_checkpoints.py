"""Tiny quantized checkpoints (compressed-tensors, GPTQ, AWQ) served through the real loader
and the in-process chain, as stored and dequantised, against Hugging Face ``generate`` on
the float model they stand for; quantizations not served are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kvasir.cli.main import kvasir
from kvasir.errors import ModelSourceError
from kvasir.model.quant.linear import QuantLinear, int4_kernels_available
from kvasir.model.source import resolve_source
from kvasir.stage.chain import Chain
from kvasir.wire.batch import SamplingParams
from tests.support.models import hf_greedy, make_plan, random_prompts, reference_model
from tests.support.quantized import METHODS, save_quantized

pytestmark = pytest.mark.skipif(not int4_kernels_available(), reason="this torch has no int4 CPU kernels")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {method: save_quantized(root, method, group=64 if method == "awq" else 32) for method in METHODS}


def greedy(plan, source, prompts, budget):
    chain = Chain(plan, source)
    ids = [chain.submit(p, SamplingParams(temperature=0, max_tokens=budget)) for p in prompts]
    outputs = chain.run({})
    return [outputs[i].token_ids for i in ids], chain


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("weights", ["as_stored", "dequantize"])
def test_a_quantized_checkpoint_matches_generate_on_its_float_model(checkpoints, method, weights):
    folder, reference = checkpoints[method]
    plan = make_plan(folder, [(0, 2), (2, 4)], max_rows=6, max_tokens=32, weights=weights)
    source = resolve_source(str(folder))
    assert source.scheme is not None and source.packed
    prompts = random_prompts(source.vocab_size, [1, 9, 40, 3, 70], seed=3)
    got, chain = greedy(plan, source, prompts, 12)
    model = reference_model(reference)
    assert got == [hf_greedy(model, p, 12) for p in prompts]
    head = chain.stages[0].model.slice
    assert isinstance(head.layers[0].self_attn.qkv, QuantLinear) == (weights == "as_stored")
    assert not isinstance(chain.stages[1].model.slice.lm_head, QuantLinear)  # kept in float by the checkpoint


def test_plan_check_names_the_scheme_and_holds_packed_bytes(checkpoints, tmp_path):
    folder, _ = checkpoints["gptq"]
    path = tmp_path / "plan.toml"  # weights left to "auto": as stored in bfloat16
    model = f'[model]\nsource = "{folder}"\ndtype = "bfloat16"\nmax_seq_len = 256\n'
    path.write_text(model + "[[stages]]\nlayers = [0, 2]\n[[stages]]\nlayers = [2, 4]\n")
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert (
        "gptq 4-bit (groups of 32) matrices as stored (model.weights = 'auto'); the checkpoint packs 28"
        in result.output
    )
    body = json.loads(CliRunner().invoke(kvasir, ["plan", "check", "--json", str(path)]).output)
    head = body["stages"][0]
    assert 0 < head["stored_bytes"] < head["parameter_bytes"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"quant_method": "gptq", "bits": 8}, "stores 8-bit weights"),
        ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "activation order"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "fp8"}, "'fp8' quantization_config is not a served method"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format 'float-quantized'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": "128"}, "group_size '128', not a positive integer"),
        ({"quant_method": "awq", "bits": 4, "group_size": 0}, "group_size 0, not a positive integer"),
    ],
)
def test_quantizations_not_served_are_refused_by_name(checkpoints, tmp_path, change, named):
    folder, _ = checkpoints["gptq"]
    copy = tmp_path / "model"
    copy.mkdir()
    values = json.loads((folder / "config.json").read_text())
    values["quantization_config"] = change
    (copy / "config.json").write_text(json.dumps(values))
    with pytest.raises(ModelSourceError, match=named):
        resolve_source(str(copy))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"input_activations": {"num_bits": 8, "type": "int", "strategy": "token"}}, "quantizes activations too"),
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}, "group strategy without a group_size"),
    ],
)
def test_compressed_tensors_groups_not_served_are_refused(checkpoints, tmp_path, change, named):
    folder, _ = checkpoints["compressed-tensors"]
    values = json.loads((folder / "config.json").read_text())
    values["quantization_config"]["config_groups"]["group_0"] |= change
    copy = tmp_path / "model"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps(values))
    with pytest.raises(ModelSourceError, match=named):
        resolve_source(str(copy))


@pytest.mark.parametrize("in_order", [True, False])
def test_compressed_tensors_activation_order_is_served_only_in_input_order(checkpoints, tmp_path, in_order):
    folder, reference = checkpoints["compressed-tensors"]
    copy = tmp_path / "model"
    copy.mkdir()
    values = json.loads((folder / "config.json").read_text())
    values["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (copy / "config.json").write_text(json.dumps(values))
    tensors = load_file(str(folder / "model.safetensors"))
    g_idx = torch.arange(64) // 32
    tensors["model.layers.0.self_attn.q_proj.weight_g_idx"] = g_idx if in_order else g_idx.flip(0)
    save_file(tensors, str(copy / "model.safetensors"))
    plan = make_plan(copy, [(0, 2), (2, 4)], max_rows=6, max_tokens=32, weights="as_stored")
    source = resolve_source(str(copy))
    if not in_order:
        with pytest.raises(ModelSourceError, match="activation order"):
            Chain(plan, source)
        return
    prompts = random_prompts(source.vocab_size, [5, 30], seed=4)
    got, _ = greedy(plan, source, prompts, 8)
    model = reference_model(reference)
    assert got == [hf_greedy(model, p, 8) for p in prompts]
