"""Building one stage's slice of a decoder and reading only its tensors.

The full model skeleton is built on the meta device (no memory), the stage keeps its
own modules — embeddings on the head, final norm and LM head on the tail — and only
those are materialised and filled from the safetensors files, tensor by tensor. In a
mixture-of-experts model each MoE layer's block becomes Kvasir's ``MoeBlock``
(kvasir/model/moe.py), holding the experts the slice runs itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from kvasir.config.plan import Plan
from kvasir.config.sections import Weights
from kvasir.errors import ModelSourceError
from kvasir.model.fused import fuse_layers
from kvasir.model.moe import LocalExperts, MissingExperts, MoeBlock, MoeLayout, Piece
from kvasir.model.quant.checkpoint_weights import CheckpointTensors
from kvasir.model.quant.gguf_weights import GgufTensors
from kvasir.model.quant.linear import QuantEmbedding, QuantLinear, int4_kernels_available, pack_quantized
from kvasir.model.quant.stored import StoredLayers, StoredTensors, dequantize_stored, served_weights, swap_stored
from kvasir.model.source import ModelSource


@dataclass(frozen=True)
class SliceSpec:
    """Which part of the model a stage holds."""

    layers: tuple[int, int]  # half-open [start, end)
    is_head: bool
    is_tail: bool
    experts: tuple[int, int] | None = None  # the expert ids its MoE layers hold; None: all; empty: on shards


class SliceModules(nn.Module):
    """The modules of one stage, with their checkpoint names kept for loading."""

    def __init__(self, model: nn.Module, spec: SliceSpec) -> None:
        super().__init__()
        start, end = spec.layers
        inner: Any = model.model  # a transformers decoder (LlamaModel, Qwen2Model, ...)
        self.first_layer = start
        # transformers' modules (typed Any: they are the model's own classes); None where
        # the stage has no such part
        self.embed_tokens: Any = inner.embed_tokens if spec.is_head else None
        self.layers = nn.ModuleList(inner.layers[start:end])
        self.norm: Any = inner.norm if spec.is_tail else None
        self.lm_head: Any = model.lm_head if spec.is_tail else None
        self.rotary_type: Any = type(inner.rotary_emb)
        self.stored = StoredLayers()  # what load_slice serves as stored (kvasir/model/quant/)
        self.moe = MoeLayout.of(model.config)
        if self.moe is not None:
            experts = spec.experts or (0, self.moe.num_experts)
            for offset in self.moe_offsets():
                layer = self.layers[offset]
                held = LocalExperts(self.moe, experts) if experts[1] > experts[0] else MissingExperts()
                layer.mlp = MoeBlock(self.moe, layer.mlp, held)

    def moe_offsets(self) -> list[int]:
        """Positions in ``layers`` of the slice's MoE layers."""
        if self.moe is None:
            return []
        return [i for i in range(len(self.layers)) if self.moe.is_moe(self.first_layer + i)]

    def moe_blocks(self) -> list[tuple[int, MoeBlock]]:
        """The slice's MoE blocks with their model layer indices."""
        return [(self.first_layer + i, self.layers[i].mlp) for i in self.moe_offsets()]  # type: ignore[misc]

    def checkpoint_pieces(self) -> dict[str, list[Piece]]:
        """Map each of this slice's parameter names to the checkpoint tensors that fill it."""
        pieces = {local: [Piece(self.checkpoint_name(local))] for local in self.state_dict(keep_vars=True)}
        for offset in self.moe_offsets():
            block: Any = self.layers[offset].mlp
            experts = block.experts
            if isinstance(experts, LocalExperts):
                for name, parts in experts.pieces(self.first_layer + offset).items():
                    pieces[f"layers.{offset}.mlp.experts.{name}"] = parts
        return pieces

    def checkpoint_name(self, local: str) -> str:
        part, _, rest = local.partition(".")
        if part == "layers":
            index, _, tail = rest.partition(".")
            layer = int(index) + self.first_layer
            if self.moe is not None and self.moe.is_moe(layer) and tail.startswith("mlp."):
                tail = f"{self.moe.prefix}.{tail.removeprefix('mlp.')}"
            return f"model.layers.{layer}.{tail}"
        if part in ("embed_tokens", "norm"):
            return f"model.{local}"
        return local  # lm_head.*


def build_skeleton(source: ModelSource, spec: SliceSpec) -> SliceModules:
    """The stage's modules on the meta device: shapes only, nothing allocated."""
    config = source.fresh_config()
    config._attn_implementation = "eager"  # never called: every layer's attention is Kvasir's (kvasir/model/fused.py)
    with torch.device("meta"):
        return SliceModules(AutoModelForCausalLM.from_config(config), spec)


def count_parameters(modules: SliceModules) -> int:
    return sum(p.numel() for p in modules.parameters())


def load_slice(
    source: ModelSource, spec: SliceSpec, dtype: torch.dtype, device: torch.device, weights: Weights = "auto"
) -> tuple[SliceModules, list[str]]:
    """Materialise the stage's modules, fill them and fuse their projections
    (kvasir/model/fused.py); return them and the tensors read. With ``weights =
    "as_stored"`` and packed matrices (a GGUF source, a quantized checkpoint), those in a
    served format stay as stored (kvasir/model/quant/; ``modules.stored`` says which); a
    quantized checkpoint served dequantised has them decoded to floats (it holds no
    float copy)."""
    folder = source.require_weights()
    index = _tensor_index(folder)
    modules = build_skeleton(source, spec)
    served = served_weights(
        weights, str(dtype).removeprefix("torch."), [str(device)], source.packed, kernels=int4_kernels_available()
    )
    tensors = stored_tensors(source, index) if served == "as_stored" or source.scheme is not None else None
    if tensors is not None:
        modules.stored = swap_stored(modules, modules.checkpoint_name, tensors, source.tied_embeddings, dtype)
    stored = modules.stored
    modules.to_empty(device=device)
    modules.to(dtype)
    state = modules.state_dict(keep_vars=True)
    wanted = [(state[local], piece) for local, pieces in modules.checkpoint_pieces().items() for piece in pieces]
    read = _read(source, folder, index, wanted, dtype)
    if stored.layers and source.stored_gguf is not None:
        _check_stored(modules, source, folder, index)
    fuse_layers(modules.layers, source.config.model_type)
    if served == "dequantize":
        dequantize_stored(modules, dtype, device)
    pack_quantized(modules, dtype)
    return modules, read + stored.layers


def stored_tensors(source: ModelSource, index: dict[str, str] | None = None) -> StoredTensors | None:
    """Where a source's packed matrices come from: its GGUF file, or its quantized
    checkpoint's folder (``index``: its tensor -> file map, read here if not given); None
    for a float model folder."""
    path = source.stored_gguf
    if path is not None:
        config = source.config
        return GgufTensors(path, source.num_layers, int(config.num_attention_heads), source.kv_heads)
    if source.scheme is not None:
        folder = source.require_weights()
        return CheckpointTensors(folder, _tensor_index(folder) if index is None else index, source.scheme)
    return None


def _check_stored(modules: SliceModules, source: ModelSource, folder: Path, index: dict[str, str]) -> None:
    """The slice's first matrix and embedding table served as stored equal transformers'
    float32 copies of them: the two readings of the file (row order above all) agree,
    or the stage refuses. ``index``: the folder's tensor -> file map."""
    for kind in (QuantLinear, QuantEmbedding):
        first = next(((p, m) for p, m in modules.named_modules() if isinstance(m, kind)), None)
        if first is None:
            continue
        path, layer = first
        name = modules.checkpoint_name(f"{path}.weight")
        if name not in index:  # a tied head: the embeddings' copy
            name = "model.embed_tokens.weight"
        with safe_open(str(folder / index[name]), framework="pt", device="cpu") as handle:
            reference = handle.get_tensor(name).float()
        if isinstance(layer, QuantLinear):
            ours = layer.unpacked().dequantize()
        else:  # an embedding table: its first rows
            reference = reference[:64]
            ours = layer.rows(torch.arange(reference.shape[0]))
        if ours.shape != reference.shape or not torch.allclose(ours, reference, rtol=1e-5, atol=1e-6):
            raise ModelSourceError(
                f"model {source.name}: {name} as stored in the GGUF file does not match transformers' reading "
                'of it; serve it with model.weights = "dequantize"'
            )


def load_experts(
    source: ModelSource, layers: tuple[int, int], experts: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> dict[int, LocalExperts]:
    """An expert shard's weights: the experts ``experts`` of every MoE layer in ``layers``
    (and nothing else of the model), by layer."""
    folder = source.require_weights()
    layout = source.moe
    if layout is None:
        raise ModelSourceError(f"model {source.name} is not a mixture of experts: it has no experts to load")
    with torch.device(device):
        bank = {layer: LocalExperts(layout, experts, dtype) for layer in layout.moe_layers(layers)}
    wanted = [
        (getattr(module, name), piece)
        for layer, module in bank.items()
        for name, pieces in module.pieces(layer).items()
        for piece in pieces
    ]
    _read(source, folder, _tensor_index(folder), wanted, dtype)
    return bank


def _read(
    source: ModelSource,
    folder: Path,
    index: dict[str, str],
    wanted: list[tuple[torch.Tensor, Piece]],
    dtype: torch.dtype,
) -> list[str]:
    """Fill each parameter's pieces from the checkpoint (``index``: its tensor -> file
    map); the names of the tensors read."""
    by_file: dict[str, list[tuple[torch.Tensor, Piece]]] = {}
    for param, piece in wanted:
        if piece.stored not in index and piece.stored == "lm_head.weight" and source.tied_embeddings:
            piece = Piece("model.embed_tokens.weight", piece.index)
        if piece.stored not in index:
            raise ModelSourceError(f"model folder {folder}: tensor {piece.stored!r} is missing from the weights")
        by_file.setdefault(index[piece.stored], []).append((param, piece))
    read: list[str] = []
    for file, pairs in sorted(by_file.items()):
        with safe_open(str(folder / file), framework="pt", device="cpu") as handle:
            for param, piece in pairs:
                _fill(param, piece, handle.get_tensor(piece.stored), dtype, folder)
                read.append(piece.stored)
    return read


def _fill(param: torch.Tensor, piece: Piece, tensor: torch.Tensor, dtype: torch.dtype, folder: Path) -> None:
    target = param if piece.index is None else param[piece.index]
    if tuple(tensor.shape) != tuple(target.shape):
        raise ModelSourceError(
            f"model folder {folder}: tensor {piece.stored!r} has shape {tuple(tensor.shape)}, "
            f"the config expects {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor.to(dtype))


def _tensor_index(folder: Path) -> dict[str, str]:
    """Map tensor name -> safetensors file, from the index file or the file headers."""
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelSourceError(f"model folder {folder}: unreadable {index_file.name}: {exc}") from None
        return dict(weight_map)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"model folder {folder} has no *.safetensors weights")
    index: dict[str, str] = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    index[key] = name
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ModelSourceError(f"model folder {folder}: {name} is not a readable safetensors file: {exc}") from None
    return index


def slice_spec(plan: Plan, index: int) -> SliceSpec:
    """Stage ``index`` of a ring plan; a stage with expert shards holds no experts itself."""
    stage = plan.stages[index]
    return SliceSpec(
        layers=stage.layers,
        is_head=index == 0,
        is_tail=index == len(plan.stages) - 1,
        experts=(0, 0) if stage.experts else None,
    )
