"""Tiny GGUF files written here: a random-weight model quantised as llama.cpp's converter
would store it (Llama query/key rows interleaved for its rotary layout), with a byte-level
BPE tokenizer, for loading through the real loader."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.models import save_tiny_model, save_tiny_tokenizer

# HF leaf -> GGUF leaf, per decoder layer
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for a Llama query or key matrix."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def save_tiny_gguf(
    path: Path, family: str = "llama", matrices: str = "Q4_1", embeddings: str = "Q8_0", num_layers: int = 4
) -> Path:
    """A tiny ``family`` model (llama or qwen2) as one GGUF file: its matrices in
    ``matrices``, its embedding table in ``embeddings``, norms (and biases) in F32."""
    folder = save_tiny_model(path.parent / f"{path.stem}-hf", family, num_layers=num_layers)
    save_tiny_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = model.config
    writer = gguf.GGUFWriter(str(path), family)
    _metadata(writer, config, family)
    _tokenizer(writer, folder, config.vocab_size)
    for name, tensor in model.state_dict().items():
        gguf_name, fmt = _gguf_name(name, num_layers, matrices, embeddings)
        if gguf_name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        data = tensor.numpy().astype(np.float32)
        if family == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            data = interleaved(data, heads)
        if fmt == "F32" or data.ndim == 1:
            writer.add_tensor(gguf_name, data)
        else:
            qtype = GGMLQuantizationType[fmt]
            writer.add_tensor(gguf_name, quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name(name: str, num_layers: int, matrices: str, embeddings: str) -> tuple[str | None, str]:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight", embeddings
    if name == "lm_head.weight":
        return "output.weight", matrices
    if name == "model.norm.weight":
        return "output_norm.weight", "F32"
    parts = name.split(".")  # model.layers.N.<module>.<leaf>
    module = ".".join(parts[3:-1])
    if parts[:2] != ["model", "layers"] or module not in LAYER_NAMES:
        return None, "F32"
    return f"blk.{parts[2]}.{LAYER_NAMES[module]}.{parts[-1]}", matrices


def _metadata(writer: gguf.GGUFWriter, config, family: str) -> None:
    writer.add_name(f"tiny {family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [f"<unused{i}>" for i in range(vocab_size)]
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else (5 if i >= len(vocab) else 1) for i in range(vocab_size)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
