"""Fixtures of the tests whose hosts are network namespaces (tests/support/cluster.py)."""

from __future__ import annotations

import sys

import pytest

from kvasir.bench.netns import Network
from tests.support.cluster import HostedDaemon


@pytest.fixture
def network():
    net = Network(["a", "b", "c"])
    yield net
    net.close()


@pytest.fixture
def hosted(network, tmp_path, request):
    """Start a leader and its followers; each host's log is printed when the test failed."""
    started: list[HostedDaemon] = []

    def start(plan_text: str, stages: int, later: tuple = ()) -> HostedDaemon:
        daemon = HostedDaemon(network, tmp_path, plan_text, stages, later=later)
        started.append(daemon)
        return daemon

    yield start
    report = getattr(request.node, "report_call", None)
    for daemon in started:
        codes = daemon.stop()
        if report is not None and report.failed:
            print(daemon.log(), file=sys.stderr)
        assert all(code == 0 for code in codes.values()), (codes, daemon.log())
