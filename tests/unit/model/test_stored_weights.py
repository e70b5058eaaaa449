"""Tiny GGUF files served as stored through the real loader and the in-process chain,
against Hugging Face ``generate`` on transformers' float32 reading of the same file."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvasir.errors import ModelSourceError
from kvasir.model.convert import prepare
from kvasir.model.loader import SliceSpec, load_slice
from kvasir.model.quant.gguf_index import read_index
from kvasir.model.quant.linear import QuantEmbedding, QuantLinear, int4_kernels_available
from kvasir.model.source import resolve_source
from kvasir.stage.chain import Chain
from kvasir.wire.batch import SamplingParams
from tests.support.gguf_models import save_tiny_gguf
from tests.support.models import hf_greedy, make_plan, random_prompts, reference_model

pytestmark = pytest.mark.skipif(not int4_kernels_available(), reason="this torch has no int4 CPU kernels")

FILES = {  # name: (family, matrices, embeddings)
    "llama-q4_1": ("llama", "Q4_1", "Q8_0"),  # tied: the LM head is the Q8_0 embedding table
    "qwen2-q4_0": ("qwen2", "Q4_0", "Q4_1"),  # biases on q/k/v, an LM head of its own
    "llama-q8_0": ("llama", "Q8_0", "Q8_0"),
}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """Each file written and converted once, into a cache of the module's own."""
    root = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVASIR_CACHE_DIR", str(root / "cache"))
        files = {name: save_tiny_gguf(root / f"{name}.gguf", *spec) for name, spec in FILES.items()}
        for path in files.values():
            prepare(resolve_source(str(path)))
        yield files


def greedy(plan, source, prompts, budget):
    chain = Chain(plan, source)
    ids = [chain.submit(p, SamplingParams(temperature=0, max_tokens=budget)) for p in prompts]
    outputs = chain.run({})
    return [outputs[i].token_ids for i in ids], chain


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_gguf_served_as_stored_matches_generate(ggufs, name):
    plan = make_plan(ggufs[name], [(0, 2), (2, 4)], max_rows=6, max_tokens=32, weights="as_stored")
    source = resolve_source(str(ggufs[name]))
    prompts = random_prompts(source.vocab_size, [1, 9, 40, 3, 70], seed=3)
    got, chain = greedy(plan, source, prompts, 12)
    reference = reference_model(source.weights_dir)
    assert got == [hf_greedy(reference, p, 12) for p in prompts]
    head, tail = (stage.model.slice for stage in chain.stages)
    assert isinstance(head.embed_tokens, QuantEmbedding) and isinstance(tail.lm_head, QuantLinear)
    assert isinstance(head.layers[0].self_attn.qkv, QuantLinear) and isinstance(
        tail.layers[1].mlp.down_proj, QuantLinear
    )
    family, matrices, embeddings = FILES[name]
    assert set(head.stored.formats) == {matrices, embeddings} and sum(head.stored.formats.values()) == 2 * 7 + 1
    assert 0 < head.stored.stored_bytes < sum(p.numel() * 4 for p in reference.model.layers[:2].parameters())


def test_dequantize_serves_float_layers_with_the_same_output(ggufs):
    path = ggufs["llama-q4_1"]
    source = resolve_source(str(path))
    spec = SliceSpec((0, 4), True, True)
    stored, _ = load_slice(source, spec, torch.float32, torch.device("cpu"), "as_stored")
    floats, _ = load_slice(source, spec, torch.float32, torch.device("cpu"), "dequantize")
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in floats.modules())
    assert not floats.stored.layers and len(stored.stored.layers) == 4 * 7 + 2
    plan = make_plan(path, [(0, 1), (1, 4)], weights="dequantize")
    prompts = random_prompts(source.vocab_size, [5, 30], seed=4)
    as_stored = make_plan(path, [(0, 1), (1, 4)], weights="as_stored")
    assert greedy(plan, source, prompts, 8)[0] == greedy(as_stored, source, prompts, 8)[0]


def test_a_cuda_stage_is_refused_before_anything_loads(ggufs):
    source = resolve_source(str(ggufs["llama-q4_1"]))
    with pytest.raises(ModelSourceError, match='CPU stages only.*model.weights = "dequantize"'):
        load_slice(source, SliceSpec((0, 2), True, False), torch.float32, torch.device("cuda", 0), "as_stored")


def test_rows_read_in_another_order_than_transformers_are_refused(ggufs, monkeypatch):
    monkeypatch.setattr("kvasir.model.quant.gguf_weights._unrotated_rows", lambda rows, heads: torch.arange(rows))
    source = resolve_source(str(ggufs["llama-q4_1"]))
    with pytest.raises(ModelSourceError, match="does not match transformers' reading"):
        load_slice(source, SliceSpec((0, 2), True, False), torch.float32, torch.device("cpu"), "as_stored")


@pytest.mark.parametrize(
    ("tensor", "stored", "expected"),
    [("blk.1.attn_v.weight", [16, 64], [32, 64]), ("token_embd.weight", [160, 64], [320, 64])],
)
def test_every_stored_matrix_whose_shape_is_not_the_configs_is_refused(ggufs, monkeypatch, tensor, stored, expected):
    """A file whose table gives a later matrix (not the first, which is compared with
    transformers' copy) fewer rows than the config: refused by name before it is used."""
    real = read_index

    def shrunk(path):
        index = real(path)
        info = index.tensors[tensor]
        index.tensors[tensor] = replace(info, shape=(info.shape[0], info.shape[1] // 2))
        return index

    monkeypatch.setattr("kvasir.model.quant.gguf_weights.read_index", shrunk)
    source = resolve_source(str(ggufs["llama-q4_1"]))
    message = rf"tensor \S+ is stored as {stored}, the config expects {expected}".replace("[", r"\[").replace(
        "]", r"\]"
    )
    with pytest.raises(ModelSourceError, match=message):
        load_slice(source, SliceSpec((0, 2), True, False), torch.float32, torch.device("cpu"), "as_stored")


def test_a_file_with_only_its_embeddings_quantised_stores_them_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("KVASIR_CACHE_DIR", str(tmp_path / "cache"))
    path = save_tiny_gguf(tmp_path / "f32.gguf", "llama", "F32", "Q8_0")
    source = prepare(resolve_source(str(path)))
    head, _ = load_slice(source, SliceSpec((0, 2), True, False), torch.bfloat16, torch.device("cpu"), "auto")
    assert isinstance(head.embed_tokens, QuantEmbedding) and head.stored.layers == ["model.embed_tokens.weight"]
    assert not any(isinstance(m, QuantLinear) for m in head.modules())
    ids = torch.tensor([0, 5, 319])
    reference = reference_model(source.weights_dir).model.embed_tokens(ids)
    assert torch.equal(head.embed_tokens(ids), reference.to(torch.bfloat16))


@pytest.mark.parametrize("name", sorted(FILES))
def test_plan_checks_stored_bytes_are_what_a_loaded_stage_holds(ggufs, name):
    """kvasir/daemon/footprint.py predicts from the skeleton what the packed stage holds."""
    from kvasir.model.loader import build_skeleton, stored_tensors
    from kvasir.model.quant.stored import stored_footprint

    source = resolve_source(str(ggufs[name]))
    spec = SliceSpec((0, 4), True, True)
    skeleton = build_skeleton(source, spec)
    tied = source.tied_embeddings
    predicted = stored_footprint(skeleton, skeleton.checkpoint_name, stored_tensors(source), tied, torch.bfloat16)
    loaded, _ = load_slice(source, spec, torch.bfloat16, torch.device("cpu"), "as_stored")
    held = tables = 0
    for module in loaded.modules():
        if isinstance(module, QuantLinear):
            held += module.packed.nbytes + module.terms.nbytes
        elif isinstance(module, QuantEmbedding):
            tables += module.blocks.nbytes
    assert predicted.held == held + tables  # the tiny models' rows are whole multiples of 16: no padding
    assert predicted.tables == tables
    assert loaded.stored.stored_bytes == held + tables  # what the stage's "stage ready" line reports
