from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon import Daemon, stage_count, write_plan  # noqa: E402


@pytest.fixture
def start_daemon(tmp_path):
    """Start kvasird processes on tiny models; every one is stopped after the test."""
    started: list[Daemon] = []

    def start(source, splits, name="rt", drain_timeout=30.0, **plan_values) -> Daemon:
        plan = write_plan(tmp_path / f"{name}.toml", source, splits, **plan_values)
        daemon = Daemon(plan, tmp_path / name, stage_count(splits), drain_timeout)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
