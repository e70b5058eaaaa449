"""Several hosts in a plan: ``[cluster]``, ``[hosts.NAME]`` and ``host`` on stages and
expert shards (kvasir/config/cluster.py), the host keys (kvasir/daemon/resolve.py), what
``kvasir plan check`` shows and what ``kvasird start`` refuses in this version."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvasir.cli.kvasird import kvasird
from kvasir.cli.main import kvasir
from kvasir.config.cluster import DEFAULT_PORT, worker_host
from kvasir.config.plan import parse_plan, plan_toml
from tests.support.plans import CLUSTER_STAGES, cluster_hosts, refused

HOSTS = cluster_hosts()
STAGES = CLUSTER_STAGES


def test_hosts_read_back_and_place_every_worker():
    plan = parse_plan(HOSTS + STAGES)
    assert parse_plan(plan_toml(plan)) == plan
    assert plan.hosts["a"].port == DEFAULT_PORT and plan.hosts["b"].port == 7400
    head, tail = plan.stages
    assert worker_host(plan.cluster, head.host) == "a"  # a stage's default: the leader
    assert worker_host(plan.cluster, tail.host) == "b"
    assert [worker_host(plan.cluster, s.host, head.host) for s in head.experts] == ["b", "a"]  # a shard's: its stage's
    assert worker_host(parse_plan(STAGES.replace('host = "b"\n', "")).cluster, None) is None  # one machine


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda t: t.replace(HOSTS, ""), "stages[0].experts[0].host = 'b' is not a host of the plan (the plan has no"),
        (lambda t: t.replace('leader = "a"\nkeys = "keys"\n', 'leader = "a"\n'), "cluster.keys is missing"),
        (lambda t: t.replace('[cluster]\nleader = "a"\nkeys = "keys"\n', ""), "hosts: a plan with [hosts.NAME]"),
        (lambda t: t.replace('leader = "a"', 'leader = "c"'), "cluster.leader = 'c' is not one of the hosts (a, b)"),
        (lambda t: t.replace('address = "10.0.0.2"', 'address = "10.0.0.1"'), "hosts.b.address = '10.0.0.1' is"),
        (lambda t: t.replace('address = "10.0.0.2"', 'address = "not an address!"'), "neither an IP address nor"),
        (lambda t: t.replace("port = 7400", "port = 70000"), "hosts.b.port = 70000 is not a TCP port"),
        (lambda t: t.replace("[hosts.b]", "[hosts.\"b/c\"]").replace('"b"', '"b/c"'), "a host name is 1-63 letters"),
        (lambda t: t.replace('layers = [3, 6]\nhost = "b"', 'layers = [3, 6]\nhost = "c"'), "stages[1].host = 'c'"),
        (lambda t: t.replace("[[stages.experts]]\nexperts = [4, 8]", '[[stages.experts]]\nexperts = [4, 8]\nhost = "x"'),
         "stages[0].experts[1].host = 'x' is not a host of the plan (the plan's hosts are a, b)"),
        (lambda t: t.replace("layers = [0, 3]\n", 'layers = [0, 3]\nedge = "shm"\n'),
         "stages[0].edge = 'shm': the edge goes from host a to host b, and only tcp crosses hosts"),
        (lambda t: t.replace("address", "adress", 1), "hosts[...].adress: unknown key"),
        (lambda t: t.replace('keys = "keys"\n', 'keys = "keys"\nhost_silence_s = 0.5\n'),
         "cluster.host_silence_s = 0.5: at least 1 s"),
        (lambda t: t.replace('keys = "keys"\n', 'keys = "keys"\nhost_silence_s = nan\n'),
         "cluster.host_silence_s = nan"),
    ],
)  # fmt: skip
def test_bad_clusters_are_refused_naming_the_key(change, expected):
    assert expected in refused(change(HOSTS + STAGES))


def test_a_cluster_without_hosts_and_pool_stages_with_hosts():
    assert "cluster: the plan names no hosts" in refused('[cluster]\nleader = "a"\nkeys = "k"\n' + STAGES)
    pools = HOSTS + "".join(
        f'[[{pool}.stages]]\nlayers = [0, 3]\nhost = "{host}"\n[[{pool}.stages]]\nlayers = [3, 6]\nhost = "{host}"\n'
        for pool, host in (("prefill", "a"), ("decode", "b"))
    )
    assert parse_plan(pools).decode.stages[0].host == "b"
    assert "decode.stages[1].host = 'z'" in refused(
        pools.replace('layers = [3, 6]\nhost = "b"', 'layers = [3, 6]\nhost = "z"')
    )


@pytest.fixture
def cluster_plan(tmp_path, tiny_models):
    def write(keys: bool = True):
        if keys:
            made = CliRunner().invoke(
                kvasir, ["keys", "generate", str(tmp_path / "keys"), "--host", "a", "--host", "b"]
            )
            assert made.exit_code == 0, made.output
        path = tmp_path / "plan.toml"
        model = f'[model]\nsource = "{tiny_models["mixtral"]}"\nmax_seq_len = 256\n[kv]\nnum_blocks = 64\n'
        path.write_text(model + HOSTS + STAGES)
        return path

    return write


def test_plan_check_shows_hosts_and_tcp_where_workers_are_on_two_hosts(cluster_plan, tmp_path):
    path = cluster_plan()
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"cluster  leader a; keys {tmp_path / 'keys'}" in lines
    # a: control, hosts, the bridge's two, stage 0's five, shard 1's two; b: stage 1's five, shard 0's two
    assert "  host a  10.0.0.1: ports 7300-7310 (TCP, CURVE)" in lines
    assert "  host b  10.0.0.2: ports 7400-7406 (TCP, CURVE)" in lines
    assert "edge     0 -> 1: tcp (stages on hosts a and b)" in lines
    stage_rows = [line.split() for line in lines if line[:2] in ("0 ", "1 ") and ("head" in line or "tail" in line)]
    assert [row[-1] for row in stage_rows] == ["a", "b"] and stage_rows[1][-2] == "tcp"
    body = json.loads(CliRunner().invoke(kvasir, ["plan", "check", "--json", str(path)]).output)
    assert [(s["host"], s["edge"]) for s in body["stages"]] == [("a", ""), ("b", "tcp")]
    assert [(s["host"], s["dispatch_kind"]) for s in body["shards"]] == [("b", "tcp"), ("a", "shm")]
    assert body["plan"]["cluster"] == {"leader": "a", "keys": str(tmp_path / "keys"), "host_silence_s": 5.0}


def test_missing_host_keys_are_named(cluster_plan, tmp_path):
    path = cluster_plan(keys=False)
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 2 and f"cluster.keys: host key folder not found: {tmp_path / 'keys'}" in result.output
    cluster_plan()
    (tmp_path / "keys" / "b.key").unlink()
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 2 and "cluster.keys: host b: key file not found" in result.output


def test_a_kv_pool_across_hosts_needs_the_fleets_pool_secret(cluster_plan, tmp_path):
    path = cluster_plan()
    path.write_text(path.read_text().replace("[kv]\n", "[kv_pool]\nhost_bytes = 1048576\n[kv]\n", 1))
    (tmp_path / "keys" / "kvpool.secret").unlink()
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 2, result.output
    assert "cluster.keys: [kv_pool] across hosts needs the fleet's pool secret" in result.output
    assert "--pool-secret" in result.output


def test_kvasird_refuses_a_secret_key_that_is_not_its_hosts(cluster_plan, tmp_path):
    path = cluster_plan()
    keys = tmp_path / "keys"
    for command, key, host in ((["start"], "b", "a"), (["join", "--host", "b"], "a", "b")):
        result = CliRunner().invoke(
            kvasird,
            [
                *command,
                "--plan",
                str(path),
                "--runtime-dir",
                str(tmp_path / "rt"),
                "--key",
                str(keys / f"{key}.key_secret"),
            ],
        )
        assert result.exit_code == 2, result.output
        assert f"host {host}'s secret key does not match {keys / (host + '.key')}" in result.output
        assert not (tmp_path / "rt").exists()  # refused before anything was made


def test_kvasird_join_refuses_a_host_the_plan_does_not_name_and_the_leader(cluster_plan, tmp_path):
    path = cluster_plan()
    result = CliRunner().invoke(kvasird, ["join", "--plan", str(path), "--host", "z"])
    assert result.exit_code == 2 and "host 'z' is not one of the plan's [hosts] (a, b)" in result.output
    result = CliRunner().invoke(kvasird, ["join", "--plan", str(path), "--host", "a"])
    assert result.exit_code == 2 and "host a is the plan's leader: run `kvasird start" in result.output


FLEET_ON_HOSTS = """
[[instances]]
name = "x"
[[instances.stages]]
layers = [0, 2]
[[instances.stages]]
layers = [2, 6]
[[instances]]
name = "y"
[[instances.stages]]
layers = [0, 3]
[[instances.stages]]
layers = [3, 6]
host = "b"
"""


def test_standby_hosts_park_their_instances_and_a_pool_keeps_one_that_starts_with_the_leader():
    from kvasir.config.cluster import standby_instances

    standby = HOSTS.replace("port = 7400\n", "port = 7400\nstandby = true\n")
    plan = parse_plan(standby + FLEET_ON_HOSTS)
    assert plan.hosts["b"].standby and not plan.hosts["a"].standby
    assert standby_instances(plan) == ["y"] and parse_plan(plan_toml(plan)) == plan
    assert standby_instances(parse_plan(HOSTS + FLEET_ON_HOSTS)) == []
    assert "hosts.a.standby: the leader cannot be a standby host" in refused(
        HOSTS.replace('address = "10.0.0.1"\n', 'address = "10.0.0.1"\nstandby = true\n') + FLEET_ON_HOSTS
    )
    alone = FLEET_ON_HOSTS.replace("layers = [2, 6]\n", 'layers = [2, 6]\nhost = "b"\n')
    assert "every instance of the fleet has a worker on a standby host (x, y)" in refused(standby + alone)


def test_plan_check_says_which_hosts_are_standby(cluster_plan):
    path = cluster_plan()
    path.write_text(path.read_text().replace(HOSTS, HOSTS.replace("port = 7400\n", "port = 7400\nstandby = true\n")))
    path.write_text(path.read_text().replace(STAGES, FLEET_ON_HOSTS))
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output
    hosts = [line for line in result.output.splitlines() if line.startswith("  host ")]
    assert hosts[1].startswith("  host b  10.0.0.2: ports") and hosts[1].endswith(
        "; standby: its instances serve once it joins"
    )
    assert not hosts[0].endswith("joins")
