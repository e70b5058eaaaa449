"""Disaggregated serving: a prefill pool and a decode pool, KV handed stage to stage."""

from __future__ import annotations

import asyncio

import pytest

from kvasir.client import Client
from kvasir.messages import Finished
from models import hf_greedy, random_prompts, reference_model
from test_ring import check_events, run_all

LENGTHS = [1, 3, 7, 12, 20, 33, 48, 64, 90, 120, 2, 5, 17, 26, 40, 75, 101, 9]
SPLITS = {
    "equal": {"prefill": [(0, 3), (3, 6)], "decode": [(0, 3), (3, 6)]},
    "different": {"prefill": [(0, 2), (2, 5), (5, 6)], "decode": [(0, 4), (4, 6)]},
}


@pytest.mark.parametrize("split", SPLITS)
def test_disaggregated_output_equals_hf_generate(tiny_models, start_daemon, split):
    splits = SPLITS[split]
    daemon = start_daemon(tiny_models["llama"], splits, name=f"disagg-{split}", max_rows=6, num_blocks=160).wait_ready()
    prompts = random_prompts(320, LENGTHS, seed=11)
    budgets = [1 + (i * 7) % 20 for i in range(len(prompts))]
    results = asyncio.run(run_all(daemon.runtime_dir, prompts, budgets))
    model = reference_model(tiny_models["llama"])
    for prompt, budget, events in zip(prompts, budgets, results):
        tokens, final = check_events(events)
        assert isinstance(final, Finished), final
        assert final.token_ids == [t.token_id for t in tokens] == hf_greedy(model, prompt, budget)
        if len(final.token_ids) > 1:
            assert final.handoff is not None and final.handoff.kv_bytes > 0 and final.handoff.seconds > 0
            assert final.timings.second_token_s is not None and final.timings.second_token_s > 0
    with Client(daemon.runtime_dir) as client:
        stats = client.stats()
    pools = [s.pool for s in stats.stages]
    assert pools == ["prefill"] * len(splits["prefill"]) + ["decode"] * len(splits["decode"])
    assert stats.handoff is not None and stats.handoff.count == sum(1 for n in budgets if n > 1)
    assert all(s.kv_blocks == 0 for s in stats.stages)  # every pool freed every request's blocks
