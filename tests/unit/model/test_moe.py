"""Mixture-of-experts layers through the real loader: which tensors a slice reads, and
experts split into ranges adding up to the whole layer's output."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvasir.model.loader import SliceSpec, load_slice
from kvasir.model.moe import LocalExperts, MoeBlock, MoeLayout
from kvasir.model.source import resolve_source
from tests.support.models import MOE_FAMILIES, tiny_config


def expert_ids(read: list[str]) -> set[int]:
    return {int(name.split(".experts.")[1].split(".")[0]) for name in read if ".experts." in name}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_slice_with_an_expert_range_reads_only_those_experts(tiny_models, family):
    source = resolve_source(str(tiny_models[family]))
    modules, read = load_slice(
        source, SliceSpec((0, 3), True, False, experts=(2, 5)), torch.float32, torch.device("cpu")
    )
    layout = modules.moe
    assert layout is not None and expert_ids(read) == {2, 3, 4}
    moe_layers = layout.moe_layers((0, 3))
    assert len([n for n in read if ".experts." in n]) == 3 * 3 * len(moe_layers)  # gate, up, down per expert
    assert sum(".gate.weight" in n for n in read) == len(moe_layers)  # each MoE layer's router
    if family == "qwen2_moe":
        assert moe_layers == [0, 2]  # layer 1 is dense (mlp_only_layers)
        assert any("layers.1.mlp.gate_proj" in n for n in read) and any("shared_expert_gate" in n for n in read)
    block = modules.layers[0].mlp
    assert isinstance(block, MoeBlock) and block.experts.gate_up.shape[0] == 3


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_ranges_add_up_to_the_whole_layer(tiny_models, family):
    """Uneven ranges, one holding a single expert; tokens whose top-k span several
    ranges; a range no token was routed to gives zeros."""
    source = resolve_source(str(tiny_models[family]))
    cpu = torch.device("cpu")
    whole, _ = load_slice(source, SliceSpec((0, 1), True, False), torch.float32, cpu)
    block = whole.layers[0].mlp
    hidden = torch.randn(40, block.layout.hidden, generator=torch.Generator().manual_seed(3))
    ids, weights = block.route(hidden)
    expected = block.experts(hidden, ids, weights)
    parts, last = [], None
    for experts in [(0, 1), (1, 6), (6, 8)]:
        shard, _ = load_slice(source, SliceSpec((0, 1), True, False, experts=experts), torch.float32, cpu)
        last = shard.layers[0].mlp.experts
        parts.append(last(hidden, ids, weights))
    ranges = torch.bucketize(ids, torch.tensor([1, 6]), right=True)  # which range holds each pick
    assert max(len(set(row.tolist())) for row in ranges) >= 2, "some token's experts should span ranges"
    torch.testing.assert_close(parts[0] + parts[1] + parts[2], expected, atol=1e-6, rtol=1e-6)
    unrouted = ids.ne(0).all(dim=1)
    assert unrouted.any() and torch.equal(parts[0][unrouted], torch.zeros_like(parts[0][unrouted]))
    elsewhere = torch.ones_like(ids)  # every pick on expert 1: the last range gets no rows
    assert torch.equal(last(hidden, elsewhere, weights), torch.zeros_like(hidden))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_block_matches_transformers_block(tiny_models, family):
    """Kvasir's MoE block (router, experts, shared expert) on the layer's own weights gives
    transformers' output for the same hidden states."""
    source = resolve_source(str(tiny_models[family]))
    modules, _ = load_slice(source, SliceSpec((0, 1), True, False), torch.float32, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32).eval()
    hidden = torch.randn(1, 25, modules.moe.hidden, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(
            modules.layers[0].mlp(hidden), reference.model.layers[0].mlp(hidden), atol=1e-5, rtol=1e-5
        )


def test_layouts_follow_transformers_rules():
    dense = MoeLayout.of(tiny_config("llama"))
    qwen2 = MoeLayout.of(tiny_config("qwen2_moe", 4, decoder_sparse_step=2))
    mixtral = MoeLayout.of(tiny_config("mixtral"))
    assert dense is None and mixtral is not None and qwen2 is not None
    assert qwen2.moe_layers((0, 4)) == [3] and qwen2.shared and not mixtral.shared  # layer 1 dense by mlp_only_layers
    assert mixtral.expert_tensor(3, 5, "up") == "model.layers.3.block_sparse_moe.experts.5.w3.weight"
    assert qwen2.expert_tensor(3, 5, "down") == "model.layers.3.mlp.experts.5.down_proj.weight"
    assert LocalExperts(mixtral, (2, 4), torch.float32).gate_up.shape == (2, 2 * mixtral.inter, mixtral.hidden)
