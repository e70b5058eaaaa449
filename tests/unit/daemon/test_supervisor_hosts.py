"""The supervisor with standby and drained hosts: an instance on one is "parked" (no
children, nothing routed) while the host is away, joins without a restart of the others
once it is there, parks again when its host is drained, and a failure of the others
leaves it parked."""

from __future__ import annotations

from kvasir.daemon.supervision import Heartbeats, RestartPolicy
from kvasir.daemon.supervisor import EVERY, Instance, RingSupervisor
from kvasir.logs import setup_logging
from tests.unit.daemon.test_supervisor import OTHER, RING, Hosts, Recorder, failure, ready


def standby_fleet(plumbing: Recorder, domains: bool = False) -> RingSupervisor:
    """Instance a on the leader, b on host s (standby: parked at start, as the launcher makes it)."""
    policy = RestartPolicy(3, window_s=60.0, backoff_s=1.0)
    a = Instance("a", "", list(RING), policy)
    b = Instance("b", "", list(OTHER), RestartPolicy(3, window_s=60.0, backoff_s=1.0), frozenset({"s"}), state="parked")
    ring = RingSupervisor([a, b], Heartbeats(timeout_s=2.0), plumbing, ready_s=30.0, log=setup_logging("critical"))
    if domains:
        ring.domains = {"a": ("a", "b"), "b": ("a", "b")}
    ring.spawn_missing()
    ready(ring, 0.0)
    ring.open(deadline=30.0)
    return ring


def joined(ring: RingSupervisor) -> RingSupervisor:
    """b's host is there: it joins and serves."""
    ring.step(1.0)
    ready(ring, 2.0)
    ring.step(2.0)
    return ring


def test_a_standby_instance_waits_parked_then_joins_without_restarting_the_others():
    hosts = Hosts(away={"s"})
    plumbing = Recorder(hosts=hosts)
    ring = standby_fleet(plumbing)
    assert [c.id.instance for c in ring.children if c.id.role != "bridge"] == ["a", "a", "a"]
    assert [i.state for i in ring.instances] == ["up", "parked"] and plumbing.opened == [(EVERY, 0, True)]
    assert ring.settled and ring.step(5.0) and ring.instance("b").children == []
    hosts.away = set()  # its kvasird join is there
    assert not ring.settled and ring.step(6.0)
    assert ring.instance("b").state == "joining" and plumbing.spawned[-1] == OTHER
    ready(ring, 7.0)
    assert ring.step(7.0) and ring.instance("b").state == "up"
    assert plumbing.opened[-1] == ("b", 0, False) and ring.instance("b").restarts == 0  # a join is no restart
    assert plumbing.killed == [] and ring.settled  # a was never touched


def test_a_drained_host_parks_its_instance_until_it_joins_again():
    hosts = Hosts()
    plumbing = Recorder(hosts=hosts)
    ring = joined(standby_fleet(plumbing))
    assert ring.instance("b").state == "up"
    hosts.away = {"s"}  # kvasir hosts drain s: the launcher drains the host, then parks b
    ring.park("b")
    assert ring.instance("b").state == "parked" and plumbing.parks == ["b"]
    assert plumbing.killed == ["stage-2", "stage-3"] and ring.instance("b").children == []
    assert ring.settled and ring.step(50.0) and ring.instance("b").state == "parked"
    ring.park("b")  # a second word for it, and one for no instance, change nothing
    ring.park("zz")
    assert plumbing.parks == ["b"] and ring.instance("a").state == "up"
    hosts.away = set()  # a new kvasird join there
    assert ring.step(60.0) and ring.instance("b").state == "joining"


def test_a_lost_standby_host_parks_its_instance_after_the_back_off():
    hosts = Hosts()
    plumbing = Recorder(hosts=hosts)
    ring = joined(standby_fleet(plumbing))
    hosts.lost, hosts.away = "host s is missing", {"s"}
    ring.instance("b").children[0].process.returncode = -9  # the link marks its workers lost
    found = failure(ring, 3.0)
    assert found.instances == ("b",) and ring.failed(found, 3.0, serving=True)
    assert ring.instance("b").state == "down"
    assert ring.step(10.0) and ring.instance("b").state == "parked" and plumbing.parks == ["b"]
    assert ring.instance("a").state == "up"


def test_a_failure_of_its_domain_leaves_a_parked_instance_parked():
    hosts = Hosts(away={"s"})
    plumbing = Recorder(hosts=hosts)
    ring = standby_fleet(plumbing, domains=True)
    ring.instance("a").children[0].process.returncode = 1
    found = failure(ring, 3.0)
    assert found.instances == ("a", "b") and ring.failed(found, 3.0, serving=True)
    assert [i.state for i in ring.instances] == ["down", "parked"]
    assert [d[0] for d in plumbing.downs] == ["a"]
    ring.step(10.0)
    assert ring.instance("a").state == "starting" and plumbing.spawned[-1] == RING
