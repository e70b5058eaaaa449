"""The draft model's own bookkeeping (kvasir/stage/drafting.py): a long prompt is caught
up on over several calls, drafts the ring rejected are recomputed, a full cache means no
drafts, and a forgotten request gives its blocks back. Driven with real scheduler
states and the tiny draft model through the real loader."""

from __future__ import annotations

import torch

from kvasir.sched.requests import RequestState
from kvasir.stage.drafting import CATCH_UP, ModelDrafter
from kvasir.wire.batch import SamplingParams
from tests.support.models import hf_greedy, random_prompts, reference_model


def state(rid: int, prompt: list[int], output: list[int]) -> RequestState:
    return RequestState(rid, prompt, SamplingParams(temperature=0), 0, 1, output=output)


def drafter(tiny_models, plan_for, num_blocks=300) -> ModelDrafter:
    plan, _ = plan_for(tiny_models["llama"], [(0, 3), (3, 6)], max_seq_len=1024, block_size=4, num_blocks=num_blocks)
    from kvasir.model.source import resolve_source

    return ModelDrafter(resolve_source(str(tiny_models["llama-draft"])), plan, torch.device("cpu"))


def test_drafts_are_the_draft_models_greedy_continuation_and_survive_rejection(tiny_models, plan_for):
    model = reference_model(tiny_models["llama-draft"])
    prompt = random_prompts(320, [9], seed=2)[0]
    expected = hf_greedy(model, prompt, 6)
    d = drafter(tiny_models, plan_for)
    first = state(1, prompt[:-1], [prompt[-1]])  # its prompt, and the token the ring gave it
    assert d.propose([(first, 4)]) == {1: hf_greedy(model, prompt, 4)}
    wrong = (expected[0] + 1) % 320
    rejected = state(1, prompt[:-1], [prompt[-1], wrong])  # the ring took another token: K/V after it is stale
    assert d.propose([(rejected, 3)]) == {1: hf_greedy(model, [*prompt, wrong], 3)}
    both = [(state(1, prompt[:-1], [prompt[-1], wrong]), 2), (state(2, prompt, []), 5)]
    assert d.propose(both)[2] == hf_greedy(model, prompt, 5)  # rows of different lengths, in one pass each


def test_a_long_prompt_is_caught_up_on_over_several_calls(tiny_models, plan_for):
    prompt = random_prompts(320, [2 * CATCH_UP + 10], seed=3)[0]
    d = drafter(tiny_models, plan_for)
    request = state(7, prompt, [])
    assert d.propose([(request, 3)]) == {}
    assert d.propose([(request, 3)]) == {}
    assert d.propose([(request, 3)]) == {7: hf_greedy(reference_model(tiny_models["llama-draft"]), prompt, 3)}


def test_no_room_no_drafts_and_a_forgotten_request_gives_its_blocks_back(tiny_models, plan_for):
    d = drafter(tiny_models, plan_for, num_blocks=256)  # 1,024 tokens: one long request all but fills it
    long, short = random_prompts(320, [1018, 5], seed=4)
    assert d.propose([(state(1, long, []), 2)]) == {}  # catching up, its blocks taken
    assert d.propose([(state(2, short, []), 4)]) == {}  # none left for another
    d.forget(1)
    assert d.blocks.free == 256 and d.cache.requests == 0
    assert len(d.propose([(state(2, short, []), 4)])[2]) == 4
