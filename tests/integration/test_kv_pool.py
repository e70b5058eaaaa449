"""The KV pool in a real daemon: prefix blocks evicted from the instance's cache are
written down its tiers and read back for a later request (usage says from which tier),
after a restart too (the disk tier), and every output equals the Hugging Face model's."""

from __future__ import annotations

import asyncio
import time

from kvasir.client import AsyncClient
from kvasir.sched.prefix import block_keys, namespace_root
from kvasir.wire.client import Finished
from kvasir.wire.pool_stats import KvPoolStats
from tests.support.models import hf_greedy, random_prompts, reference_model

VOCAB, BLOCK, BUDGET = 320, 4, 6
SPLITS = [(0, 3), (3, 6)]


async def finish(runtime_dir, prompt: list[int]) -> Finished:
    async with await AsyncClient.connect(runtime_dir) as client:
        stream = await client.submit(token_ids=prompt, max_tokens=BUDGET, temperature=0)
        end = [event async for event in stream][-1]
    assert isinstance(end, Finished), end
    return end


def one(daemon, prompt: list[int]) -> Finished:
    return asyncio.run(finish(daemon.runtime_dir, prompt))


def pooled(daemon, blocks: int = 0, tokens: int = 0, unusable: int = 0, timeout_s: float = 30.0) -> KvPoolStats:
    """The pool's figures once the bridge's index knows at least ``blocks`` blocks, the
    heads have reported reading back at least ``tokens`` prompt tokens and the stages
    finding ``unusable`` slices (each figure arrives with its process's next report)."""
    deadline = time.monotonic() + timeout_s
    with daemon.client() as client:
        while True:
            pool = client.stats().kv_pool
            assert pool is not None
            if pool.indexed_blocks >= blocks and pool.pooled_tokens >= tokens and pool.unusable >= unusable:
                return pool
            assert time.monotonic() < deadline, pool
            time.sleep(0.1)


def start(start_daemon, model, tmp_path, name="rt", host_bytes=1 << 20):
    """A daemon whose 20 KV blocks hold one request of 48 tokens at a time and a little more."""
    tiers = f'host_bytes = {host_bytes}\ndisk_dir = "{tmp_path / "kvdisk"}"\ndisk_bytes = {4 << 20}'
    return start_daemon(
        model, SPLITS, name=name, block_size=BLOCK, num_blocks=20, max_seq_len=48, max_tokens=8, kv_pool=tiers
    ).wait_ready()


def test_evicted_prefixes_come_back_from_the_pool_exactly_and_after_a_restart(tiny_models, start_daemon, tmp_path):
    daemon = start(start_daemon, tiny_models["llama"], tmp_path)
    model = reference_model(tiny_models["llama"])
    base, *others = random_prompts(VOCAB, [30, 33, 35, 31], seed=41)
    first = one(daemon, base)
    assert first.usage.cached_tokens == 0 and first.token_ids == hf_greedy(model, base, BUDGET)
    for prompt in others:  # each takes the blocks the ones before left: base's are evicted, spilled
        assert one(daemon, prompt).token_ids == hf_greedy(model, prompt, BUDGET)
    pooled(daemon, blocks=7)  # base's 7 full blocks before its last token, at least
    again = one(daemon, base)
    usage = again.usage
    assert (usage.cached_tokens, usage.cached_host_tokens, usage.cached_disk_tokens) == (28, 28, 0), usage
    assert again.token_ids == first.token_ids
    pool = pooled(daemon, blocks=7, tokens=28)
    assert pool.pooled_tokens == 28 and pool.loaded >= 7 and pool.unusable == 0  # 7 blocks, on each stage
    assert pool.host_bytes > 0 and pool.disk_bytes > 0
    assert [s.source for s in pool.sources] == ["host memory"] and pool.sources[0].gib_s > 0
    daemon.stop()

    # a slice on disk turns corrupt while the daemon is down: its block and those after it are computed
    keys = block_keys(others[0], BLOCK, 8, namespace_root("local", None))
    [broken] = (tmp_path / "kvdisk").glob(f"*/3-6/{keys[2].hex()}.3-6.kv")
    data = bytearray(broken.read_bytes())
    data[-40] ^= 0xFF
    broken.write_bytes(bytes(data))

    restarted = start(start_daemon, tiny_models["llama"], tmp_path, name="rt2")  # the disk tier is still there
    pooled(restarted, blocks=7)
    after = one(restarted, others[2])  # still cached at the stop, which wrote it down: read from disk
    assert after.usage.cached_disk_tokens == after.usage.cached_tokens == 28, after.usage
    assert after.token_ids == hf_greedy(model, others[2], BUDGET)
    hurt = one(restarted, others[0])
    assert hurt.usage.cached_disk_tokens == hurt.usage.cached_tokens == 8, hurt.usage
    assert hurt.token_ids == hf_greedy(model, others[0], BUDGET)
    assert pooled(restarted, tokens=36, unusable=1).unusable == 1
