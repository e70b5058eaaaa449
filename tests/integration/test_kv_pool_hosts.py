"""The KV pool across hosts (network namespaces): a prefix one instance computed and
evicted on its host is read by another instance's stages, on other hosts, from that
host's pool over the fabric, and the output equals Hugging Face ``generate``. Skipped
where namespaces cannot be made."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvasir.bench.netns import netns_unavailable
from kvasir.client import AsyncClient
from kvasir.wire.client import Finished
from tests.integration.test_hosts_ring import MODEL
from tests.support.cluster import hosts_table
from tests.support.models import hf_greedy, random_prompts, reference_model

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

BUDGET = 6
PLAN = """
[kv_pool]
host_bytes = 4194304
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
layers = [0, 3]
host = "b"
[[instances.stages]]
layers = [3, 6]
host = "c"
"""


async def in_turn(runtime_dir, prompts: list[list[int]]) -> list[Finished]:
    """One request after another (round robin: a, b, a, b, ...); each one's Finished."""
    ends = []
    async with await AsyncClient.connect(runtime_dir) as client:
        for prompt in prompts:
            stream = await client.submit(token_ids=prompt, max_tokens=BUDGET, temperature=0)
            end = [event async for event in stream][-1]
            assert isinstance(end, Finished), end
            ends.append(end)
    return ends


def test_a_prefix_evicted_on_one_host_is_read_by_an_instance_on_others(network, hosted, tiny_models):
    model = MODEL.format(model=tiny_models["llama"]).replace("num_blocks = 200", "num_blocks = 20")
    model = model.replace("max_seq_len = 256", "max_seq_len = 48").replace(
        "heartbeat_timeout_s = 3.0", "heartbeat_timeout_s = 30.0"
    )
    daemon = hosted(model + hosts_table(network) + PLAN, 4).wait_ready()
    base, *fillers = random_prompts(320, [30, 33, 35, 31, 34, 32, 33], seed=51)
    # a: base, then three fillers that push it out of a's cache into host a's pool; b: the others
    ends = asyncio.run(in_turn(daemon.runtime_dir, [base, *fillers, base]))
    reference = reference_model(tiny_models["llama"])
    assert [end.instances for end in ends] == [["a"], ["b"]] * 3 + [["a"], ["b"]]
    for prompt, end in zip([base, *fillers, base], ends):
        assert end.token_ids == hf_greedy(reference, prompt, BUDGET)
    usage = ends[-1].usage  # instance b's stages (hosts b and c) read base's blocks from host a's
    assert (usage.cached_tokens, usage.cached_remote_tokens) == (28, 28), (usage, ends[-1].route)
    assert ends[-1].route.endswith("; kv pool: 28 tokens from another host's pool (no fetch measured yet)")
    for _ in range(100):  # the stages' figures come with their next reports
        pool = daemon.stats().kv_pool
        assert pool is not None
        if pool.pooled_tokens >= 28 and sum(s.slices for s in pool.sources) >= 14:  # both of b's stages
            break
        time.sleep(0.1)
    assert pool.remote_bytes > 0 and pool.remote_gib_s > 0 and pool.unusable == 0, pool
    assert [(s.source, s.slices) for s in pool.sources] == [("host a", 14)]  # 7 blocks, for each of b's two stages
