"""How a mixture-of-experts model lays out its MoE layers, read from its config through its
family's entry (kvasir/model/families.py; no torch: the launcher and ``kvasir plan check``
use it before any weights are read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvasir.model.families import FAMILIES, MoeSpec


@dataclass(frozen=True)
class MoeLayout:
    """How a model lays out its MoE layers, read from its config."""

    family: str  # the model_type
    num_experts: int
    top_k: int
    renormalise: bool  # scale the top-k weights to sum to 1
    float32_weights: bool  # Mixtral keeps the routing weights in float32; Qwen casts them
    hidden: int
    inter: int  # one expert's intermediate size
    act: str
    shared: bool  # Qwen2-MoE: a shared expert and its sigmoid gate
    sparse_step: int = 1
    dense_layers: frozenset[int] = frozenset()
    block: str = "mlp"  # the MoE block's name inside a checkpoint's decoder layer
    expert_names: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Any) -> MoeLayout | None:
        """The layout of a config's MoE layers; None for a dense model."""
        family = FAMILIES.get(config.model_type)
        if family is None or family.moe is None:
            return None
        spec: MoeSpec = family.moe
        renormalise = spec.renormalise if isinstance(spec.renormalise, bool) else getattr(config, spec.renormalise)
        return cls(
            family=config.model_type,
            num_experts=int(getattr(config, spec.experts)),
            top_k=int(config.num_experts_per_tok),
            renormalise=bool(renormalise),
            float32_weights=spec.float32_weights,
            hidden=int(config.hidden_size),
            inter=int(getattr(config, spec.inter)),
            act=config.hidden_act,
            shared=spec.shared_expert,
            sparse_step=int(getattr(config, spec.sparse_step)) if spec.sparse_step else 1,
            dense_layers=frozenset((getattr(config, spec.dense_layers) or ()) if spec.dense_layers else ()),
            block=spec.block,
            expert_names=spec.expert_names,
        )

    def is_moe(self, layer: int) -> bool:
        """Whether a layer's MLP is a sparse-MoE block (transformers' rule per family)."""
        return self.num_experts > 0 and layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    def moe_layers(self, layers: tuple[int, int]) -> list[int]:
        return [layer for layer in range(*layers) if self.is_moe(layer)]

    @property
    def prefix(self) -> str:
        """The MoE block's name inside a checkpoint's decoder layer."""
        return self.block

    def expert_tensor(self, layer: int, expert: int, part: Literal["gate", "up", "down"]) -> str:
        leaf = self.expert_names.get(part, f"{part}_proj")
        return f"model.layers.{layer}.{self.block}.experts.{expert}.{leaf}.weight"

    def expert_parameters(self) -> int:
        return 3 * self.hidden * self.inter
