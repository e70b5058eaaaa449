"""A fleet: several instances of one model behind one bridge. Every path is exact, each
request says which instance served it and why, and the conductor's policies route as
they say (kvasir/bridge/conductor.py)."""

from __future__ import annotations

import asyncio

from tests.integration.test_prefix_cache import finish, one
from tests.support.models import hf_greedy, random_prompts, reference_model

VOCAB = 320
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
