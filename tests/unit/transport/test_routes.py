"""Where the internal sockets are when a plan's workers span hosts (kvasir/transport/routes.py)."""

from __future__ import annotations

import pytest

from kvasir.config.plan import parse_plan
from kvasir.transport.channels import Endpoints
from kvasir.transport.routes import Placement, RouteError, Routes, socket_names
from tests.support.plans import CLUSTER_STAGES, cluster_hosts

HOSTS = cluster_hosts(b_address="fd00::2", b_port=9000)
STAGES = CLUSTER_STAGES


def test_a_plan_on_one_machine_keeps_ipc_files(tmp_path):
    for text in (STAGES.replace('host = "b"\n', ""), HOSTS + STAGES.replace('host = "b"\n', "")):
        placement = Placement.of(parse_plan(text))
        assert not placement.spans_hosts
        with pytest.raises(RouteError, match="runs on one machine"):
            Routes.of(placement)
    ends = Endpoints(tmp_path)
    assert ends.stage_in(1) == f"ipc://{tmp_path}/stage-1.sock" and ends.control == f"ipc://{tmp_path}/control.sock"


def test_every_internal_socket_is_tcp_on_its_owners_host(tmp_path):
    placement = Placement.of(parse_plan(HOSTS + STAGES))
    assert placement.spans_hosts and placement.stages == ("a", "b") and placement.shards == ("b", "a")
    routes = Routes.of(placement)
    ends = Endpoints(tmp_path, routes)
    owners = {
        ends.control: "a", ends.bridge_in: "a", ends.command("bridge"): "a",
        ends.stage_in(0): "a", ends.credits(0): "a", ends.experts_out(0): "a", ends.command("stage-0"): "a",
        ends.stage_in(1): "b", ends.kv_in(1): "b", ends.command("stage-1"): "b",
        ends.shard_in(0): "b", ends.command("shard-0"): "b", ends.shard_in(1): "a",
    }  # fmt: skip
    for url, host in owners.items():
        assert url.startswith("tcp://10.0.0.1:" if host == "a" else "tcp://[fd00::2]:"), url
    names = socket_names(placement)
    assert len(names) == len({url for url in map(routes.endpoint, (n for n, _ in names))})  # no two alike
    assert routes.ports("a") == list(range(7300, 7300 + sum(h == "a" for _, h in names)))  # consecutive from port
    assert routes.ports("b") == list(range(9000, 9000 + sum(h == "b" for _, h in names)))
    assert Routes.of(Placement.of(parse_plan(HOSTS + STAGES))).ports("b") == routes.ports("b")  # every host agrees
    assert ends.client == f"ipc://{tmp_path}/client.sock" and ends.bridge_files() == [
        tmp_path / "client.sock",
        tmp_path / "events.sock",
    ]
    with pytest.raises(RouteError, match="no worker of the plan owns a socket called 'stage-7'"):
        ends.stage_in(7)


def test_a_port_range_past_65535_is_refused():
    plan = parse_plan(cluster_hosts(b_address="fd00::2", b_port=65530) + STAGES)
    with pytest.raises(RouteError, match=r"hosts.b.port = 65530: its sockets need ports up to 65536"):
        Routes.of(Placement.of(plan))
