"""Tiny random-weight models saved to a folder, for loading through the real loader."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from kvasir.config.plan import parse_plan

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(family: str, num_layers: int = 6, **overrides):
    values = dict(TINY, num_hidden_layers=num_layers, **overrides)
    if family == "llama":
        return LlamaConfig(tie_word_embeddings=True, **values)
    if family == "qwen2":
        return Qwen2Config(**dict(dict(tie_word_embeddings=False, use_sliding_window=False), **values))
    if family == "mistral":
        return MistralConfig(**dict(dict(tie_word_embeddings=False, sliding_window=None), **values))
    return tiny_moe_config(family, values)


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_moe_config(family: str, values: dict):
    """8 experts, top-2 (Qwen3-MoE: top-3, so a token's experts often span three shards);
    Qwen2-MoE with its shared expert and one dense layer among the MoE ones."""
    moe = dict(num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "mixtral":
        return MixtralConfig(**dict(moe, num_local_experts=8, sliding_window=None, **values))
    qwen = dict(moe, num_experts=8, moe_intermediate_size=48, norm_topk_prob=family == "qwen3_moe")
    if family == "qwen2_moe":
        qwen.update(shared_expert_intermediate_size=96, mlp_only_layers=[1], use_sliding_window=False)
        return Qwen2MoeConfig(**dict(qwen, **values))
    if family == "qwen3_moe":
        qwen.update(num_experts_per_tok=3, head_dim=16)
        return Qwen3MoeConfig(**dict(qwen, **values))
    raise ValueError(family)


def save_tiny_model(folder: Path, family: str = "llama", num_layers: int = 6, seed: int = 0, **overrides) -> Path:
    """Build a random-weight model, save it as safetensors, and return the folder."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_layers, **overrides))
    # Larger random weights give decisive logits, so greedy choices are stable.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


def save_looping_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random Llama whose layers barely add to the residual stream (their output
    projections scaled by 0.05): its greedy output repeats a token for a while, then
    moves on to another, the way real models fall into copies and loops. Speculative
    decoding's drafts are mostly confirmed on it, and sometimes not."""
    save_tiny_model(folder, "llama", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(0.05)
    model.save_pretrained(folder)
    return folder


def random_prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def reference_model(folder: Path):
    """The unsplit Hugging Face model, the reference for exactness."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    inputs = torch.tensor([ids])
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "pipeline stages pass boundaries to each other",
    "naïve café déjà vu — über straße, ∑ ✓ 🚀 日本語のテキスト",
    "hello world, hello ring, hello kvasir",
] * 20


def save_tiny_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer trained here (vocab < 320), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=310, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(folder)


def shard_tables(ranges, table: str = "stages") -> str:
    """The ``[[stages.experts]]`` tables of a stage's expert shards, one per range
    ``(first, end)`` or ``(first, end, device)``."""
    text = ""
    for first, end, *device in ranges:
        text += f"[[{table}.experts]]\nexperts = [{first}, {end}]\n"
        text += "".join(f'device = "{d}"\n' for d in device)
    return text


def make_plan(
    source,
    splits,
    *,
    max_seq_len=256,
    max_rows=8,
    max_tokens=32,
    inflight=3,
    block_size=4,
    num_blocks=600,
    dtype="float32",
    device="cpu",
    experts=None,
    prefix_cache=True,
    weights=None,
):
    """A plan TOML for ``source`` split at the given layer ranges, parsed; ``experts``:
    {stage index: [expert ranges of its shards]}."""
    stages = "\n".join(
        f'[[stages]]\nlayers = [{a}, {b}]\ndevice = "{device}"\n' + shard_tables((experts or {}).get(i, ()))
        for i, (a, b) in enumerate(splits)
    )
    text = f"""
[model]
source = "{source}"
dtype = "{dtype}"
{f'weights = "{weights}"' if weights else ""}
max_seq_len = {max_seq_len}
[batch]
max_rows = {max_rows}
max_tokens = {max_tokens}
inflight = {inflight}
[kv]
block_size = {block_size}
num_blocks = {num_blocks}
prefix_cache = {str(prefix_cache).lower()}
{stages}
"""
    return parse_plan(text)
