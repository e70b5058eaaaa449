"""Expert shards in a real daemon: every shard its own process, exact against the
unsplit Hugging Face model; a shard that dies or hangs is a worker failure like a
stage's."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time

import pytest
from click.testing import CliRunner
from test_ring import check_events, run_all
from test_supervision import load_then, one_greedy, terminal_codes, wait_serving_again

from kvasir.cli.main import kvasir
from kvasir.model.moe_layout import MoeLayout
from kvasir.wire.client import ErrorEvent, Finished
from tests.support.daemon import alive, settled
from tests.support.models import MOE_FAMILIES, hf_greedy, random_prompts, reference_model

SPLITS = [(0, 3), (3, 6)]
# stage 0: uneven ranges, one shard holding a single expert; stage 1 runs its own experts
SHARDS = {0: [(0, 1), (1, 6), (6, 8)]}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_shards_match_hf_generate_for_concurrent_requests(tiny_models, start_daemon, family):
    daemon = start_daemon(
        tiny_models[family], SPLITS, name=f"shards-{family}", max_rows=6, max_tokens=32, num_blocks=120, experts=SHARDS
    ).wait_ready()
    prompts = random_prompts(320, [1, 5, 12, 33, 70, 2, 9, 25], seed=7)
    budgets = [6 + (i * 5) % 12 for i in range(len(prompts))]
    results = asyncio.run(run_all(daemon.runtime_dir, prompts, budgets))
    model = reference_model(tiny_models[family])
    for prompt, budget, events in zip(prompts, budgets, results):
        _, final = check_events(events)
        assert isinstance(final, Finished), final
        assert final.token_ids == hf_greedy(model, prompt, budget)
    stats = with_shards(daemon.runtime_dir, 3)
    head, tail = stats.stages
    shards = stats.shards
    assert [(s.number, s.stage, s.experts) for s in shards] == [(0, 0, (0, 1)), (1, 0, (1, 6)), (2, 0, (6, 8))]
    assert all(alive(s.pid) for s in shards) and not {s.pid for s in shards} & {head.pid, tail.pid}
    # every pick of stage 0 went to the shard holding its expert, and was counted there
    assert [t for s in shards for t in s.expert_tokens] == list(head.experts.tokens)
    assert sum(s.tokens for s in shards) == sum(head.experts.tokens) > 0
    assert (
        head.experts.dispatch_s > 0 and tail.experts.dispatch_s == 0 and len(tail.experts.tokens) == 8
    )  # stage 1: its own
    assert head.experts.imbalance >= 1.0
    runs = head.batches * len(MoeLayout.of(model.config).moe_layers((0, 3)))  # stage 0's MoE layer passes
    assert shards[0].dispatches < runs, "the one-expert shard should have had passes with no rows"
    assert sum(s.dispatches for s in shards) > runs, "some passes should have sent rows to several shards"
    check_cli(daemon.runtime_dir, stats)


def check_cli(runtime_dir, stats) -> None:
    """kvasir stats (JSON and text) and kvasir top show the shards and the expert load."""
    where = ["--runtime-dir", str(runtime_dir)]
    body = json.loads(CliRunner().invoke(kvasir, ["stats", "--json", *where]).output)
    listed = [(s["number"], s["stage"], s["experts"], s["pid"]) for s in body["shards"]]
    assert listed == [(s.number, s.stage, list(s.experts), s.pid) for s in stats.shards]
    assert all({"busy_s", "starved_s", "blocked_s", "tokens", "busy_fraction"} <= set(s) for s in body["shards"])
    head = body["stages"][0]
    assert len(head["experts"]["tokens"]) == 8 and head["experts"]["imbalance"] >= 1
    assert 0 < head["experts"]["dispatch_fraction"] <= 1
    text = CliRunner().invoke(kvasir, ["stats", *where]).output
    assert "stage 0 experts: tokens [" in text and "of busy" in text and "stage 1 experts:" in text
    assert [line.split()[:3] for line in text.splitlines() if line.startswith(("0 ", "1 ", "2 "))][-3:] == [
        ["0", "0", "[0,"],
        ["1", "0", "[1,"],
        ["2", "0", "[6,"],
    ]
    frames = CliRunner().invoke(kvasir, ["top", "--count", "1", "--interval", "0.6", *where]).output
    assert sum(line.lstrip().startswith(("s0:0", "s1:0", "s2:0")) for line in frames.splitlines()) == 3
    assert "stage 0 expert load: busiest" in frames


def with_shards(runtime_dir, count: int, timeout_s: float = 30.0):
    """Settled stats once ``count`` shards have reported since the stages' last report
    (stages and shards each report twice a second: the sums agree once both have)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = settled(runtime_dir)
        picks = sum(
            sum(s.experts.tokens) for s in stats.stages if s.experts is not None and s.experts.dispatch_s > 0
        )  # stages with shards
        if len(stats.shards) >= count and sum(s.tokens for s in stats.shards) == picks:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_a_shard_that_dies_or_hangs_fails_the_ring_which_serves_again(tiny_models, start_daemon):
    """SIGKILL one shard under load, then SIGSTOP another: each time every request ends
    once (stage_failed naming the shard), the ring (shards included) restarts and the
    output is exact again."""
    family = "qwen3_moe"
    daemon = start_daemon(
        tiny_models[family], SPLITS, name="shard-failures", experts={0: [(0, 3), (3, 8)], 1: [(0, 8)]},
        heartbeat_timeout_s=3.0,
    ).wait_ready()  # fmt: skip
    reference = reference_model(tiny_models[family])
    for restarts, (victim, sig, how) in enumerate([(1, signal.SIGKILL, "signal 9"), (2, signal.SIGSTOP, "hung")], 1):
        before = with_shards(daemon.runtime_dir, 3)
        pid = before.shards[victim].pid
        strike = functools.partial(os.kill, pid, sig)
        events, _, _, _ = asyncio.run(load_then(daemon, 12, strike, max_tokens=120))
        codes = terminal_codes(events)
        assert "stage_failed" in codes and set(codes) <= {"finished", "stage_failed"}, codes
        failure = next(e for evs in events.values() for e in evs if isinstance(e, ErrorEvent))
        assert f"shard-{victim}" in failure.message and how in failure.message, failure.message
        stats = wait_serving_again(daemon.runtime_dir, daemon.stages, restarts=restarts)
        assert f"shard-{victim}" in stats.last_failure
        old = {s.pid for s in before.shards} | {s.pid for s in before.stages}
        assert not any(alive(p) for p in old)  # the whole ring went, the stopped shard too
        assert one_greedy(daemon.runtime_dir, [5, 6, 7], 10) == hf_greedy(reference, [5, 6, 7], 10)
        again = with_shards(daemon.runtime_dir, 3)
        assert len(again.shards) == 3 and not {s.pid for s in again.shards} & old


def test_a_disaggregated_plan_shards_experts_in_both_pools(tiny_models, start_daemon):
    """Expert shards under [[prefill.stages]] and [[decode.stages]]: each pool's stages
    dispatch to their own shards, and the hand-off between pools is unchanged."""
    pools = {"prefill": [(0, 3), (3, 6)], "decode": [(0, 2), (2, 6)]}
    experts = {0: [(0, 4), (4, 8)], 1: [(0, 8)]}  # by index within each pool
    daemon = start_daemon(tiny_models["mixtral"], pools, name="disagg-shards", num_blocks=160, experts=experts)
    daemon.wait_ready()
    prompts = random_prompts(320, [3, 40, 17], seed=11)
    results = asyncio.run(run_all(daemon.runtime_dir, prompts, [10, 10, 10]))
    model = reference_model(tiny_models["mixtral"])
    for prompt, events in zip(prompts, results):
        _, final = check_events(events)
        assert isinstance(final, Finished) and final.token_ids == hf_greedy(model, prompt, 10), final
    stats = with_shards(daemon.runtime_dir, 6)
    placed = [(s.stage, s.experts, s.pool) for s in stats.shards]
    assert placed == [
        (0, (0, 4), "prefill"),
        (0, (4, 8), "prefill"),
        (1, (0, 8), "prefill"),
        (2, (0, 4), "decode"),
        (2, (4, 8), "decode"),
        (3, (0, 8), "decode"),
    ]
    assert all(s.dispatches > 0 for s in stats.shards)
    assert stats.handoff is not None and stats.handoff.count > 0
