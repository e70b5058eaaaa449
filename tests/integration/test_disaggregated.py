"""Disaggregated serving: a prefill pool and a decode pool, KV handed stage to stage."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from test_ring import check_events, run_all
from test_supervision import load_then, one_greedy, terminal_codes, wait_serving_again

from kvasir.client import Client
from kvasir.wire.client import ErrorEvent, Finished
from tests.support.daemon import BIN, alive, settled
from tests.support.models import hf_greedy, random_prompts, reference_model

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
    handed = sum(1 for events in results if len(check_events(events)[0]) > 1)  # one that ends at its first token stays
    assert stats.handoff is not None and stats.handoff.count == handed > 0
    stats = settled(daemon.runtime_dir)
    assert all(
        s.kv.blocks == 0 and (s.head is None or s.head.handing_off == 0) for s in stats.stages
    )  # every pool freed every request's blocks
    shown = subprocess.run(
        [str(BIN / "kvasir"), "stats", "--json", "--runtime-dir", str(daemon.runtime_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    body = json.loads(shown.stdout)
    assert body["handoff"]["count"] == handed and body["handoff"]["kv_bytes"] > 0 and body["handoff"]["gibps"] > 0
    assert set(body["pools"]) == {"prefill", "decode"}
    decode = [stage for stage in body["stages"] if stage["pool"] == "decode"]
    assert all(stage["handoff"]["bytes"] > 0 for stage in decode)
    # the prefill pool reuses cached prefixes; the decode pool still gets every request's whole KV
    repeat = prompts[LENGTHS.index(33)]
    whole = check_events(results[LENGTHS.index(33)])[1].handoff
    cached = []
    for prompt in (repeat, repeat[:30] + [7, 7, 7]):  # the first may find its blocks evicted since; then cached
        (events,) = asyncio.run(run_all(daemon.runtime_dir, [prompt], [12]))
        final = check_events(events)[1]
        assert isinstance(final, Finished) and final.token_ids == hf_greedy(model, prompt, 12)
        assert whole is not None and final.handoff is not None
        assert final.handoff.kv_bytes == whole.kv_bytes  # 33 tokens' KV, cached or not
        cached.append(final.usage.cached_tokens)
    assert cached[1] == 28  # the first 30 tokens' seven full blocks


def test_a_stage_dying_mid_handoff_fails_its_requests_once_and_the_pools_recover(tiny_models, start_daemon):
    """Killed in turn, on one daemon: the prefill pool's tail, then the decode pool's head."""
    splits = SPLITS["different"]
    daemon = start_daemon(tiny_models["llama"], splits, name="disagg-kill", num_blocks=160).wait_ready()
    launcher = daemon.process.pid
    reference = reference_model(tiny_models["llama"])
    for restarts, victim in enumerate((1, 2), start=1):
        before = daemon.child_pids()
        kill = functools.partial(os.kill, before[victim], signal.SIGKILL)
        events, _, _, _ = asyncio.run(load_then(daemon, 40, kill, 60))
        codes = terminal_codes(events)
        assert set(codes) <= {"finished", "stage_failed"} and "stage_failed" in codes, codes
        failure = next(e for evs in events.values() for e in evs if isinstance(e, ErrorEvent))
        assert f"stage-{victim}" in failure.message, failure.message
        wait_serving_again(daemon.runtime_dir, daemon.stages, restarts=restarts)
        assert not any(alive(pid) for pid in before)
        prompt = list(range(5 + victim, 45))
        assert one_greedy(daemon.runtime_dir, prompt, 12) == hf_greedy(reference, prompt, 12)
        stats = settled(daemon.runtime_dir)
        assert all(s.kv.blocks == 0 and (s.head is None or s.head.handing_off == 0) for s in stats.stages), stats.stages
    assert daemon.stop() == 0
    assert not list(Path("/dev/shm").glob(f"kvasir-{launcher}-*"))  # edges and prefill KV segments removed


def test_a_full_decode_pool_makes_prefill_wait_and_drops_nothing(tiny_models, start_daemon):
    """The decode pool holds 4 requests at a time, the prefill pool 3 prompts: 16 requests
    queue on both sides (prefill waits for the decode pool to take KV), and every one
    finishes with the reference output."""
    splits = SPLITS["equal"]
    daemon = start_daemon(
        tiny_models["llama"], splits, name="disagg-full", num_blocks=160, decode_blocks=64, prefill_blocks=64
    ).wait_ready()
    prompts = random_prompts(320, [80] * 16, seed=3)
    budgets = [40] * 16
    results = asyncio.run(run_all(daemon.runtime_dir, prompts, budgets))
    reference = reference_model(tiny_models["llama"])
    handed = 0
    for prompt, budget, events in zip(prompts, budgets, results):
        _, final = check_events(events)
        assert isinstance(final, Finished), final
        assert final.token_ids == hf_greedy(reference, prompt, budget)
        handed += len(final.token_ids) > 1  # one that ends at its first token never leaves the prefill pool
    stats = settled(daemon.runtime_dir)
    assert handed > 8 and stats.handoff.count == handed
    assert all(s.kv.blocks == 0 and (s.head is None or s.head.handing_off == 0) for s in stats.stages), stats.stages


def test_a_lost_confirmation_ends_with_the_lease(tiny_models, start_daemon):
    """A decode stage that stops taking KV (SIGSTOP: alive, silent; heartbeats are given
    long enough) never confirms: after the lease the requests fail with stage_failed and
    the prefill pool's blocks are free; once it runs again the daemon serves as before."""
    splits = SPLITS["equal"]
    daemon = start_daemon(
        tiny_models["llama"], splits, name="disagg-lease", num_blocks=160, lease_s=2, heartbeat_timeout_s=120
    ).wait_ready()
    pids = daemon.child_pids()
    os.kill(pids[3], signal.SIGSTOP)  # the decode tail
    try:
        with Client(daemon.runtime_dir) as client:
            finals = [client.generate(token_ids=[4, 5, 6 + i], max_tokens=8, temperature=0) for i in range(3)]
        for final in finals:
            assert isinstance(final, ErrorEvent) and final.code == "stage_failed", final
            assert "did not take" in final.message
        prefill = [s for s in settled(daemon.runtime_dir, pool="prefill").stages if s.pool == "prefill"]
        assert len(prefill) == 2 and all(
            (s.head is None or s.head.handing_off == 0) and s.kv.blocks == 0 for s in prefill
        ), prefill
    finally:
        os.kill(pids[3], signal.SIGCONT)
    reference = reference_model(tiny_models["llama"])
    assert one_greedy(daemon.runtime_dir, [9, 8, 7], 10) == hf_greedy(reference, [9, 8, 7], 10)
    stats = settled(daemon.runtime_dir)
    assert all(s.kv.blocks == 0 and (s.head is None or s.head.handing_off == 0) for s in stats.stages), stats.stages
