"""Tiny random-weight models saved to a folder, for loading through the real loader."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

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


def random_prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def reference_model(folder: Path):
    """The unsplit Hugging Face model, the reference for exactness."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    inputs = torch.tensor([ids])
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()
