"""Shared-memory names another process sends (a follower's leader) are checked against
Kvasir's own naming before anything is made or opened under them."""

from __future__ import annotations

import pytest

from kvasir.daemon.follower import segment_names
from kvasir.errors import KvasirError
from kvasir.ring.shm import check_segment_names, segment_prefix
from kvasir.wire.control import EdgeSpec, HostSegments
from kvasir.wire.hosts import Run
from tests.support.models import make_plan


def edge(name: str) -> EdgeSpec:
    return EdgeSpec(kind="shm", name=name, slots=2, max_tokens=8, hidden=16, dtype="float32")


def test_names_under_the_prefix_pass_and_every_other_is_refused():
    prefix = segment_prefix()
    check_segment_names(prefix, [f"{prefix}-edge3", f"{prefix}-kv0", f"{prefix}-experts12"])
    for name in (
        f"{prefix}-edge3/../../../etc/passwd",
        f"{prefix}/../x",
        "kvasir-1-deadbeef-edge0",  # another daemon's segment
        f"{prefix}-",
        f"{prefix}-EDGE0",
        "/dev/shm/x",
    ):
        with pytest.raises(KvasirError, match="segment name"):
            check_segment_names(prefix, [name])
    for bad in ("../../tmp/kvasir-1-deadbeef", "kvasir-1-deadbeef/..", "x"):
        with pytest.raises(KvasirError, match="segment prefix"):
            check_segment_names(bad, [])


def test_a_run_names_its_segments_and_those_its_workers_settings_name():
    from kvasir.wire.control import StageSettings

    prefix = segment_prefix()
    plan = make_plan("unused", [(0, 1), (1, 2)])
    worker = StageSettings(
        index=1, plan=plan, runtime_dir="/nonexistent", launcher_pid=1, edges=[edge("/etc/x")], first=0
    )
    run = Run(1, prefix, HostSegments(edges=[edge(f"{prefix}-edge0")]), [worker])
    names = segment_names(run)
    assert names == [f"{prefix}-edge0", "/etc/x"]
    with pytest.raises(KvasirError, match="'/etc/x'"):
        check_segment_names(run.prefix, names)
