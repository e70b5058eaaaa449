from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kvasir.errors import ModelSourceError
from kvasir.model.loader import SliceSpec, build_skeleton, load_slice, slice_spec
from kvasir.model.packed import PackedLinear
from kvasir.model.source import resolve_source
from kvasir.stage.engine import StageEngine


def layer_params(names):
    return {n for n in names if ".layers." in n}


def test_two_stage_split_reads_disjoint_halves(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["llama"], [(0, 3), (3, 6)])
    head, tail = (StageEngine(plan, i, source) for i in range(2))
    all_tensors = load_file(str(tiny_models["llama"] / "model.safetensors"))
    decoder = sum(t.numel() for n, t in all_tensors.items() if ".layers." in n)
    for stage, own in ((head, range(0, 3)), (tail, range(3, 6))):
        read = stage.tensors_read
        assert {int(n.split(".")[2]) for n in layer_params(read)} == set(own)
        mine = sum(all_tensors[n].numel() for n in layer_params(read))
        assert mine == decoder // 2
        held = sum(p.numel() for n, p in stage.model.slice.named_parameters() if n.startswith("layers."))
        packed = [m for m in stage.model.slice.layers.modules() if isinstance(m, PackedLinear)]
        assert packed and stage.packed == len(packed) + (stage is tail)  # every projection, the tail's LM head
        held += sum(m.in_features * m.out_features for m in packed)  # weights packed for oneDNN
        assert held == decoder // 2
    assert layer_params(head.tensors_read).isdisjoint(layer_params(tail.tensors_read))
    # head: embeddings only; tail: final norm and the LM head, tied to the embeddings here
    assert "model.embed_tokens.weight" in head.tensors_read
    assert "model.norm.weight" not in head.tensors_read
    assert head.model.slice.norm is None and head.model.slice.lm_head is None
    assert tail.model.slice.embed_tokens is None
    assert set(tail.tensors_read) - layer_params(tail.tensors_read) == {
        "model.norm.weight",
        "model.embed_tokens.weight",
    }
    probe = torch.randn(3, 64)  # the LM head (packed) computes with the embeddings' weights
    expected = probe @ all_tensors["model.embed_tokens.weight"].T
    torch.testing.assert_close(tail.model.slice.lm_head(probe), expected, atol=1e-5, rtol=1e-5)


def test_untied_lm_head_is_read_from_its_own_tensor(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["qwen2"], [(0, 3), (3, 6)])
    tail = StageEngine(plan, 1, source)
    assert "lm_head.weight" in tail.tensors_read and "model.embed_tokens.weight" not in tail.tensors_read


def test_skeleton_allocates_nothing(tiny_models):
    source = resolve_source(str(tiny_models["llama"]))
    modules = build_skeleton(source, SliceSpec((0, 6), True, True))
    assert all(p.device.type == "meta" for p in modules.parameters())


def test_builtin_alias_skeleton_is_the_real_shape():
    source = resolve_source("smollm2-135m")
    head = build_skeleton(source, SliceSpec((0, 15), True, False))
    tail = build_skeleton(source, SliceSpec((15, 30), False, True))
    total = sum(p.numel() for p in head.parameters()) + sum(p.numel() for p in tail.parameters())
    # 134.5M parameters in the model, plus the tail's own copy of the tied 28.3M embeddings
    assert total == 134_515_008 + 49152 * 576


def test_bfloat16_slice(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["llama"], [(0, 3), (3, 6)], dtype="bfloat16")
    stage = StageEngine(plan, 0, source)
    assert {p.dtype for p in stage.model.parameters()} == {torch.bfloat16}
    assert stage.cache.keys.dtype == torch.bfloat16


def test_folder_without_weights(tmp_path, tiny_models):
    shutil.copy(tiny_models["llama"] / "config.json", tmp_path / "config.json")
    source = resolve_source(str(tmp_path))
    with pytest.raises(ModelSourceError, match="has no \\*.safetensors weights"):
        load_slice(source, SliceSpec((0, 3), True, False), torch.float32, torch.device("cpu"))


def test_missing_tensor_is_named(tmp_path, tiny_models):
    from safetensors.torch import save_file

    shutil.copy(tiny_models["llama"] / "config.json", tmp_path / "config.json")
    tensors = load_file(str(tiny_models["llama"] / "model.safetensors"))
    del tensors["model.layers.4.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = resolve_source(str(tmp_path))
    load_slice(source, SliceSpec((0, 3), True, False), torch.float32, torch.device("cpu"))  # not this stage's
    with pytest.raises(ModelSourceError, match="model.layers.4.mlp.up_proj.weight"):
        load_slice(source, SliceSpec((3, 6), False, True), torch.float32, torch.device("cpu"))


def test_bad_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("KVASIR_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelSourceError, match="neither a built-in model"):
        resolve_source(str(tmp_path / "nothing"))
    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve_source(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelSourceError, match="'gpt2' is not supported"):
        resolve_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="config.json is unreadable"):
        resolve_source(str(tmp_path))
    with pytest.raises(
        ModelSourceError, match="is not converted into the cache .* run `kvasir model prepare smollm2-135m`"
    ):
        resolve_source("smollm2-135m").require_weights()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_projections_are_fused_once_loaded(tiny_models, plan_for, family):
    """One query/key/value product per layer and one gate/up product per dense MLP, the
    weights those of the checkpoint side by side (the chain tests check the outputs)."""
    from kvasir.model.fused import FusedAttention, FusedMLP

    plan, source = plan_for(tiny_models[family], [(0, 3), (3, 6)])
    modules, _ = load_slice(source, slice_spec(plan, 0), torch.float32, torch.device("cpu"))
    tensors = load_file(str(tiny_models[family] / "model.safetensors"))
    for index, layer in enumerate(modules.layers):
        assert isinstance(layer.self_attn, FusedAttention)
        prefix = f"model.layers.{index}."
        parts = [tensors[f"{prefix}self_attn.{name}_proj.weight"] for name in "qkv"]
        assert torch.equal(layer.self_attn.qkv.weight, torch.cat(parts))
        dense = f"{prefix}mlp.gate_proj.weight" in tensors
        assert isinstance(layer.mlp, FusedMLP) == dense
    assert modules.layers[0].self_attn.sliding_window == (8 if family == "mistral-window" else None)
    if family == "qwen2_moe":  # its one dense layer among the MoE ones
        assert isinstance(modules.layers[1].mlp, FusedMLP)
