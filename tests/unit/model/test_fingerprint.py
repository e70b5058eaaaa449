"""The model identity the leader and its followers compare (kvasir/model/fingerprint.py):
the same weights anywhere give the same identity; other weights of the same architecture,
or another dtype, do not."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvasir.model.fingerprint import model_identity


def test_a_copy_matches_and_retrained_weights_or_another_dtype_do_not(tiny_models, tmp_path):
    original = Path(tiny_models["llama"])
    copy = Path(shutil.copytree(original, tmp_path / "copy"))
    assert model_identity(copy, "float32") == model_identity(original, "float32")
    assert model_identity(copy, "bfloat16") != model_identity(original, "float32")
    [weights] = sorted(copy.glob("*.safetensors"))
    tensors = load_file(weights)
    with safe_open(weights, "pt") as opened:
        metadata = opened.metadata()
    changed = {name: tensor + 1e-3 for name, tensor in tensors.items()}  # a fine-tune: same shapes, same size
    save_file(changed, weights, metadata=metadata)
    assert weights.stat().st_size == (original / weights.name).stat().st_size
    assert model_identity(copy, "float32") != model_identity(original, "float32")
    assert model_identity(None, "float32") == "unconverted/float32"
