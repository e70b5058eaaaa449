"""A fleet across hosts (network namespaces): instances on different hosts are each exact,
and a host that dies takes only the instance it runs; the others serve on, and the
instance returns with its host's ``kvasird join``. Skipped where namespaces cannot be made."""

from __future__ import annotations

import asyncio

import pytest

from kvasir.bench.netns import netns_unavailable
from kvasir.wire.client import ErrorEvent, Finished
from tests.integration.test_fleet import instance_back
from tests.integration.test_hosts_ring import MODEL, served_as_generate
from tests.integration.test_supervision import load_then, terminal_codes
from tests.support.cluster import hosts_table

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

INSTANCES = """
[route]
policy = "round_robin"
[[instances]]
name = "a"
[[instances.stages]]
layers = [0, 3]
[[instances.stages]]
layers = [3, 6]
[[instances]]
name = "b"
[[instances.stages]]
layers = [0, 2]
host = "b"
[[instances.stages]]
layers = [2, 6]
host = "c"
"""


def test_instances_on_different_hosts_are_exact_and_a_lost_host_takes_only_its_instance(network, hosted, tiny_models):
    plan = MODEL.format(model=tiny_models["llama"]).replace("heartbeat_timeout_s = 3.0", "heartbeat_timeout_s = 30.0")
    daemon = hosted(plan + hosts_table(network, silence_s=30.0) + INSTANCES, 4).wait_ready()
    finals = served_as_generate(daemon, tiny_models["llama"], [5, 17, 30, 9, 44, 2], 17, lambda i: 4 + i)
    assert sorted(final.instances[0] for final in finals) == ["a", "a", "a", "b", "b", "b"]
    assert [(s.instance, s.host) for s in daemon.stats().stages] == [("a", "a"), ("a", "a"), ("b", "b"), ("b", "c")]
    events, _, _, late = asyncio.run(load_then(daemon, 12, lambda: daemon.kill_host("c"), max_tokens=60))
    codes = terminal_codes(events)
    ends = [evs[-1] for evs in events.values()]
    assert codes.count("finished") == 6 and codes.count("stage_failed") == 6, codes  # round robin: half on b
    assert all(end.instances == ["a"] for end in ends if isinstance(end, Finished))
    failure = next(end for end in ends if isinstance(end, ErrorEvent))
    assert "host c is missing" in failure.message and "instance b is restarting" in failure.message, failure.message
    assert isinstance(late, Finished) and late.instances == ["a"]  # while b waits for its host, a serves
    stats = daemon.stats()
    assert stats.state == "serving" and stats.hosts_missing == ["c"]
    assert [i.state for i in stats.instances] == ["serving", "restarting"]
    daemon.start("c")
    instance_back(daemon, "b", timeout_s=240.0)
    finals = served_as_generate(daemon, tiny_models["llama"], [6, 11, 8, 3], 19, lambda i: 6)  # exact, both back
    assert sorted(final.instances[0] for final in finals) == ["a", "a", "b", "b"]
