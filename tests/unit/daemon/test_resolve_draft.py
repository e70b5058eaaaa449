"""A plan drafting with a model, resolved as kvasird start and plan check resolve it: the
draft model found from the plan's folder and written back absolute for the workers;
one with another vocabulary, or none there, refused naming the key."""

from __future__ import annotations

import pytest

from kvasir.daemon.resolve import resolve_plan
from kvasir.errors import PlanError
from tests.support.daemon import write_plan
from tests.support.models import save_tiny_model


def plan_with(tmp_path, tiny_models, draft: str):
    spec = f'method = "draft"\ndraft_model = "{draft}"'
    return write_plan(tmp_path / "plan.toml", tiny_models["llama"], [(0, 3), (3, 6)], speculative=spec)


def test_a_relative_draft_model_is_found_from_the_plans_folder(tmp_path, tiny_models):
    save_tiny_model(tmp_path / "drafts" / "small", "llama", num_layers=2, seed=3)
    plan, _ = resolve_plan(plan_with(tmp_path, tiny_models, "drafts/small"))
    assert plan.speculative.draft_model == str((tmp_path / "drafts" / "small").resolve())


def test_a_draft_model_of_another_vocabulary_or_nowhere_is_refused(tmp_path, tiny_models):
    save_tiny_model(tmp_path / "other", "llama", num_layers=2, vocab_size=100)
    with pytest.raises(
        PlanError, match=r"speculative.draft_model 'other' has a vocabulary of 100 tokens, the model 320"
    ):
        resolve_plan(plan_with(tmp_path, tiny_models, "other"))
    with pytest.raises(PlanError, match="speculative.draft_model: model.source 'missing' is neither"):
        resolve_plan(plan_with(tmp_path, tiny_models, "missing"))
