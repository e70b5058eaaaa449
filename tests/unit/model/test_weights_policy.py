"""model.weights: what "auto", "as_stored" and "dequantize" come to, what is refused and
how `kvasir plan check` states it; a bfloat16 ring serving a GGUF as stored."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvasir.cli.main import kvasir
from kvasir.errors import ModelSourceError
from kvasir.model.convert import prepare
from kvasir.model.quant.linear import QuantLinear, int4_kernels_available
from kvasir.model.quant.stored import check_weights, served_weights
from kvasir.model.source import resolve_source
from kvasir.stage.chain import Chain
from kvasir.wire.batch import SamplingParams
from tests.support.gguf_models import save_tiny_gguf
from tests.support.models import make_plan, random_prompts, reference_model, save_tiny_model


@pytest.mark.parametrize(
    ("weights", "dtype", "devices", "gguf", "served"),
    [
        ("auto", "bfloat16", ["cpu", "cpu"], True, "as_stored"),
        ("auto", "float32", ["cpu", "cpu"], True, "dequantize"),  # the kernel is slow with float32
        ("auto", "bfloat16", ["cpu", "cuda:0"], True, "dequantize"),  # a GPU worker: no GPU kernel yet
        ("auto", "bfloat16", ["cpu"], False, "dequantize"),  # a model folder has nothing stored
        ("as_stored", "bfloat16", ["cpu"], True, "as_stored"),
        ("as_stored", "float32", ["cpu"], False, "dequantize"),
        ("dequantize", "bfloat16", ["cpu"], True, "dequantize"),
    ],
)
def test_what_each_setting_comes_to(weights, dtype, devices, gguf, served):
    assert check_weights(weights, dtype, devices, gguf) == served


def test_as_stored_where_it_would_be_slow_or_cannot_run_is_refused_by_name():
    with pytest.raises(ModelSourceError, match='needs model.dtype = "bfloat16".*float32 activations'):
        check_weights("as_stored", "float32", ["cpu"], True)
    with pytest.raises(ModelSourceError, match='CPU stages only.*not on cuda:1.*"dequantize"'):
        check_weights("as_stored", "bfloat16", ["cpu", "cuda:1"], True)
    # the mechanism itself serves any dtype on the CPU (the chain tests float32 through it)
    assert served_weights("as_stored", "float32", ["cpu"], True) == "as_stored"


def test_a_torch_without_the_int4_kernels_dequantises_on_auto_and_refuses_as_stored():
    assert check_weights("auto", "bfloat16", ["cpu"], True, kernels=False) == "dequantize"
    with pytest.raises(ModelSourceError, match=r"needs PyTorch's int4 CPU kernels.*lacks"):
        check_weights("as_stored", "bfloat16", ["cpu"], True, kernels=False)


def test_a_checkpoint_whose_quantization_is_not_served_is_refused_with_its_format(tmp_path):
    folder = save_tiny_model(tmp_path / "fp8", "llama")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match="'fbgemm_fp8' quantization_config is not a served method"):
        resolve_source(str(folder))


def test_a_quantized_mixture_of_experts_checkpoint_is_refused(tmp_path):
    folder = save_tiny_model(tmp_path / "moe", "mixtral")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match="quantized mixture-of-experts checkpoint"):
        resolve_source(str(folder))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-policy")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVASIR_CACHE_DIR", str(root / "cache"))
        path = save_tiny_gguf(root / "tiny.gguf", "llama", "Q4_1", "Q8_0")
        prepare(resolve_source(str(path)))
        yield path


def plan_file(tmp_path, gguf, dtype: str, weights: str | None = None):
    line = f'weights = "{weights}"\n' if weights else ""
    path = tmp_path / "plan.toml"
    path.write_text(
        f'[model]\nsource = "{gguf}"\ndtype = "{dtype}"\n{line}max_seq_len = 256\n'
        "[kv]\nblock_size = 4\nnum_blocks = 64\n[[stages]]\nlayers = [0, 2]\n[[stages]]\nlayers = [2, 4]\n"
    )
    return path


def test_plan_check_says_how_the_matrices_are_served(gguf, tmp_path):
    result = CliRunner().invoke(kvasir, ["plan", "check", str(plan_file(tmp_path, gguf, "bfloat16"))])
    assert result.exit_code == 0, result.output
    assert "weights  Q4_0, Q4_1 and Q8_0 matrices as stored (model.weights = 'auto'); the GGUF holds" in result.output
    assert "28 Q4_1" in result.output and "1 Q8_0" in result.output
    result = CliRunner().invoke(kvasir, ["plan", "check", "--json", str(plan_file(tmp_path, gguf, "float32"))])
    assert json.loads(result.output)["model"]["served"] == "dequantize"
    result = CliRunner().invoke(kvasir, ["plan", "check", str(plan_file(tmp_path, gguf, "float32", "as_stored"))])
    assert result.exit_code == 2 and 'needs model.dtype = "bfloat16"' in result.output


def test_dtype_auto_serves_a_gguf_in_bfloat16_where_the_cpu_has_it(gguf, tmp_path, monkeypatch):
    monkeypatch.setattr("kvasir.daemon.resolve.cpu_flags", lambda: frozenset({"avx512_bf16"}))
    result = CliRunner().invoke(kvasir, ["plan", "check", str(plan_file(tmp_path, gguf, "auto"))])
    assert result.exit_code == 0, result.output
    assert (
        'bfloat16: activations, the boundary between stages and the KV cache (model.dtype = "auto": a GGUF'
        in result.output
    )
    assert "matrices as stored" in result.output
    monkeypatch.setattr("kvasir.daemon.resolve.cpu_flags", lambda: frozenset({"avx2"}))
    result = CliRunner().invoke(kvasir, ["plan", "check", str(plan_file(tmp_path, gguf, "auto"))])
    assert "float32: activations" in result.output and "not native on this CPU" in result.output
    assert "dequantised to float32" in result.output


@pytest.mark.skipif(not int4_kernels_available(), reason="this torch has no int4 CPU kernels")
def test_a_bfloat16_ring_serves_the_file_as_stored_near_the_float32_reference(gguf):
    source = resolve_source(str(gguf))
    plan = make_plan(gguf, [(0, 2), (2, 4)], dtype="bfloat16")  # weights = "auto"
    chain = Chain(plan, source)
    prompts = random_prompts(source.vocab_size, [3, 20, 50], seed=5)
    ids = [chain.submit(p, SamplingParams(temperature=0, max_tokens=10)) for p in prompts]
    outputs = chain.run({})
    assert isinstance(chain.stages[0].model.slice.layers[0].mlp.gate_up, QuantLinear)
    reference = reference_model(source.weights_dir)
    for rid, prompt in zip(ids, prompts):
        tokens = outputs[rid].token_ids
        assert len(tokens) == 10 or tokens[-1] in source.eos_token_ids
        with torch.no_grad():  # teacher forced: each token within 5 % of the step's logit scale of the best
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        best = logits.max(dim=-1).values
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool(((best - chosen) <= 0.05 * logits.abs().max(dim=-1).values).all())
