from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from models import save_tiny_model  # noqa: E402

from kvasir.model.source import resolve_source  # noqa: E402
from kvasir.plan import parse_plan  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random-weight models of three families, saved once per session."""
    root = tmp_path_factory.mktemp("models")
    models = {family: save_tiny_model(root / family, family) for family in ("llama", "qwen2", "mistral")}
    models["mistral-window"] = save_tiny_model(root / "mistral-window", "mistral", sliding_window=8)
    return models


def make_plan(source, splits, *, max_seq_len=256, max_rows=8, max_tokens=32, inflight=3,
              block_size=4, num_blocks=600, dtype="float32", device="cpu"):
    """A plan TOML for ``source`` split at the given layer ranges, parsed."""
    stages = "\n".join(
        f'[[stages]]\nlayers = [{a}, {b}]\ndevice = "{device}"\n' for a, b in splits
    )
    text = f"""
[model]
source = "{source}"
dtype = "{dtype}"
max_seq_len = {max_seq_len}
[batch]
max_rows = {max_rows}
max_tokens = {max_tokens}
inflight = {inflight}
[kv]
block_size = {block_size}
num_blocks = {num_blocks}
{stages}
"""
    return parse_plan(text)


@pytest.fixture
def plan_for():
    def build(folder, splits, **kw):
        plan = make_plan(folder, splits, **kw)
        return plan, resolve_source(plan.model.source)
    return build
