"""How a mixture-of-experts model lays out its MoE layers, read from its config (no torch:
the launcher and ``kvasir plan check`` use it before any weights are read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

MoeFamily = Literal["mixtral", "qwen2_moe", "qwen3_moe"]
MOE_MODEL_TYPES: tuple[MoeFamily, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoeLayout:
    """How a model family lays out its MoE layers, read from its config."""

    family: MoeFamily
    num_experts: int
    top_k: int
    renormalise: bool  # scale the top-k weights to sum to 1
    float32_weights: bool  # Mixtral keeps the routing weights in float32; Qwen casts them
    hidden: int
    inter: int  # one expert's intermediate size
    act: str
    shared: bool  # Qwen2-MoE: a shared expert and its sigmoid gate
    sparse_step: int
    dense_layers: frozenset[int]

    @classmethod
    def of(cls, config: Any) -> MoeLayout | None:
        """The layout of a config's MoE layers; None for a dense model."""
        family = config.model_type
        if family == "mixtral":
            return cls(
                "mixtral", int(config.num_local_experts), int(config.num_experts_per_tok), True, True,
                int(config.hidden_size), int(config.intermediate_size), config.hidden_act, False, 1, frozenset(),
            )  # fmt: skip
        if family in ("qwen2_moe", "qwen3_moe"):
            return cls(
                family, int(config.num_experts), int(config.num_experts_per_tok), bool(config.norm_topk_prob),
                False, int(config.hidden_size), int(config.moe_intermediate_size), config.hidden_act,
                family == "qwen2_moe", int(config.decoder_sparse_step), frozenset(config.mlp_only_layers or ()),
            )  # fmt: skip
        return None

    def is_moe(self, layer: int) -> bool:
        """Whether a layer's MLP is a sparse-MoE block (transformers' rule per family)."""
        return self.num_experts > 0 and layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    def moe_layers(self, layers: tuple[int, int]) -> list[int]:
        return [layer for layer in range(*layers) if self.is_moe(layer)]

    @property
    def prefix(self) -> str:
        """The MoE block's name inside a checkpoint's decoder layer."""
        return "block_sparse_moe" if self.family == "mixtral" else "mlp"

    def expert_tensor(self, layer: int, expert: int, part: Literal["gate", "up", "down"]) -> str:
        names = {"gate": "w1", "up": "w3", "down": "w2"} if self.family == "mixtral" else {}
        leaf = names.get(part, f"{part}_proj")
        return f"model.layers.{layer}.{self.prefix}.experts.{expert}.{leaf}.weight"

    def expert_parameters(self) -> int:
        return 3 * self.hidden * self.inter
