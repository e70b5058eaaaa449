"""The prefix cache in a real daemon: shared beginnings are reused (usage.cached_tokens
says how much) and every output equals the unsplit Hugging Face model's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from kvasir.client import AsyncClient
from kvasir.wire.client import Finished, PrefixCacheStats
from tests.support.daemon import serving_daemon
from tests.support.models import hf_greedy, random_prompts, reference_model

VOCAB, BLOCK = 320, 4


async def finish(runtime_dir, prompts: list[list[int]], budget: int) -> list[Finished]:
    """Submit every prompt at once; each request's Finished event."""
    async with await AsyncClient.connect(runtime_dir) as client:
        streams = [await client.submit(token_ids=p, max_tokens=budget, temperature=0) for p in prompts]
        ends = [[event async for event in stream][-1] for stream in streams]
    assert all(isinstance(end, Finished) for end in ends), ends
    return ends


def one(runtime_dir, prompt: list[int], budget: int = 8) -> Finished:
    return asyncio.run(finish(runtime_dir, [prompt], budget))[0]


SMALL = dict(max_rows=6, max_tokens=8, block_size=BLOCK)  # 4-token blocks, 8-token batches: prompts are chunked


def small(start_daemon, model, splits, **kv):
    """A ready daemon with 4-token blocks and 8-token batches (prompts are chunked)."""
    return start_daemon(model, splits, **SMALL, **kv).wait_ready()


@pytest.fixture(scope="module")
def llama_cache(tiny_models, tmp_path_factory):
    """The Llama's two stages with 64 blocks, for the tests that only add to its cache (each
    counts from what it finds there)."""
    splits = [(0, 3), (3, 6)]
    with serving_daemon(
        tmp_path_factory.mktemp("cache"), tiny_models["llama"], splits, **SMALL, num_blocks=64, max_seq_len=64
    ) as daemon:
        yield daemon


def test_shared_prefixes_of_every_shape_are_reused_exactly(tiny_models, llama_cache):
    daemon = llama_cache
    model = reference_model(tiny_models["llama"])
    with daemon.client() as client:
        before = client.stats().prefix_cache
    assert before is not None
    base, x, y, z = random_prompts(VOCAB, [22, 5, 12, 3], seed=11)
    first = one(daemon.runtime_dir, base)
    assert first.usage.cached_tokens == 0 and first.token_ids == hf_greedy(model, base, 8)
    cases = [
        (base[:9] + x, 8),  # shared prefix ends inside a block: its two full blocks are reused
        (base[:12] + y, 12),  # ends exactly on a block boundary; the rest (12 tokens) is chunked
        (base, 20),  # the whole prompt again: all but its last block (its last token is computed)
        (base + first.token_ids + z, 28),  # the next turn: history and generated tokens reused
    ]
    for prompt, cached in cases:
        end = one(daemon.runtime_dir, prompt)
        assert end.usage.cached_tokens == cached, (len(prompt), end.usage)
        assert end.usage.prompt_tokens == len(prompt)
        assert end.token_ids == hf_greedy(model, prompt, 8)
    cache = reported(daemon, queries=before.queries + 5)  # kvasir stats: the head's counts, summed
    hits, prompted = cache.hit_tokens - before.hit_tokens, cache.prompt_tokens - before.prompt_tokens
    assert (hits, prompted) == (68, sum(len(p) for p, _ in cases) + len(base))
    assert cache.cached_blocks > 0 and cache.evicted == before.evicted


def reported(daemon, queries: int, timeout_s: float = 30.0) -> PrefixCacheStats:
    """The daemon's prefix-cache figures once the head has reported ``queries`` lookups."""
    deadline = time.monotonic() + timeout_s
    with daemon.client() as client:
        while True:
            cache = client.stats().prefix_cache
            if cache is not None and cache.queries >= queries or time.monotonic() > deadline:
                assert cache is not None and cache.queries == queries, cache
                return cache
            time.sleep(0.2)


def test_racing_requests_and_eviction_keep_every_output_exact(tiny_models, start_daemon):
    # 24 blocks: two requests of the 48-token limit fill the cache, so admitting the
    # distinct prompts below evicts idle cached blocks while others hold theirs
    daemon = small(start_daemon, tiny_models["qwen2"], [(0, 2), (2, 6)], num_blocks=24, max_seq_len=48)
    model = reference_model(tiny_models["qwen2"])
    shared = random_prompts(VOCAB, [13], seed=21)[0]
    racing = [shared + tail for tail in random_prompts(VOCAB, [1, 2, 3, 4, 5, 6], seed=22)]
    distinct = random_prompts(VOCAB, [17, 19, 23, 14, 21, 18], seed=23)
    for round_ in range(2):  # the second round finds the first's blocks, or what eviction left of them
        prompts = racing + distinct
        ends = asyncio.run(finish(daemon.runtime_dir, prompts, 10))
        for prompt, end in zip(prompts, ends):
            assert end.token_ids == hf_greedy(model, prompt, 10), (round_, prompt)
            assert 0 <= end.usage.cached_tokens < len(prompt)
    again = [one(daemon.runtime_dir, racing[0], 10) for _ in range(2)]  # eviction may have taken it; then cached
    assert again[1].usage.cached_tokens == 12
    assert again[0].token_ids == again[1].token_ids == hf_greedy(model, racing[0], 10)


def test_with_the_cache_off_nothing_is_reused(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], block_size=BLOCK, prefix_cache=False).wait_ready()
    prompt = random_prompts(VOCAB, [30], seed=31)[0]
    ends = [one(daemon.runtime_dir, prompt) for _ in range(2)]
    assert [end.usage.cached_tokens for end in ends] == [0, 0]
    cache = reported(daemon, queries=0)
    assert (cache.hit_tokens, cache.cached_blocks) == (0, 0)
    assert ends[0].token_ids == ends[1].token_ids


def test_multi_turn_conversations_resend_their_history_and_reuse_it(tiny_models, llama_cache):
    from kvasir.bench.runner import run_load
    from kvasir.bench.workload import LengthSpec, synthetic_jobs

    daemon = llama_cache
    model = reference_model(tiny_models["llama"])
    jobs = synthetic_jobs(6, LengthSpec(5, 5, turns=3), LengthSpec(4, 4), VOCAB, seed=3)
    assert [job.turn for job in jobs] == [0, 1, 2, 0, 1, 2]

    async def run():
        async with await AsyncClient.connect(daemon.runtime_dir) as client:
            return await run_load(client, jobs, concurrency=1)

    records = asyncio.run(run()).records  # one conversation at a time: in the jobs' order
    assert len(records) == 6 and all(r.ok for r in records)
    history: list[int] = []
    for job, record in zip(jobs, records):
        prompt = (history if job.turn else []) + list(job.token_ids or ())
        assert record.prompt_tokens == len(prompt)
        assert list(record.output_ids) == hf_greedy(model, prompt, 4)  # the history resent exactly
        if job.turn:  # reused: the blocks the turn before wrote in full (all but its last sampled token)
            written = (len(history) - 1) // BLOCK * BLOCK
            assert record.cached_tokens == min(written, (len(prompt) - 1) // BLOCK * BLOCK) > 0
        else:
            assert record.cached_tokens == 0
        history = prompt + list(record.output_ids)


def test_shared_by_all_tenants_meet_and_only_salts_keep_requests_apart(tiny_models, start_daemon):
    from tests.support.daemon import BIN

    daemon = small(start_daemon, tiny_models["llama"], [(0, 3), (3, 6)], prefix_share="all")
    prompt = random_prompts(VOCAB, [22], seed=41)[0]  # five full blocks before its last token

    async def cached(**kw) -> int:
        async with await AsyncClient.connect(daemon.runtime_dir) as client:
            end = await (await client.submit(token_ids=prompt, max_tokens=2, temperature=0, **kw)).result()
        assert isinstance(end, Finished), end
        return end.usage.cached_tokens

    assert asyncio.run(cached(tenant="front-a")) == 0
    assert asyncio.run(cached(tenant="front-b")) == 20  # prefix_share = "all": tenants share
    assert asyncio.run(cached(cache_salt="s")) == 0  # a salt is a namespace of its own
    ids = ",".join(map(str, prompt))
    run = [str(BIN / "kvasir"), "generate", "--runtime-dir", str(daemon.runtime_dir), "--ids", ids, "--json"]
    salted = subprocess.run(
        run + ["--max-tokens", "2", "--temperature", "0", "--cache-salt", "s"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert salted.returncode == 0, salted.stderr
    assert json.loads(salted.stdout.splitlines()[-1])["usage"]["cached_tokens"] == 20
