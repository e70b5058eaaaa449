"""An emulated cluster on one machine, for benchmarks: each host a network namespace
(kvasir/bench/netns.py) with a CPU budget of its own, so a fleet of, say, four
half-core hosts behaves like four small machines instead of processes borrowing each
other's cores.

A budget is a cgroup (v1 ``cpu`` controller) whose CFS quota is the host's cores times
the period: every process started on the host (``EmulatedCluster.run``) joins it before
it runs anything, and its children stay in it. The links between hosts can be shaped
with ``tc tbf`` (``EmulatedCluster.shape``). ``close`` stops whatever still runs there,
removes the cgroups and deletes the namespaces.

Needs root, iproute2 and a cgroup v1 ``cpu`` hierarchy: ``cluster_unavailable()`` says
why not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvasir.bench.netns import Network, netns_unavailable
from kvasir.errors import KvasirError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
ACCT_ROOT = Path("/sys/fs/cgroup/cpuacct")  # where the CPU time each host used is counted (if mounted apart)
PERIOD_US = 100_000
# sh: join the budget's cgroup ($0) and the accounting one ($1), then become the command
JOIN = 'echo $$ > "$0" && echo $$ > "$1" && shift && exec "$@"'


class ClusterError(KvasirError):
    """A host's budget that cannot be made or a host that is not part of the cluster."""


def cluster_unavailable() -> str | None:
    """Why an emulated cluster cannot be made here (None: it can)."""
    why = netns_unavailable()
    if why is not None:
        return why
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu hierarchy at {CPU_ROOT} (CPU budgets need it)"
    return None


@dataclass
class CpuBudget:
    """One host's cgroup: at most ``cores`` CPUs' worth of time, however many it has."""

    name: str
    cores: float

    @property
    def path(self) -> Path:
        return CPU_ROOT / self.name

    @property
    def accounting(self) -> Path:
        """The cgroup counting its CPU time: the budget's own where ``cpuacct`` is mounted with ``cpu``."""
        if (self.path / "cpuacct.usage").exists() or not (ACCT_ROOT / "cpuacct.usage").exists():
            return self.path
        return ACCT_ROOT / self.name

    def make(self) -> None:
        if not 0.01 <= self.cores <= os.cpu_count():  # type: ignore[operator]
            raise ClusterError(f"a host's budget is 0.01 to {os.cpu_count()} cores, not {self.cores:g}")
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(round(self.cores * PERIOD_US)))
        self.accounting.mkdir(exist_ok=True)

    def wrap(self, command: list[str]) -> list[str]:
        """``command``, started inside the budget (before it runs anything)."""
        return ["sh", "-c", JOIN, str(self.path / "cgroup.procs"), str(self.accounting / "cgroup.procs"), *command]

    def used_s(self) -> float:
        """Seconds of CPU its processes used so far (0 where no ``cpuacct`` counts them)."""
        try:
            return int((self.accounting / "cpuacct.usage").read_text()) / 1e9
        except FileNotFoundError:
            return 0.0

    def pids(self) -> list[int]:
        try:
            return [int(line) for line in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def throttled(self) -> float:
        """The share of scheduler periods in which it used up its quota (and was held back):
        near 1, the host is bound by its budget."""
        fields = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip())
        periods = int(fields.get("nr_periods", 0))
        return int(fields.get("nr_throttled", 0)) / periods if periods else 0.0

    def remove(self) -> None:
        """Kill what still runs in it and remove it."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for path in {self.path, self.accounting}:
            try:
                path.rmdir()
            except FileNotFoundError:
                pass


def machine_busy_s() -> float:
    """Seconds of CPU the whole machine spent on anything but idling (``/proc/stat``)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user .. steal (guest time is in user)


@dataclass(frozen=True)
class Usage:
    """CPU seconds used so far by each host (``hosts``) and by the whole machine, at ``at``."""

    at: float
    hosts: dict[str, float]
    machine: float

    def cores(self, before: Usage) -> tuple[dict[str, float], float]:
        """The cores each host and the machine used on average from ``before`` to this one."""
        wall = max(self.at - before.at, 1e-9)
        hosts = {name: (used - before.hosts.get(name, 0.0)) / wall for name, used in self.hosts.items()}
        return hosts, (self.machine - before.machine) / wall


@dataclass
class EmulatedCluster:
    """Hosts by name with their cores; ``link`` shapes every host's outgoing link (e.g. "1gbit")."""

    cores: Mapping[str, float]
    link: str | None = None
    network: Network = field(init=False)
    budgets: dict[str, CpuBudget] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        why = cluster_unavailable()
        if why is not None:
            raise ClusterError(why)
        self.network = Network(list(self.cores))
        try:
            for name, cores in self.cores.items():
                budget = CpuBudget(f"{self.network.namespace(name)}", cores)
                budget.make()
                self.budgets[name] = budget
                if self.link is not None:
                    self.network.shape(name, self.link)
        except BaseException:
            self.close()
            raise

    def address(self, name: str) -> str:
        return self.network.address(name)

    def run(self, name: str, command: list[str], **kwargs) -> subprocess.Popen:
        """Start ``command`` on host ``name``: within its CPU budget (joined first: ``ip
        netns exec`` mounts the namespace's own /sys, without the cgroups), in its namespace."""
        if name not in self.budgets:
            raise ClusterError(f"{name!r} is not a host of the cluster ({', '.join(self.budgets)})")
        inside = ["ip", "netns", "exec", self.network.namespace(name), *(str(part) for part in command)]
        return subprocess.Popen(self.budgets[name].wrap(inside), **kwargs)

    def throttled(self) -> dict[str, float]:
        """Each host's share of periods held back by its budget so far."""
        return {name: budget.throttled() for name, budget in self.budgets.items()}

    def usage(self) -> Usage:
        """The CPU time each host and the whole machine used so far: two of them make ``cores``."""
        return Usage(time.monotonic(), {name: b.used_s() for name, b in self.budgets.items()}, machine_busy_s())

    def close(self) -> None:
        for budget in self.budgets.values():
            budget.remove()
        self.budgets.clear()
        self.network.close()
