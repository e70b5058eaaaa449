"""The emulated cluster the fleet benchmarks run on (kvasir/bench/cluster.py): each host a
namespace with a CPU budget its processes cannot leave, all of it gone after close.
Skipped where namespaces or cgroup v1 budgets cannot be made."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvasir.bench.cluster import CPU_ROOT, ClusterError, EmulatedCluster, cluster_unavailable

pytestmark = pytest.mark.skipif(cluster_unavailable() is not None, reason=str(cluster_unavailable()))


def cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise AssertionError(f"process {pid} is in no cpu cgroup")


def test_each_host_runs_in_its_namespace_within_its_budget_and_close_removes_it_all():
    cluster = EmulatedCluster({"a": 0.25, "b": 1.5})
    made = [budget.path for budget in cluster.budgets.values()]
    namespaces = list(cluster.network.made)
    try:
        assert (made[0] / "cpu.cfs_quota_us").read_text().strip() == "25000"
        assert (made[1] / "cpu.cfs_quota_us").read_text().strip() == "150000"
        sleeper = cluster.run("a", ["sleep", "60"])
        child = cluster.run("b", ["sh", "-c", "sleep 60 & wait"])
        for _ in range(50):
            if len(cluster.budgets["b"].pids()) == 2:
                break
            subprocess.run(["sleep", "0.1"])
        assert cgroup_of(sleeper.pid) == "/" + made[0].name
        assert sorted(cluster.budgets["b"].pids())[0] == child.pid and len(cluster.budgets["b"].pids()) == 2
        shown = subprocess.run(
            ["ip", "netns", "exec", cluster.network.namespace("a"), "ip", "-brief", "addr"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert cluster.address("a") in shown.stdout
        before = cluster.usage()
        busy = cluster.run("a", ["sh", "-c", "while :; do :; done"])
        for _ in range(50):
            if cluster.throttled()["a"] > 0.5:
                break
            subprocess.run(["sleep", "0.1"])
        subprocess.run(["sleep", "1.5"])  # a window of many 0.1 s budget periods: one period's slack is small
        busy.kill()
        assert cluster.throttled()["a"] > 0.5 and cluster.throttled()["b"] == 0.0  # a quarter core: held back
        hosts, machine = cluster.usage().cores(before)
        assert 0 < hosts["a"] <= 0.25 * 1.5 and hosts["b"] < hosts["a"]  # counted, and within its budget
        assert machine >= hosts["a"] * 0.9
        with pytest.raises(ClusterError, match="'c' is not a host"):
            cluster.run("c", ["true"])
    finally:
        cluster.close()
    assert sleeper.wait(10) != 0 and child.wait(10) != 0  # killed with their hosts
    assert not any(path.exists() for path in made)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)


def test_a_budget_beyond_the_machine_is_refused_and_nothing_is_left():
    before = {path.name for path in CPU_ROOT.iterdir()}
    with pytest.raises(ClusterError, match="a host's budget is 0.01 to"):
        EmulatedCluster({"a": 0.5, "b": 1000.0})
    assert {path.name for path in CPU_ROOT.iterdir()} == before
