"""Which ``quantization_config`` of a model folder Kvasir serves, read before any weight.

Served: weight-only 4-bit integers with a scale (and a zero) per group of inputs, the
three forms kvasir/model/quant/checkpoint_formats.py decodes onto PyTorch's int4 CPU
kernel: compressed-tensors ``pack-quantized`` (llm-compressor's W4A16 and asymmetric
W4A16), GPTQ (4 bits, without activation order) and AWQ ``gemm``. Every other
configuration is refused at ``kvasir plan check`` naming what it asks for, never loaded
wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from kvasir.errors import ModelSourceError

Method = Literal["compressed-tensors", "gptq", "awq"]
SERVED = (
    "4-bit integer weights with groups of inputs: compressed-tensors pack-quantized, GPTQ without "
    "activation order, AWQ gemm"
)


@dataclass(frozen=True)
class Scheme:
    """A served quantization: ``group`` inputs share a scale (0: every input of a row)."""

    method: Method
    group: int
    symmetric: bool = True  # compressed-tensors: no zero points stored (the zero is 8)
    v2: bool = False  # GPTQ's gptq_v2 checkpoint format: zeros stored as they are

    def describe(self) -> str:
        groups = f"groups of {self.group}" if self.group else "one scale per output"
        return f"{self.method} 4-bit ({groups})"


def read_scheme(quantization: Any, model: str) -> Scheme:
    """The served scheme of a config's ``quantization_config`` (a dict, or transformers'
    config object); ModelSourceError naming what is not served otherwise."""
    config = quantization.to_dict() if hasattr(quantization, "to_dict") else quantization
    if not isinstance(config, Mapping):
        raise ModelSourceError(f"model {model}: quantization_config is not a table")
    method = str(config.get("quant_method", "unnamed"))
    readers = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq}
    if method not in readers:
        _refuse(model, method, "is not a served method")
    return readers[method](config, model)


def _refuse(model: str, method: str, what: str) -> NoReturn:
    raise ModelSourceError(
        f"model {model}: its {method!r} quantization_config {what}; Kvasir serves {SERVED} "
        "(and GGUF files: Q4_0, Q4_1 and Q8_0 as stored, every other type dequantised)"
    )


def _compressed_tensors(config: Mapping, model: str) -> Scheme:
    method = "compressed-tensors"
    if config.get("format") != "pack-quantized":
        _refuse(model, method, f"has format {config.get('format')!r}, not 'pack-quantized'")
    for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if config.get(key):
            _refuse(model, method, f"has a {key}")
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        _refuse(model, method, "names no config_groups")
    weights = [_ct_weights(group, model) for group in groups.values()]
    if any(w != weights[0] for w in weights[1:]):
        _refuse(model, method, "quantizes its layers in different schemes")
    strategy, group, symmetric = weights[0]
    return Scheme("compressed-tensors", group if strategy == "group" else 0, symmetric=symmetric)


def _ct_weights(group: Any, model: str) -> tuple[str, int, bool]:
    method = "compressed-tensors"
    if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
        _refuse(model, method, "has a config group without weights")
    if group.get("input_activations") or group.get("output_activations"):
        _refuse(model, method, "quantizes activations too")
    if group.get("format") not in (None, "pack-quantized"):
        _refuse(model, method, f"has a group in format {group.get('format')!r}")
    w = group["weights"]
    if (w.get("num_bits"), w.get("type")) != (4, "int"):
        _refuse(model, method, f"stores {w.get('num_bits')}-bit {w.get('type')} weights")
    if w.get("strategy") not in ("group", "channel") or w.get("dynamic"):
        _refuse(model, method, f"has weight strategy {w.get('strategy')!r}")
    size = _group_size(w.get("group_size"), model, method) if w.get("strategy") == "group" else 0
    if w.get("strategy") == "group" and size == 0:
        _refuse(model, method, "has group strategy without a group_size")
    return str(w["strategy"]), size, bool(w.get("symmetric", True))


def _group_size(value: Any, model: str, method: str) -> int:
    """A config's group size: a positive integer, or -1 (or none) for one group per row (0)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        _refuse(model, method, f"has group_size {value!r}, not a positive integer or -1")
    return max(value, 0)


def _gptq(config: Mapping, model: str) -> Scheme:
    if config.get("bits") != 4:
        _refuse(model, "gptq", f"stores {config.get('bits')}-bit weights")
    if config.get("desc_act"):
        _refuse(model, "gptq", "uses activation order (desc_act)")
    fmt = config.get("checkpoint_format", config.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        _refuse(model, "gptq", f"has checkpoint format {fmt!r}")
    return Scheme("gptq", _group_size(config.get("group_size", 128), model, "gptq"), v2=fmt == "gptq_v2")


def _awq(config: Mapping, model: str) -> Scheme:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        _refuse(model, "awq", f"stores {bits}-bit weights")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse(model, "awq", f"has version {version!r} (its words are laid out for another kernel)")
    if not config.get("zero_point", True):
        _refuse(model, "awq", "has no zero points")
    return Scheme("awq", _group_size(config.get("group_size", config.get("q_group_size", 128)), model, "awq"))
