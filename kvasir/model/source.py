"""Resolving ``model.source`` to a model config and a weights folder.

A source is a built-in alias (its config is known without weights, so a plan can be
checked before the weights are prepared) or a path to a Hugging Face model folder.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from kvasir.errors import ModelSourceError
from kvasir.model.families import check_gguf, family_of
from kvasir.model.gguf import smollm2_gguf
from kvasir.model.moe_layout import MoeLayout
from kvasir.model.quant.schemes import Scheme, read_scheme

# Decoder families whose checkpoints lay out model.embed_tokens / model.layers.N /
# model.norm / lm_head and whose decoder layers are transformers' pre-norm structure
# (kvasir/model/decoder.py runs it); the last three are mixtures of experts (kvasir/model/moe.py).

# SmolLM2-135M-Instruct (Apache-2.0): the embedded default model.
_SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}
BUILTIN_CONFIGS = {"smollm2-135m": _SMOLLM2_135M}


@dataclass(frozen=True)
class ModelSource:
    """What a stage needs to know about a model before loading any weights."""

    name: str
    config: PretrainedConfig
    weights_dir: Path | None  # None: not converted into the cache yet
    eos_token_ids: tuple[int, ...]
    gguf: Path | None = None  # the GGUF file to convert from (None for the built-in: found on demand)
    cache_name: str | None = None  # the converted folder's name in the cache
    scheme: Scheme | None = None  # a quantized checkpoint's quantization (kvasir/model/quant/schemes.py)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def max_positions(self) -> int | None:
        value = getattr(self.config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def tied_embeddings(self) -> bool:
        """The LM head is the embedding table (no lm_head tensor of its own)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def kv_heads(self) -> int:
        return int(self.config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        config = self.config
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    @property
    def moe(self) -> MoeLayout | None:
        """Its MoE layers' layout; None for a dense model."""
        return MoeLayout.of(self.config)

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe is not None else 0

    @property
    def moe_layers(self) -> list[int]:
        return self.moe.moe_layers((0, self.num_layers)) if self.moe is not None else []

    @property
    def stored_gguf(self) -> Path | None:
        """The GGUF file the model's weights come from (the built-in's inside its
        package); None for a model folder."""
        if self.gguf is not None:
            return self.gguf
        return smollm2_gguf() if self.name in BUILTIN_CONFIGS else None

    @property
    def packed(self) -> bool:
        """Its matrices come packed: a GGUF file's blocks, or a quantized checkpoint's words."""
        return self.stored_gguf is not None or self.scheme is not None

    def require_weights(self) -> Path:
        if self.weights_dir is None:
            raise ModelSourceError(
                f"model {self.name!r} is not converted into the cache ({cache_dir()}) yet: "
                f"run `kvasir model prepare {self.name}`"
            )
        folder = self.weights_dir
        if not any(folder.glob("*.safetensors")) and not (folder / "model.safetensors.index.json").is_file():
            raise ModelSourceError(f"model folder {folder} has no *.safetensors weights")
        return folder

    def fresh_config(self) -> PretrainedConfig:
        """A private copy of the config, safe to adjust for one stage; without a
        quantization_config (the stages read the packed matrices themselves)."""
        config = copy.deepcopy(self.config)
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        return config


def cache_dir() -> Path:
    env = os.environ.get("KVASIR_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvasir"


def resolve_source(source: str, base_dir: Path | None = None) -> ModelSource:
    """Resolve a plan's ``model.source``; relative paths are taken from ``base_dir``."""
    if source in BUILTIN_CONFIGS:
        return _builtin(source)
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.exists():
        known = ", ".join(sorted(BUILTIN_CONFIGS))
        raise ModelSourceError(f"model.source {source!r} is neither a built-in model ({known}) nor an existing path")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(
                f"model.source {source!r} is a file but not a .gguf; expected a Hugging Face model "
                "folder (config.json and *.safetensors) or a .gguf file"
            )
        return _gguf(path.resolve())
    return _folder(path.resolve())


def _converted(cache_name: str) -> Path | None:
    folder = cache_dir() / cache_name
    return folder if (folder / "config.json").is_file() else None


def _builtin(name: str) -> ModelSource:
    ready = _converted(name)
    if ready is not None:
        return replace(_folder(ready), name=name, cache_name=name)
    config = _checked_config(_config_from_dict(BUILTIN_CONFIGS[name]), name)
    return ModelSource(name, config, None, _eos_ids(config, None), cache_name=name)


def _gguf(path: Path) -> ModelSource:
    from kvasir.model.gguf import gguf_architecture, gguf_cache_name

    check_gguf(gguf_architecture(path), f"model.source {path}")
    cache_name = gguf_cache_name(path)
    ready = _converted(cache_name)
    if ready is not None:
        return replace(_folder(ready), name=str(path), gguf=path, cache_name=cache_name)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except ImportError:
        raise ModelSourceError("reading GGUF files needs the gguf package: run `pip install gguf accelerate`") from None
    except Exception as exc:  # transformers raises many kinds of errors for foreign GGUF files
        raise ModelSourceError(f"model.source {path}: not a usable GGUF model: {exc}") from None
    config = _checked_config(config, str(path))
    return ModelSource(str(path), config, None, _eos_ids(config, None), gguf=path, cache_name=cache_name)


def _config_from_dict(values: dict) -> PretrainedConfig:
    return AutoConfig.for_model(**copy.deepcopy(values))


def _folder(path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model folder {path} has no config.json")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"model folder {path}: config.json is unreadable: {exc}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelSourceError(f"model folder {path}: config.json names no model_type")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"model folder {path}: config.json is not a usable config: {exc}") from None
    config = _checked_config(config, str(path))
    quantization = getattr(config, "quantization_config", None)
    scheme = read_scheme(quantization, str(path)) if quantization else None
    if scheme is not None and family_of(config.model_type, str(path)).moe is not None:
        raise ModelSourceError(
            f"model {path}: a quantized mixture-of-experts checkpoint ({scheme.describe()}) is not served yet"
        )
    return ModelSource(str(path), config, path, _eos_ids(config, path), scheme=scheme)


def _checked_config(config: PretrainedConfig, name: str) -> PretrainedConfig:
    family_of(config.model_type, f"model {name}")
    return config


def _eos_ids(config: PretrainedConfig, folder: Path | None) -> tuple[int, ...]:
    """EOS ids from the generation config when the folder has one, else the model config."""
    value = getattr(config, "eos_token_id", None)
    if folder is not None and (folder / "generation_config.json").is_file():
        try:
            gen = json.loads((folder / "generation_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelSourceError(f"model folder {folder}: generation_config.json is unreadable: {exc}") from None
        if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
            value = gen["eos_token_id"]
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelSourceError(f"model {config.model_type}: eos_token_id {value!r} is not a token id or list of ids")
    return tuple(ids)
