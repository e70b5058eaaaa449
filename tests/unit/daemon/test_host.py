"""A plan checked against this host: the CPUs and CUDA devices its stages and expert
shards name must exist here."""

from __future__ import annotations

import pytest

from kvasir.config.plan import parse_plan
from kvasir.daemon.host import check_host
from kvasir.errors import PlanError

SHARDED = """
[[stages]]
layers = [0, 3]
[[stages.experts]]
experts = [0, 3]
[[stages.experts]]
experts = [3, 8]
KEY
[[stages]]
layers = [3, 6]
"""


def test_a_plan_within_this_host_passes():
    check_host(parse_plan(SHARDED.replace("KEY", "cpus = [0]")))


@pytest.mark.parametrize(
    "key, expected",
    [
        ("cpus = [4095]", "stages[0].experts[1].cpus: CPUs [4095] are not available here"),
        ('device = "cuda:7"', "stages[0].experts[1].device = 'cuda:7' but"),
    ],
)
def test_an_expert_shard_this_host_cannot_run_is_named(key, expected):
    with pytest.raises(PlanError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        check_host(parse_plan(SHARDED.replace("KEY", key)))
