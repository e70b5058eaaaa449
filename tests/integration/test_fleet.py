"""A fleet: several instances of one model behind one bridge. Every path is exact, each
request says which instance served it and why, and the conductor's policies route as
they say (kvasir/bridge/conductor.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

from kvasir.client import AsyncClient, Client
from kvasir.wire.client import ErrorEvent, Finished
from tests.integration.test_prefix_cache import finish, one
from tests.support.daemon import BIN, settled
from tests.support.models import hf_greedy, random_prompts, reference_model

VOCAB = 320
TEXT = {"capture_output": True, "text": True, "check": True, "timeout": 60}
TWO = {"a": [(0, 3), (3, 6)], "b": [(0, 2), (2, 4), (4, 6)]}  # the instances split the layers differently


def test_two_colocated_instances_are_each_exact(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["qwen2"], TWO, route="round_robin", max_tokens=8, block_size=4).wait_ready()
    model = reference_model(tiny_models["qwen2"])
    prompts = random_prompts(VOCAB, [9, 14, 5, 21, 11, 17], seed=41)
    ends = asyncio.run(finish(daemon.runtime_dir, prompts, 10))
    for prompt, end in zip(prompts, ends, strict=True):
        assert end.token_ids == hf_greedy(model, prompt, 10), end.instances
        assert end.route == "round_robin"
    assert sorted(end.instances[0] for end in ends) == ["a", "a", "a", "b", "b", "b"]
    with daemon.client() as client:
        stages = client.stats().stages
    assert [(s.index, s.instance) for s in stages] == [(0, "a"), (1, "a"), (2, "b"), (3, "b"), (4, "b")]
    assert {s.instance for s in stages if s.head is not None} == {"a", "b"}  # each instance its own head
    shown = subprocess.run([str(BIN / "kvasir"), "stats", "--runtime-dir", str(daemon.runtime_dir)], **TEXT)
    table = [line.split() for line in shown.stdout.splitlines() if line.split()[:1] in (["a"], ["b"])]
    assert [row[:4] + row[5:6] for row in table] == [
        ["a", "-", "serving", "0,1", "3"],
        ["b", "-", "serving", "2,3,4", "3"],
    ]
    body = json.loads(
        subprocess.run(
            [str(BIN / "kvasir"), "stats", "--json", "--runtime-dir", str(daemon.runtime_dir)], **TEXT
        ).stdout
    )
    assert [(i["name"], i["routed"], i["requests"], i["restarts"]) for i in body["instances"]] == [
        ("a", 3, 0, 0),
        ("b", 3, 0, 0),
    ]


def test_cache_aware_routing_sends_a_shared_prefix_back_to_its_cache(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], TWO, max_tokens=8, block_size=4).wait_ready()
    model = reference_model(tiny_models["llama"])
    system, *questions = random_prompts(VOCAB, [24, 3, 4, 5, 6], seed=43)
    first = one(daemon.runtime_dir, system + questions[0])
    home = first.instances[0]
    assert first.route.startswith("cache_aware: 0 of 27 prompt tokens cached")
    for question in questions[1:]:  # one at a time: each finds the blocks the ones before registered
        end = one(daemon.runtime_dir, system + question)
        assert end.instances == [home] and end.usage.cached_tokens == 24, (end.instances, end.route)
        assert end.token_ids == hf_greedy(model, system + question, 8)
    others = random_prompts(VOCAB, [26, 25], seed=44)  # while the home instance is busy, new prompts go elsewhere
    ends = asyncio.run(finish(daemon.runtime_dir, [system + questions[0], *others], 8))
    assert ends[0].instances == [home] and ends[0].usage.cached_tokens == 24
    assert {end.instances[0] for end in ends[1:]} != {home}
    for prompt, end in zip([system + questions[0], *others], ends, strict=True):
        assert end.token_ids == hf_greedy(model, prompt, 8)


def test_a_failure_stays_inside_its_instance(tiny_models, start_daemon):
    """A stage of instance a is killed under load: a's requests fail naming it, b's all
    finish exactly, new requests go to b while a restarts, and then a serves again."""
    daemon = start_daemon(tiny_models["llama"], TWO, route="round_robin", max_tokens=8).wait_ready()
    model = reference_model(tiny_models["llama"])
    prompts = random_prompts(VOCAB, [6, 7, 8, 9, 10, 11], seed=45)
    with daemon.client() as client:
        a_tail = next(s.pid for s in client.stats().stages if s.index == 1)

    async def run() -> tuple[list, list]:
        async with await AsyncClient.connect(daemon.runtime_dir) as client:
            streams = [
                await client.submit(token_ids=p, max_tokens=120, temperature=0, ignore_eos=True) for p in prompts
            ]
            events: list[list] = [[] for _ in prompts]

            async def collect(i, stream):
                async for event in stream:
                    events[i].append(event)

            tasks = [asyncio.create_task(collect(i, s)) for i, s in enumerate(streams)]
            while sum(len(e) for e in events) < len(prompts) + 12:  # tokens flow on both instances
                await asyncio.sleep(0.02)
            os.kill(a_tail, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            during = [
                await (await client.submit(token_ids=p, max_tokens=4, temperature=0)).result() for p in prompts[:3]
            ]
            return events, during

    events, during = asyncio.run(run())
    ends = [evs[-1] for evs in events]
    for prompt, end in zip(prompts, ends, strict=True):
        if isinstance(end, Finished):
            reference = hf_greedy(model, prompt, 120)  # it may stop at EOS, where the request went on
            assert end.instances == ["b"] and end.token_ids[: len(reference)] == reference
        else:
            assert isinstance(end, ErrorEvent) and end.code == "stage_failed", end
            assert "instance a is restarting" in end.message and "stage-1" in end.message
    assert sum(isinstance(end, Finished) for end in ends) == 3  # round robin: b had every other request
    assert all(isinstance(end, Finished) for end in during), during  # while a restarts, b serves them
    stats = instance_back(daemon, "a")
    a, b = stats.instances
    assert (a.name, a.restarts, b.restarts) == ("a", 1, 0) and "stage-1" in (a.last_failure or "")
    ends = asyncio.run(finish(daemon.runtime_dir, prompts[:4], 6))
    assert sorted(end.instances[0] for end in ends) == ["a", "a", "b", "b"]  # a serves again
    for prompt, end in zip(prompts, ends):
        assert end.token_ids == hf_greedy(model, prompt, 6)


def instance_back(daemon, name: str, timeout_s: float = 120.0):
    """The daemon's stats once instance ``name`` serves again after a restart."""
    deadline = time.monotonic() + timeout_s
    while True:
        with Client(daemon.runtime_dir) as client:
            stats = client.stats()
        state = next(i for i in stats.instances if i.name == name)
        if state.state == "serving" and state.restarts >= 1 or time.monotonic() > deadline:
            assert state.state == "serving", stats.instances
            return stats
        time.sleep(0.2)


XPYD = {  # two prefill and two decode instances, each splitting the layers its own way
    "prefill.p0": [(0, 3), (3, 6)],
    "prefill.p1": [(0, 2), (2, 6)],
    "decode.d0": [(0, 4), (4, 6)],
    "decode.d1": [(0, 1), (1, 3), (3, 6)],
}


def test_two_prefill_by_two_decode_instances_are_exact_on_every_pair(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], XPYD, route="round_robin", max_tokens=16).wait_ready()
    model = reference_model(tiny_models["llama"])
    prompts = random_prompts(VOCAB, [12, 30, 7, 19, 25, 9, 14, 21], seed=47)
    ends = asyncio.run(finish(daemon.runtime_dir, prompts, 10))
    pairs = set()
    for prompt, end in zip(prompts, ends, strict=True):
        assert end.token_ids == hf_greedy(model, prompt, 10), end.instances
        if len(end.token_ids) > 1:  # one that ends at its first token never reaches a decode instance
            assert end.instances[0] in ("p0", "p1") and end.instances[1] in ("d0", "d1")
            assert end.handoff is not None and end.handoff.kv_bytes > 0
        pairs.add(tuple(end.instances))
    assert {pair[0] for pair in pairs} == {"p0", "p1"} and {pair[1] for pair in pairs if len(pair) > 1} == {"d0", "d1"}
    stats = settled(daemon.runtime_dir)
    assert [(i.name, i.pool, i.state) for i in stats.instances] == [
        ("p0", "prefill", "serving"),
        ("p1", "prefill", "serving"),
        ("d0", "decode", "serving"),
        ("d1", "decode", "serving"),
    ]
    assert all(i.routed > 0 and i.requests == 0 for i in stats.instances), stats.instances
    assert all(s.kv.blocks == 0 and (s.head is None or s.head.handing_off == 0) for s in stats.stages), stats.stages
