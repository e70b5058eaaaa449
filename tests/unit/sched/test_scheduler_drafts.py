"""Rows that carry several tokens: a decode row with drafts, the tail keeping those the model
confirms, and the rejected ones' K/V rolled back (the head's next row overwrites it on
every stage). Driven through the in-process chain: the real scheduler, stages and sampler."""

from __future__ import annotations

import pytest
import torch

from kvasir.errors import BatchError, RequestError
from kvasir.model.kv_cache import flat_slots
from kvasir.stage.chain import Chain
from kvasir.wire.batch import SamplingParams
from kvasir.wire.head import BatchResult
from tests.support.models import hf_greedy, random_prompts
from tests.support.models import reference_model as reference

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture
def chains(tiny_models, plan_for):
    """Two chains on one plan: the plain ring's path, and one that gets drafts."""
    plan, source = plan_for(tiny_models["llama"], [(0, 3), (3, 6)], inflight=1, block_size=4, num_blocks=64)
    return Chain(plan, source), Chain(plan, source), source


def steps_until(chain: Chain, tokens: int, outputs: list[int]) -> list:
    """Step until ``outputs`` holds ``tokens`` tokens; the events of the last step."""
    events: list = []
    for _ in range(100):
        if len(outputs) >= tokens:
            return events
        events = chain.step()
        outputs += [e.token_id for e in events if e.token_id is not None]
    raise AssertionError(f"no {tokens} tokens after 100 steps: {outputs}")


def kv(chain: Chain, request_id: int, positions: int) -> list[torch.Tensor]:
    """Every stage's keys and values at a request's first ``positions`` positions."""
    out = []
    for stage in chain.stages:
        table = stage.cache.table(request_id)
        slots = flat_slots(request_id, table, stage.cache.block_size, 0, positions)
        out += [stage.cache.keys[:, slots].clone(), stage.cache.values[:, slots].clone()]
    return out


def test_a_row_of_four_drafts_emits_the_two_confirmed_and_one_more_and_rolls_back_the_rest(chains, tiny_models):
    plain, drafted, source = chains
    prompt = random_prompts(source.vocab_size, [9], seed=3)[0]
    expected = hf_greedy(reference(tiny_models["llama"]), prompt, GREEDY.max_tokens)
    assert len(expected) == GREEDY.max_tokens  # random weights: no early EOS, so every position is checked
    first, second = plain.submit(prompt, GREEDY), drafted.submit(prompt, GREEDY)
    out_plain: list[int] = []
    out_drafted: list[int] = []
    steps_until(drafted, 1, out_drafted)  # the prompt, and the first token
    wrong = [t for t in range(3, source.vocab_size) if t not in expected[3:5]][:2]
    drafted.scheduler.propose(second, [expected[1], expected[2], *wrong])  # two right, two wrong

    events = steps_until(drafted, 2, out_drafted)
    assert [(e.index, e.token_id) for e in events] == [(1, expected[1]), (2, expected[2]), (3, expected[3])]
    state = drafted.scheduler.running[second]
    assert state.computed == len(prompt) + 3  # prompt, token 0 and the two confirmed drafts: K/V that stands
    assert state.length == len(prompt) + 4 and state.drafted == 0
    assert state.registered * 4 <= state.computed  # no block with a rejected draft's K/V went into the prefix cache

    steps_until(plain, 4, out_plain)  # the plain path to the same tokens
    confirmed = len(prompt) + 3
    for a, b in zip(kv(plain, first, confirmed), kv(drafted, second, confirmed)):
        # every stage: the confirmed positions' K/V as the plain path wrote it (to rounding:
        # five positions in one product, not one by one)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)

    steps_until(plain, 5, out_plain)  # writes position ``confirmed`` from the true token 3
    stale = kv(drafted, second, confirmed + 1)[0][:, confirmed]  # a rejected draft's there
    assert not torch.allclose(stale, kv(plain, first, confirmed + 1)[0][:, confirmed], rtol=1e-2, atol=1e-2)
    steps_until(drafted, 5, out_drafted)  # the next row starts at the first rejected position
    for a, b in zip(kv(plain, first, confirmed + 1), kv(drafted, second, confirmed + 1)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)  # the rejected draft's K/V overwritten on every stage
    for chain, rid, outputs in ((plain, first, out_plain), (drafted, second, out_drafted)):
        outputs += chain.run()[rid].token_ids
    assert out_drafted == out_plain == expected


def test_drafts_fit_the_output_left_and_are_checked(chains):
    _, chain, source = chains
    rid = chain.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    outputs: list[int] = []
    steps_until(chain, 1, outputs)
    chain.scheduler.propose(rid, [9, 9, 9, 9])
    batch = chain.scheduler.next_batch()
    assert batch is not None
    [row] = batch.descriptor.rows
    assert row.draft == (9,) and row.samples == 2 and row.num_tokens == 2  # 3 tokens at most: 1 out, 2 left
    with pytest.raises(RequestError, match="below"):
        chain.scheduler.propose(rid, [source.vocab_size])
    with pytest.raises(RequestError, match="not running"):
        chain.scheduler.propose(12345, [5])
    result = BatchResult(batch.descriptor.batch_id, ())
    tokens = chain.sampler.sample(batch.descriptor, chain.forward(batch)).tokens
    assert 1 <= len(tokens) <= 2
    too_many = BatchResult(result.batch_id, tokens + tokens[:1] * (3 - len(tokens)))
    with pytest.raises(BatchError, match="past their drafts"):
        chain.scheduler.complete(too_many)
