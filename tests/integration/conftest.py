"""Fixtures of the integration tests: the HTTP front's shared daemon, and the tests whose
hosts are network namespaces (tests/support/cluster.py)."""

from __future__ import annotations

import sys

import pytest

from kvasir.bench.netns import Network
from tests.support.cluster import HostedDaemon
from tests.support.http import http_serving


@pytest.fixture(scope="session")
def http_daemon(tiny_models, tmp_path_factory):
    """The Llama with a tokenizer behind two front processes and a bearer key, for the
    HTTP tests that leave it serving (each counts from what its metrics already hold)."""
    with http_serving(tmp_path_factory.mktemp("http"), tiny_models["llama-tokenizer"]) as daemon:
        yield daemon


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
