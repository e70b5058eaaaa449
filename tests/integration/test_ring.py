"""Real daemons (real processes, ipc:// sockets) against the unsplit Hugging Face model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvasir.client import AsyncClient
from kvasir.wire.client import Accepted, Cancelled, ErrorEvent, Finished, TokenOut
from tests.support.daemon import TailReader
from tests.support.models import hf_greedy, random_prompts, reference_model

LENGTHS = [1, 3, 7, 12, 20, 33, 48, 64, 90, 120, 2, 5, 17, 26, 40, 75, 101, 9]


async def run_all(runtime_dir, prompts, budgets):
    async with await AsyncClient.connect(runtime_dir) as client:
        streams = [await client.submit(token_ids=p, max_tokens=n, temperature=0) for p, n in zip(prompts, budgets)]
        return [[event async for event in stream] for stream in streams]


def check_events(events):
    """Accepted, then tokens with consecutive indices, then exactly one terminal event."""
    assert isinstance(events[0], Accepted)
    tokens = [e for e in events if isinstance(e, TokenOut)]
    assert [t.index for t in tokens] == list(range(len(tokens)))
    terminal = [e for e in events if isinstance(e, (Finished, Cancelled, ErrorEvent))]
    assert len(terminal) == 1 and events[-1] is terminal[0]
    return tokens, terminal[0]


@pytest.mark.parametrize("family, splits", [("llama", [(0, 3), (3, 6)]), ("qwen2", [(0, 1), (1, 4), (4, 6)])])
def test_ring_matches_hf_generate_for_concurrent_requests(tiny_models, start_daemon, family, splits):
    daemon = start_daemon(tiny_models[family], splits, max_rows=6, max_tokens=32, num_blocks=120).wait_ready()
    prompts = random_prompts(320, LENGTHS, seed=5)
    budgets = [4 + (i * 7) % 20 for i in range(len(prompts))]
    tail = TailReader(daemon.runtime_dir)
    tail.wait_attached(daemon.runtime_dir)
    try:
        results = asyncio.run(run_all(daemon.runtime_dir, prompts, budgets))
        model = reference_model(tiny_models[family])
        seen = {}
        for prompt, budget, events in zip(prompts, budgets, results):
            tokens, final = check_events(events)
            assert isinstance(final, Finished), final
            expected = hf_greedy(model, prompt, budget)
            assert final.token_ids == [t.token_id for t in tokens] == expected
            assert final.usage.prompt_tokens == len(prompt) and final.usage.completion_tokens == len(expected)
            assert final.timings.first_token_s > 0 and final.timings.total_s >= final.timings.first_token_s
            seen[final.request_id] = final.token_ids
        total = sum(len(v) for v in seen.values())
        tailed = {}
        for _ in range(total):
            event = tail.next()
            assert event["type"] == "token"
            tailed.setdefault(event["request_id"], []).append(event["token_id"])
        assert tailed == seen  # kvasir tail saw every token of the run
    finally:
        tail.stop()
    stats = daemon.child_pids()
    assert len(stats) == len(splits)
    for pid in stats:  # each stage runs with glibc asked for huge pages (kvasir/daemon/children.py)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert any(b"glibc.malloc.hugetlb=1" in item for item in environ if item.startswith(b"GLIBC_TUNABLES="))
