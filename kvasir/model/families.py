"""Every model family Kvasir serves, in one table: what each needs beyond what transformers
already does (no torch here: the launcher and ``kvasir plan check`` read it before any
weights are loaded).

A family is a transformers ``model_type``. Kvasir runs transformers' own decoder-layer modules
on its paged KV cache, so a family needs only: which sliding window its attention passes
to the attention function (``window``), whether a GGUF file of it converts (``gguf``),
and, for a mixture of experts, where its config and checkpoint keep the experts
(``moe``). docs/models.md says step by step what adding a family takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from kvasir.errors import ModelSourceError

# Which window a family's transformers attention hands the attention function: none (full
# attention), the attention module's own ``sliding_window`` attribute (set per layer from
# the config's layer types), or the config's ``sliding_window``.
WindowRule = Literal["none", "module", "config"]


@dataclass(frozen=True)
class MoeSpec:
    """Where a mixture-of-experts family keeps its experts: config attribute names and
    checkpoint tensor names (kvasir/model/moe_layout.py reads a config through it)."""

    experts: str  # config attribute: routed experts per MoE layer
    inter: str  # config attribute: one expert's intermediate size
    renormalise: str | bool  # config attribute saying whether the top-k weights are scaled to sum 1, or always
    float32_weights: bool  # routing weights kept in float32 (Mixtral) or cast to the model's dtype (Qwen)
    shared_expert: bool = False  # a shared expert with a sigmoid gate beside the routed ones (Qwen2-MoE)
    sparse_step: str | None = None  # config attribute: every Nth layer is MoE (None: every layer)
    dense_layers: str | None = None  # config attribute: layers kept dense (None: none)
    block: str = "mlp"  # the MoE block's name inside a checkpoint's decoder layer
    expert_names: Mapping[str, str] = field(default_factory=dict)  # gate/up/down -> tensor leaf (default NAME_proj)


@dataclass(frozen=True)
class Family:
    model_type: str
    window: WindowRule
    gguf: bool = False  # a GGUF file of this architecture converts through transformers' GGUF loader
    moe: MoeSpec | None = None


QWEN_MOE = MoeSpec(
    experts="num_experts",
    inter="moe_intermediate_size",
    renormalise="norm_topk_prob",
    float32_weights=False,
    sparse_step="decoder_sparse_step",
    dense_layers="mlp_only_layers",
)

FAMILIES: Mapping[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", window="none", gguf=True),
        Family("mistral", window="config", gguf=True),
        Family("qwen2", window="module", gguf=True),
        Family("qwen3", window="module", gguf=True),
        Family(
            "mixtral",
            window="config",
            moe=MoeSpec(
                experts="num_local_experts",
                inter="intermediate_size",
                renormalise=True,
                float32_weights=True,
                block="block_sparse_moe",
                expert_names={"gate": "w1", "up": "w3", "down": "w2"},
            ),
        ),
        # Qwen2-MoE's attention sets a window on the module but passes none: full attention
        Family("qwen2_moe", window="none", moe=replace(QWEN_MOE, shared_expert=True)),
        Family("qwen3_moe", window="module", moe=QWEN_MOE),
    )
}

GGUF_ARCHITECTURES = tuple(name for name, family in FAMILIES.items() if family.gguf)


def check_gguf(architecture: str, where: str) -> None:
    """ModelSourceError unless a GGUF file of ``architecture`` converts."""
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelSourceError(
            f"{where}: GGUF architecture {architecture!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )


def family_of(model_type: str, where: str) -> Family:
    """The family of a ``model_type``; ModelSourceError naming the supported ones otherwise."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ModelSourceError(
            f"{where}: architecture {model_type!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    return family
