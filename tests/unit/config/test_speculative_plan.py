"""The plan's [speculative] section: what it refuses, naming the key, and what it keeps."""

from __future__ import annotations

import pytest

from kvasir.config.plan import parse_plan, plan_toml
from kvasir.errors import PlanError

STAGES = "[[stages]]\nlayers = [0, 10]\n[[stages]]\nlayers = [10, 30]\n"


def plan(section: str):
    return parse_plan(f"[speculative]\n{section}\n{STAGES}")


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ("", "speculative.method: required key is missing"),
        ('method = "eagle"', "speculative.method"),
        ('method = "ngram"\nnum_tokens = 0', r"speculative.num_tokens must be in 1..16"),
        ('method = "ngram"\nnum_tokens = 17', r"speculative.num_tokens must be in 1..16"),
        ('method = "ngram"\nngram_min = 3\nngram_max = 2', "ngram_min"),
        ('method = "ngram"\nngram_min = 0', "ngram_min"),
        ('method = "ngram"\nngram_max = 17', "ngram_max"),
        ('method = "ngram"\nmax_rows = 0', "speculative.max_rows must be >= 1"),
        ('method = "ngram"\nmin_acceptance = 1.5', r"speculative.min_acceptance must be in \[0, 1\]"),
        ('method = "ngram"\nmin_acceptance = nan', "speculative.min_acceptance"),
        ('method = "ngram"\ndraft_model = "smollm2-135m"', 'goes with method = "draft" only'),
        ('method = "draft"', "needs speculative.draft_model"),
        ('method = "draft"\ndraft_model = " "', "speculative.draft_model must name a model"),
        ('method = "ngram"\nlookahead = 3', "speculative.lookahead: unknown key"),
    ],
)
def test_refusals_name_the_key(section, says):
    with pytest.raises(PlanError, match=says):
        plan(section)


def test_defaults_and_the_round_trip_through_toml():
    parsed = plan('method = "ngram"')
    spec = parsed.speculative
    assert (spec.num_tokens, spec.ngram_min, spec.ngram_max, spec.max_rows) == (4, 2, 4, 8)
    assert parse_plan(plan_toml(parsed)) == parsed
    assert parse_plan(STAGES).speculative is None  # no section: no drafts
