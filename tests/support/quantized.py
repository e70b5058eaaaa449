"""Tiny quantized checkpoints in the formats Kvasir serves, and the float model each stands
for: the same weights with every decoder matrix replaced by its dequantised values,
``(q - zero) * scale`` in float32 (the reference for ``generate``). compressed-tensors'
words are packed by the compressed-tensors package's own packer; GPTQ's and AWQ's (whose
tools need CUDA builds) word by word as those tools lay them out
(kvasir/model/quant/checkpoint_formats.py describes each)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM

from kvasir.model.quant.checkpoint_formats import AWQ_ORDER
from tests.support.models import tiny_config

METHODS = ("compressed-tensors", "compressed-tensors-symmetric", "gptq", "awq")


def pack_words(values: np.ndarray, order=tuple(range(8))) -> torch.Tensor:
    """[R, 8 C] values 0..15 to int32 [R, C]: nibble i of a word holds value order[i] of its eight."""
    rows, columns = values.shape
    words = np.zeros((rows, columns // 8), dtype=np.uint32)
    for c in range(columns // 8):
        for i in range(8):
            words[:, c] |= values[:, 8 * c + order[i]].astype(np.uint32) << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


def quantize(weight: torch.Tensor, group: int, symmetric: bool, lowest_zero: int = 0):
    """4-bit codes [N, K], integer zeros and float16 scales [N, K / group] (min-max)."""
    rows, columns = weight.shape
    w = weight.detach().float().view(rows, columns // group, group)
    if symmetric:
        scale = (w.abs().amax(-1) / 7).clamp(min=1e-4).half()
        zero = torch.full(scale.shape, 8.0)
    else:
        low, high = w.amin(-1), w.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-4).half()
        zero = (-low / scale.float()).round().clamp(lowest_zero, 15)
    q = (w / scale.float()[..., None]).round() + zero[..., None]
    return q.clamp(0, 15).view(rows, columns).long().numpy(), zero.long().numpy(), scale


def dequantized(q: np.ndarray, zero: np.ndarray, scale: torch.Tensor, group: int) -> torch.Tensor:
    per_input = torch.from_numpy(np.repeat(zero, group, axis=1))
    return (torch.from_numpy(q) - per_input).float() * scale.float().repeat_interleave(group, dim=1)


def packed(method: str, prefix: str, q: np.ndarray, zero: np.ndarray, scale: torch.Tensor, group: int) -> dict:
    rows, columns = q.shape
    if method.startswith("compressed-tensors"):
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        signed = torch.from_numpy(q - 8).to(torch.int8)  # compressed-tensors' codes are signed, packed with + 8
        out = {
            f"{prefix}.weight_packed": pack_to_int32(signed, 4),
            f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_shape": torch.tensor([rows, columns]),
        }
        if method == "compressed-tensors":  # asymmetric: zero points packed along the outputs
            zero_point = torch.from_numpy(zero - 8).to(torch.int8)
            out[f"{prefix}.weight_zero_point"] = pack_to_int32(zero_point, 4, packed_dim=0)
        return out
    if method == "gptq":  # the original format stores each zero minus one
        return {
            f"{prefix}.qweight": pack_words(q).t().contiguous(),
            f"{prefix}.qzeros": pack_words((zero - 1).T.copy()),
            f"{prefix}.scales": scale.t().contiguous(),
            f"{prefix}.g_idx": (torch.arange(columns) // group).to(torch.int32),
        }
    return {  # awq gemm
        f"{prefix}.qweight": pack_words(q.T.copy(), AWQ_ORDER),
        f"{prefix}.qzeros": pack_words(zero.T.copy(), AWQ_ORDER),
        f"{prefix}.scales": scale.t().contiguous(),
    }


def quantization_config(method: str, group: int) -> dict:
    if method.startswith("compressed-tensors"):
        weights = {"num_bits": 4, "type": "int", "symmetric": method != "compressed-tensors"}
        weights |= {"strategy": "group", "group_size": group, "dynamic": False, "actorder": None}
        scheme = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": scheme},
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False}
    return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}


def save_quantized(root: Path, method: str, family: str = "llama", group: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """(the quantized checkpoint's folder, the reference float32 folder)."""
    torch.manual_seed(seed)
    config = tiny_config(family, num_layers=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    quantized: dict[str, torch.Tensor] = {}
    replaced = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in name:
            q, zero, scale = quantize(module.weight, group, method == "compressed-tensors-symmetric", 1)
            with torch.no_grad():
                module.weight.copy_(dequantized(q, zero, scale, group))
            quantized |= packed(method, name, q, zero, scale, group)
            replaced.add(f"{name}.weight")
    reference, folder = root / f"{method}-reference", root / method
    model.save_pretrained(reference)
    folder.mkdir(parents=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    rest = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k not in replaced | tied}
    save_file(rest | quantized, str(folder / "model.safetensors"))
    values = json.loads((reference / "config.json").read_text())
    values["quantization_config"] = quantization_config(method, group)
    (folder / "config.json").write_text(json.dumps(values))
    return folder, reference
