"""Rings across hosts (network namespaces, tests/support/netns.py): ``kvasird start`` on
the leader, ``kvasird join`` on the followers, stages talking over TCP with CURVE; greedy
output equals Hugging Face ``generate``. Skipped where namespaces cannot be made."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from kvasir.bench.netns import Network, netns_unavailable
from kvasir.wire.client import ErrorEvent, Finished
from tests.integration.test_ring import check_events, run_all
from tests.integration.test_supervision import load_then, one_greedy, terminal_codes, wait_serving_again
from tests.support.cluster import HostedDaemon, hosts_table
from tests.support.daemon import BIN, alive, settled
from tests.support.models import hf_greedy, random_prompts, reference_model

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

MODEL = """
[model]
source = "{model}"
max_seq_len = 256
dtype = "float32"
[batch]
max_rows = 6
max_tokens = 32
inflight = 3
[kv]
block_size = 4
num_blocks = 200
[supervise]
heartbeat_timeout_s = 3.0
"""


def served_as_generate(daemon: HostedDaemon, model, lengths: list[int], seed: int, budget) -> list[Finished]:
    """Concurrent greedy requests: each one's events in order and its tokens those of HF
    ``generate``; the finished events."""
    prompts = random_prompts(320, lengths, seed=seed)
    budgets = [budget(i) for i in range(len(prompts))]
    results = asyncio.run(run_all(daemon.runtime_dir, prompts, budgets))
    reference = reference_model(model)
    finals = []
    for prompt, n, events in zip(prompts, budgets, results):
        tokens, final = check_events(events)
        assert isinstance(final, Finished), final
        assert final.token_ids == [t.token_id for t in tokens] == hf_greedy(reference, prompt, n)
        finals.append(final)
    return finals


def ring_plan(network: Network, model) -> str:
    stages = '[[stages]]\nlayers = [0, 2]\n[[stages]]\nlayers = [2, 4]\nhost = "b"\n[[stages]]\nlayers = [4, 6]\nhost = "c"\n'
    return MODEL.format(model=model) + hosts_table(network) + stages


def two_host_plan(network: Network, model, heartbeat_s: float = 3.0, silence_s: float | None = None) -> str:
    """Stages 0 and 1 on the leader a, stage 2 on b (host c runs nothing)."""
    stages = '[[stages]]\nlayers = [0, 2]\n[[stages]]\nlayers = [2, 4]\n[[stages]]\nlayers = [4, 6]\nhost = "b"\n'
    model_text = MODEL.format(model=model).replace("heartbeat_timeout_s = 3.0", f"heartbeat_timeout_s = {heartbeat_s}")
    return model_text + hosts_table(network, silence_s=silence_s) + stages


def check_host_failure(daemon: HostedDaemon, strike, model) -> list:
    """Load, strike, then: every request ended once (stage_failed for some), the failure
    names host b, the stats say so, and once b's kvasird join is back the ring serves
    again and equals generate. Returns the pids of b's first workers."""
    before = {s.index: s for s in daemon.stats().stages}
    assert before[2].host == "b" and before[0].host == "a"
    events, _, _, late = asyncio.run(load_then(daemon, 20, strike))
    codes = terminal_codes(events)
    assert "stage_failed" in codes and set(codes) <= {"finished", "stage_failed"}, codes
    failure = next(e for evs in events.values() for e in evs if isinstance(e, ErrorEvent))
    assert "host b" in failure.message, failure.message
    assert isinstance(late, ErrorEvent) and late.code == "restarting", late
    return [before[2].pid]


def test_a_follower_killed_under_load_fails_every_request_once_and_the_ring_returns_with_it(
    network, hosted, tiny_models
):
    # every timeout at 30 s: what tells the clients is b's connections dropping (its kernel
    # resets them) and b not coming back within a second
    plan = two_host_plan(network, tiny_models["llama"], heartbeat_s=30.0, silence_s=30.0)
    daemon = hosted(plan, 3, later=("c",)).wait_ready()  # c runs nothing: the leader needs no join there
    check_host_failure(daemon, lambda: daemon.kill_host("b"), tiny_models["llama"])
    stats = daemon.stats()
    assert stats.state == "restarting" and stats.hosts_missing == ["b"]
    assert "host b is missing: its connection dropped" in stats.last_failure, stats.last_failure
    shown = subprocess.run(
        [str(BIN / "kvasir"), "stats", "--runtime-dir", str(daemon.runtime_dir)], capture_output=True, text=True
    )
    assert "hosts missing: b (waiting for their kvasird join)" in shown.stdout, shown.stdout
    daemon.start("b")
    stats = wait_serving_again(daemon.runtime_dir, 3)
    assert stats.hosts_missing == [] and [s.host for s in stats.stages] == ["a", "a", "b"]
    shown = subprocess.run(
        [str(BIN / "kvasir"), "stats", "--runtime-dir", str(daemon.runtime_dir)], capture_output=True, text=True
    )
    assert f"{stats.stages[2].pid}@b" in shown.stdout, shown.stdout
    reference = reference_model(tiny_models["llama"])
    assert one_greedy(daemon.runtime_dir, [4, 8, 15, 16], 10) == hf_greedy(reference, [4, 8, 15, 16], 10)


def test_a_link_down_under_load_fails_every_request_once_and_the_ring_returns_when_it_is_up(
    network, hosted, tiny_models
):
    # the workers' hang timeout at 30 s: what notices is cluster.host_silence_s
    plan = two_host_plan(network, tiny_models["llama"], heartbeat_s=30.0, silence_s=2.0)
    daemon = hosted(plan, 3, later=("c",)).wait_ready()
    [worker] = check_host_failure(daemon, lambda: network.link_down("b"), tiny_models["llama"])
    stats = daemon.stats()
    assert stats.hosts_missing == ["b"] and "no word from its kvasird join" in stats.last_failure, stats.last_failure
    network.link_up("b")
    stats = wait_serving_again(daemon.runtime_dir, 3)
    assert stats.stages[2].host == "b" and stats.stages[2].pid != worker
    assert not alive(worker)  # b's follower stopped the worker it ran when the leader went silent
    reference = reference_model(tiny_models["llama"])
    assert one_greedy(daemon.runtime_dir, [4, 8, 15, 16], 10) == hf_greedy(reference, [4, 8, 15, 16], 10)


def test_a_ring_across_three_hosts_matches_generate_and_its_followers_outlive_a_dead_leader(
    network, hosted, tiny_models
):
    """One stage on each host equals generate; then the leader dies: the followers stop
    its workers (the leader is silent), keep waiting, and serve the next leader."""
    daemon = hosted(ring_plan(network, tiny_models["llama"]), 3).wait_ready()
    served_as_generate(daemon, tiny_models["llama"], [1, 5, 12, 30, 64, 3, 20, 47], 11, lambda i: 3 + (i * 5) % 14)
    stats = daemon.stats()
    assert [(s.index, s.host) for s in stats.stages] == [(0, "a"), (1, "b"), (2, "c")]
    workers = [s.pid for s in stats.stages if s.host != "a"]
    daemon.kill_host("a")
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers)  # the followers stopped them (the leader is silent)
    assert all(daemon.processes[host].poll() is None for host in ("b", "c"))  # and wait for a leader
    daemon.start("a")
    daemon.wait_ready()
    reference = reference_model(tiny_models["llama"])
    assert one_greedy(daemon.runtime_dir, [4, 8, 15, 16], 10) == hf_greedy(reference, [4, 8, 15, 16], 10)


def test_prefill_and_decode_pools_on_different_hosts_match_generate(network, hosted, tiny_models):
    """The prefill pool on the leader, the decode pool across b and c, split differently:
    every prefill stage streams its K/V over TCP to the decode stages sharing its layers."""
    stages = "".join(f"[[prefill.stages]]\nlayers = [{a}, {b}]\n" for a, b in [(0, 2), (2, 5), (5, 6)])
    stages += '[[decode.stages]]\nlayers = [0, 4]\nhost = "b"\n[[decode.stages]]\nlayers = [4, 6]\nhost = "c"\n'
    daemon = hosted(MODEL.format(model=tiny_models["llama"]) + hosts_table(network) + stages, 5).wait_ready()
    lengths = [1, 7, 20, 48, 90, 120, 3, 33]
    finals = served_as_generate(daemon, tiny_models["llama"], lengths, 13, lambda i: 1 + (i * 5) % 12)
    handed = [final for final in finals if len(final.token_ids) > 1]  # one that ends at its first token stays
    assert all(f.handoff is not None and f.handoff.kv_bytes > 0 and f.handoff.seconds > 0 for f in handed), [
        (f.handoff, len(f.token_ids)) for f in handed
    ]
    stats = daemon.stats()
    assert [(s.pool, s.host) for s in stats.stages] == [("prefill", "a")] * 3 + [("decode", "b"), ("decode", "c")]
    assert stats.handoff is not None and stats.handoff.count == len(handed) > 0 and stats.handoff.gibps > 0
    stats = settled(daemon.runtime_dir)  # reports made after the last copies and releases
    assert all(s.kv.blocks == 0 and (s.head is None or s.head.handing_off == 0) for s in stats.stages), (
        stats
    )  # both pools freed every request
    assert all(s.handoff is not None and s.handoff.bytes > 0 for s in stats.stages if s.pool == "decode"), [
        (s.index, s.handoff, s.kv.blocks, s.wall_s, s.batches) for s in stats.stages
    ]


def test_expert_shards_on_other_hosts_than_their_stages_match_generate(network, hosted, tiny_models):
    """Qwen3-MoE (top-3, so a token's picks span shards): each stage has one shard on its
    own host and one on another, the rows and partial sums crossing as frames."""
    stages = (
        '[[stages]]\nlayers = [0, 3]\n[[stages.experts]]\nexperts = [0, 4]\nhost = "b"\n'
        "[[stages.experts]]\nexperts = [4, 8]\n"
        '[[stages]]\nlayers = [3, 6]\nhost = "b"\n[[stages.experts]]\nexperts = [0, 5]\nhost = "c"\n'
        "[[stages.experts]]\nexperts = [5, 8]\n"
    )
    daemon = hosted(MODEL.format(model=tiny_models["qwen3_moe"]) + hosts_table(network) + stages, 2).wait_ready()
    served_as_generate(daemon, tiny_models["qwen3_moe"], [1, 6, 19, 40, 3, 27], 17, lambda i: 2 + (i * 5) % 11)
    stats = settled(daemon.runtime_dir)  # reports made after the load
    assert [(s.number, s.stage, s.host) for s in stats.shards] == [(0, 0, "b"), (1, 0, "a"), (2, 1, "c"), (3, 1, "b")]
    assert all(s.dispatches > 0 and s.tokens > 0 for s in stats.shards)  # every shard computed rows
