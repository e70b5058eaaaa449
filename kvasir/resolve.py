"""A plan file made ready to serve: the plan and its model source, checked together."""

from __future__ import annotations

from pathlib import Path

from kvasir.errors import ModelSourceError, PlanError
from kvasir.model.source import ModelSource, resolve_source
from kvasir.plan import Plan, check_model_fit, load_plan


def resolve_plan(path: str | Path) -> tuple[Plan, ModelSource]:
    """Load a plan, resolve its model (relative paths from the plan's folder), check the fit."""
    path = Path(path)
    plan = load_plan(path)
    try:
        source = resolve_source(plan.model.source, base_dir=path.parent.resolve())
        check_model_fit(plan, source.num_layers, source.max_positions)
    except (PlanError, ModelSourceError) as exc:
        raise PlanError(f"{path}: {exc}") from None
    return plan, source
