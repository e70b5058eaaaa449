"""Hosts joining and leaving a running daemon (network namespaces, docs/planner.md): an
instance on a standby host is parked until its ``kvasird join`` comes, then serves without
a restart of the others; ``kvasir hosts drain`` under load parks it with every request
finished, its join can then stop with nothing failing, and a new join brings it back.
Skipped where namespaces cannot be made."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from kvasir.bench.daemon import stop_gracefully
from kvasir.bench.netns import netns_unavailable
from kvasir.client import AsyncClient, Client
from kvasir.wire.client import DrainStarted, Finished
from tests.integration.test_hosts_ring import MODEL, served_as_generate
from tests.integration.test_supervision import load_then, terminal_codes
from tests.support.cluster import hosts_table
from tests.support.daemon import BIN

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

FLEET = """
[route]
policy = "round_robin"
[[instances]]
name = "x"
[[instances.stages]]
layers = [0, 3]
[[instances.stages]]
layers = [3, 6]
[[instances]]
name = "y"
[[instances.stages]]
layers = [0, 2]
host = "c"
[[instances.stages]]
layers = [2, 6]
host = "c"
"""


def kvasir(daemon, *args: str) -> subprocess.CompletedProcess:
    command = [str(BIN / "kvasir"), *args, "--runtime-dir", str(daemon.runtime_dir)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def states(daemon) -> dict[str, tuple[str, int]]:
    with Client(daemon.runtime_dir) as client:
        return {i.name: (i.state, i.restarts) for i in client.stats().instances}


def until(daemon, wanted: dict, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while states(daemon) != wanted:
        assert time.monotonic() < deadline, (states(daemon), daemon.log())
        time.sleep(0.25)


async def drain_under_load(daemon, host: str, on: str, count: int) -> tuple[DrainStarted, list]:
    """Submit ``count`` requests, drain ``host`` once instance ``on`` runs some, and
    collect every request's terminal event."""
    async with await AsyncClient.connect(daemon.runtime_dir) as client:
        streams = [
            await client.submit(token_ids=[3 + i, 7, 9, 11], max_tokens=200, temperature=0, ignore_eos=True)
            for i in range(count)
        ]
        for _ in range(600):
            stats = await client.stats()
            if stats.tokens_out > 0 and any(i.name == on and i.requests > 0 for i in stats.instances):
                break
            await asyncio.sleep(0.02)
        started = await client.drain_host(host)
        return started, [await stream.result() for stream in streams]


def test_a_standby_host_joins_and_drains_under_load_with_nothing_lost(network, hosted, tiny_models):
    model = tiny_models["llama"]
    hosts = hosts_table(network, silence_s=2.0, standby=("c",))
    # b runs nothing: no kvasird join there (the leader does not wait for one)
    daemon = hosted(MODEL.format(model=model) + hosts + FLEET, 2, later=("b", "c")).wait_ready()
    assert states(daemon) == {"x": ("serving", 0), "y": ("parked", 0)}  # serving without c
    listed = json.loads(kvasir(daemon, "hosts", "--json").stdout)
    assert [(h["host"], h["state"]) for h in listed] == [("a", "serving"), ("c", "parked")]
    daemon.start("c")
    until(daemon, {"x": ("serving", 0), "y": ("serving", 0)})  # y joined; x never restarted
    finals = served_as_generate(daemon, model, [5, 17, 30, 9], 23, lambda i: 12)
    assert sorted(final.instances[0] for final in finals) == ["x", "x", "y", "y"]

    for host, why in [("a", "host a is the leader"), ("b", "no instance runs on host 'b'")]:
        refused = kvasir(daemon, "hosts", "drain", host)
        assert refused.returncode == 2 and why in refused.stderr, refused.stderr
    started, ends = asyncio.run(drain_under_load(daemon, "c", "y", 12))
    assert started.instances == ["y"] and started.requests > 0  # it waits for y's requests
    assert all(isinstance(end, Finished) for end in ends), ends  # which finished before y parked
    assert sorted({end.instances[0] for end in ends}) == ["x", "y"]
    until(daemon, {"x": ("serving", 0), "y": ("parked", 0)})
    listed = json.loads(kvasir(daemon, "hosts", "--json").stdout)
    assert [(h["host"], h["state"], h["instances"]) for h in listed] == [
        ("a", "serving", {"x": "serving"}),
        ("c", "parked", {"y": "parked"}),
    ]

    assert stop_gracefully(daemon.processes["c"], 60) == 0  # the drained host leaves: nothing fails
    time.sleep(4.0)  # past cluster.host_silence_s
    finals = served_as_generate(daemon, model, [7, 12], 29, lambda i: 8)
    assert [final.instances for final in finals] == [["x"], ["x"]]
    with Client(daemon.runtime_dir) as client:
        stats = client.stats()
    assert stats.state == "serving" and stats.hosts_missing == [] and stats.restarts == 0

    daemon.start("c")  # a new kvasird join there: y serves again
    until(daemon, {"x": ("serving", 0), "y": ("serving", 0)})
    finals = served_as_generate(daemon, model, [11, 4, 19, 8], 31, lambda i: 10)
    assert sorted(final.instances[0] for final in finals) == ["x", "x", "y", "y"]


def pools_on_hosts() -> str:
    """p0 (prefill) on the leader; decode d0 on b, d1 on c, each one stage per layer half."""
    text = '[[prefill.instances]]\nname = "p0"\n'
    text += "".join(f"[[prefill.instances.stages]]\nlayers = [{a}, {b}]\n" for a, b in [(0, 3), (3, 6)])
    for name, host in (("d0", "b"), ("d1", "c")):
        text += f'[[decode.instances]]\nname = "{name}"\n'
        text += "".join(
            f'[[decode.instances.stages]]\nlayers = [{a}, {b}]\nhost = "{host}"\n' for a, b in [(0, 2), (2, 6)]
        )
    return text


def test_a_decode_host_drains_under_load_and_the_last_decode_host_is_kept(network, hosted, tiny_models):
    """Disaggregated: d1's standby host joins; draining d0's (not standby) host under load
    finishes every request (its decode requests run to their end first); draining the last
    decode host is refused; b's join stops with nothing failing, and a new one brings d0 back."""
    model = tiny_models["llama"]
    plan = MODEL.format(model=model) + hosts_table(network, silence_s=2.0, standby=("c",)) + pools_on_hosts()
    daemon = hosted(plan, 4, later=("c",)).wait_ready()
    assert states(daemon) == {"p0": ("serving", 0), "d0": ("serving", 0), "d1": ("parked", 0)}
    daemon.start("c")
    until(daemon, {"p0": ("serving", 0), "d0": ("serving", 0), "d1": ("serving", 0)})
    drains = []
    strike = lambda: drains.append(subprocess.Popen(  # noqa: E731
        [str(BIN / "kvasir"), "hosts", "drain", "b", "--runtime-dir", str(daemon.runtime_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ))  # fmt: skip
    events, _, _, _ = asyncio.run(load_then(daemon, 12, strike, max_tokens=200))
    said = drains[0].communicate(timeout=300)[0]
    assert drains[0].returncode == 0 and "host b is drained" in said, said
    assert terminal_codes(events) == ["finished"] * 12
    after = served_as_generate(daemon, model, [6, 13], 35, lambda i: 5)  # sent once the drain has ended
    assert [final.instances for final in after] == [["p0", "d1"], ["p0", "d1"]]
    refused = kvasir(daemon, "hosts", "drain", "c")
    assert refused.returncode == 2
    assert "draining host c would leave the decode pool 0 serving instances (one at least)" in refused.stderr
    assert stop_gracefully(daemon.processes["b"], 60) == 0
    time.sleep(4.0)  # past cluster.host_silence_s: b is not missed
    finals = served_as_generate(daemon, model, [7, 12, 30], 37, lambda i: 9)
    assert all(final.instances == ["p0", "d1"] for final in finals)
    daemon.start("b")
    until(daemon, {"p0": ("serving", 0), "d0": ("serving", 0), "d1": ("serving", 0)})
    with Client(daemon.runtime_dir) as client:
        stats = client.stats()
    assert stats.restarts == 0 and stats.hosts_missing == [] and stats.last_failure is None
