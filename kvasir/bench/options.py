"""What every ``kvasir bench`` mode shares: where it runs and reports (``Target``) and the
latency targets a run is judged by (``Slo``); the workload is kvasir/bench/workload.py's."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvasir.transport.channels import default_runtime_dir


@dataclass(frozen=True)
class Target:
    """The daemon a mode drives, a private one started from ``plan`` for the run or the one
    at ``runtime_dir`` (default as for every command), and whether it prints JSON."""

    plan: Path | None = None
    runtime_dir: Path | None = None
    as_json: bool = False

    def say(self, line: str) -> None:
        """A progress line on stderr (none with JSON: the output is one object)."""
        if not self.as_json:
            print(line, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def daemon(self) -> Iterator[Path]:
        """The runtime dir to drive: a daemon started from the plan (stopped on the way out), or the given one."""
        if self.plan is None:
            yield self.runtime_dir or default_runtime_dir()
            return
        from kvasir.bench.daemon import ManagedDaemon
        from kvasir.config.plan import load_plan

        stages = len(load_plan(self.plan).all_stages)
        with tempfile.TemporaryDirectory(prefix="kvasir-bench-") as tmp:
            with ManagedDaemon(self.plan, Path(tmp), stages) as daemon:
                yield daemon.runtime_dir


@dataclass(frozen=True)
class Slo:
    """Latency targets: time to first token and per output token, and the share of
    requests that must meet both for a rate to count as goodput."""

    ttft_s: float
    tpot_s: float
    attain: float = 0.9

    @property
    def targets(self) -> tuple[float, float]:
        return self.ttft_s, self.tpot_s

    def report(self) -> dict:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "attain": self.attain}
