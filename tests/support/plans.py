"""Plan texts and checks the plan tests share."""

from __future__ import annotations

import pytest

from kvasir.config.plan import parse_plan
from kvasir.errors import PlanError


def refused(text: str) -> str:
    """The one-line PlanError a plan text is refused with."""
    with pytest.raises(PlanError) as info:
        parse_plan(text)
    message = str(info.value)
    assert "\n" not in message
    return message


def cluster_hosts(b_address: str = "10.0.0.2", b_port: int = 7400) -> str:
    """[cluster] with leader a and keys/, hosts a (10.0.0.1, default port) and b."""
    return f"""
[cluster]
leader = "a"
keys = "keys"
[hosts.a]
address = "10.0.0.1"
[hosts.b]
address = "{b_address}"
port = {b_port}
"""


# stage 0 on the leader with a shard on b and one on a (its stage's host); stage 1 on b
CLUSTER_STAGES = """
[[stages]]
layers = [0, 3]
[[stages.experts]]
experts = [0, 4]
host = "b"
[[stages.experts]]
experts = [4, 8]
[[stages]]
layers = [3, 6]
host = "b"
"""
