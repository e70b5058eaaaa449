"""The in-process chain against the unsplit Hugging Face model (the reference)."""

from __future__ import annotations

import pytest
import torch

from kvasir.stage.chain import Chain, record
from kvasir.wire.batch import SamplingParams
from tests.support.models import MOE_FAMILIES, hf_greedy, random_prompts
from tests.support.models import reference_model as reference

SPLITS = {2: [(0, 3), (3, 6)], 3: [(0, 1), (1, 4), (4, 6)]}
LENGTHS = [1, 7, 33, 120, 2, 64, 15, 101, 5, 48]


def prompts(vocab, lengths=LENGTHS, seed=1):
    return random_prompts(vocab, lengths, seed)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", *MOE_FAMILIES])
@pytest.mark.parametrize("stages", [2, 3])
def test_greedy_tokens_match_hf_generate(tiny_models, plan_for, family, stages):
    # 32-token batches split the 120-token prompt into four chunks; 80 blocks of 4 tokens
    # hold only a few requests at once, so later ones wait and reuse released blocks.
    plan, source = plan_for(tiny_models[family], SPLITS[stages], max_rows=6, max_tokens=32, inflight=3, num_blocks=80)
    seen = []
    chain = Chain(plan, source, trace=seen.append)
    texts = prompts(source.vocab_size)
    budgets = [5 + 3 * i for i in range(len(texts))]
    ids = [chain.submit(p, SamplingParams(temperature=0, max_tokens=n)) for p, n in zip(texts[:5], budgets)]
    outputs = {}
    for _ in range(4):  # the first requests are running when the rest join
        for event in chain.step():
            record(outputs, event)
    assert outputs, "the first requests should be decoding before the others join"
    ids += [chain.submit(p, SamplingParams(temperature=0, max_tokens=n)) for p, n in zip(texts[5:], budgets[5:])]
    chain.run(outputs)
    model = reference(tiny_models[family])
    for rid, text, budget in zip(ids, texts, budgets):
        expected = hf_greedy(model, text, budget)
        assert outputs[rid].token_ids == expected, f"request {rid} ({len(text)} prompt tokens)"
        assert outputs[rid].finish == ("length" if len(expected) == budget else "stop")
    long_rows = [r for d in seen for r in d.rows if r.request_id == ids[3]]
    chunks = [r for r in long_rows if r.start < 120]
    assert len(chunks) >= 4 and sum(r.num_tokens for r in chunks) == 120  # several prefill chunks
    assert [r.emit for r in chunks] == [False] * (len(chunks) - 1) + [True]
    assert any(len(d.rows) > 1 and {r.num_tokens == 1 for r in d.rows} == {True, False} for d in seen), (
        "some batch should mix decode rows with a prefill chunk"
    )
    assert max(len(d.rows) for d in seen) <= 6 and max(d.num_tokens for d in seen) <= 32
    # every request ended; the cache tables of the stages hold nothing once releases travel
    chain.submit([5], SamplingParams(temperature=0, max_tokens=1))
    chain.run()
    assert all(stage.cache.requests <= 1 for stage in chain.stages)


def test_sliding_window_attention_matches_hf_generate(tiny_models, plan_for):
    # an 8-token window: prompts and outputs run well past it, in chunks and in decode
    plan, source = plan_for(tiny_models["mistral-window"], SPLITS[2], max_rows=4, max_tokens=16)
    chain = Chain(plan, source)
    texts = prompts(source.vocab_size, [1, 5, 17, 40, 3])
    ids = [chain.submit(t, SamplingParams(temperature=0, max_tokens=20)) for t in texts]
    done = chain.run()
    model = reference(tiny_models["mistral-window"])
    for rid, text in zip(ids, texts):
        assert done[rid].token_ids == hf_greedy(model, text, 20)


@pytest.mark.parametrize("family", ["llama", "qwen2", *MOE_FAMILIES])
def test_logits_allclose_to_unsplit_model(tiny_models, plan_for, family):
    plan, source = plan_for(tiny_models[family], SPLITS[3], max_rows=4, max_tokens=24, inflight=1)
    chain = Chain(plan, source)
    model = reference(tiny_models[family])
    sequences = {}
    for text in prompts(source.vocab_size, [1, 30, 9, 55]):
        sequences[chain.submit(text, SamplingParams(temperature=0, max_tokens=6))] = list(text)
    checked = 0
    while not chain.idle:
        batch = chain.scheduler.next_batch()
        logits = chain.forward(batch)
        emitting = [r for r in batch.descriptor.rows if r.emit]
        for row, row_logits in zip(emitting, logits, strict=True):
            sequence = sequences[row.request_id]
            assert row.start + row.num_tokens == len(sequence)
            with torch.no_grad():
                expected = model(torch.tensor([sequence])).logits[0, -1]
            torch.testing.assert_close(row_logits, expected, atol=1e-4, rtol=1e-4)
            checked += 1
        for event in chain.scheduler.complete(chain.sampler.sample(batch.descriptor, logits)):
            sequences[event.request_id].append(event.token_id)
    produced = sum(len(seq) for seq in sequences.values()) - (1 + 30 + 9 + 55)
    assert checked == produced  # every sampled token was checked


# uneven ranges, one shard holding a single expert; the 3-stage split's middle stage runs its own
SHARDS = {0: [(0, 1), (1, 6), (6, 8)], 2: [(0, 5), (5, 8)]}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_shards_match_hf_generate_and_the_unsplit_logits(tiny_models, plan_for, family):
    """Stages whose experts live on shards (in this process here): greedy tokens as HF's
    generate, every sampled step's logits within 1e-4 of the unsplit model's."""
    plan, source = plan_for(tiny_models[family], SPLITS[3], max_rows=4, max_tokens=24, experts=SHARDS)
    chain = Chain(plan, source)
    model = reference(tiny_models[family])
    texts = prompts(source.vocab_size, [1, 30, 9, 55, 4])
    ids = [chain.submit(t, SamplingParams(temperature=0, max_tokens=8)) for t in texts]
    sequences = dict(zip(ids, (list(t) for t in texts)))
    while not chain.idle:
        batch = chain.scheduler.next_batch()
        logits = chain.forward(batch)
        for row, row_logits in zip([r for r in batch.descriptor.rows if r.emit], logits, strict=True):
            with torch.no_grad():
                expected = model(torch.tensor([sequences[row.request_id]])).logits[0, -1]
            torch.testing.assert_close(row_logits, expected, atol=1e-4, rtol=1e-4)
        for event in chain.scheduler.complete(chain.sampler.sample(batch.descriptor, logits)):
            sequences[event.request_id].append(event.token_id)
    for rid, text in zip(ids, texts):
        assert sequences[rid][len(text) :] == hf_greedy(model, text, 8)
    head, middle, tail = chain.stages
    assert head.dispatch.seconds > 0 and middle.dispatch.seconds == 0  # the middle stage runs its own experts
    load = head.expert_load()
    assert len(load) == 8 and sum(load) > 0 and middle.expert_load()


def test_seeded_sampling_is_reproducible_and_independent_of_batching(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["llama"], SPLITS[2], max_rows=4, max_tokens=16)
    texts = prompts(source.vocab_size, [12, 40, 3, 25])
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=12)

    def run(batch_with_others):
        chain = Chain(plan, source)
        rid = chain.submit(texts[0], params)
        if batch_with_others:
            for i, text in enumerate(texts[1:]):
                chain.submit(text, SamplingParams(temperature=1.0, seed=i, max_tokens=9))
        return chain.run()[rid].token_ids

    alone = run(False)
    assert alone == run(False)
    assert alone == run(True)
    other_seed = Chain(plan, source)
    rid = other_seed.submit(texts[0], SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=99, max_tokens=12))
    assert other_seed.run()[rid].token_ids != alone


def test_cancel_mid_stream_frees_blocks_and_others_continue(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["llama"], SPLITS[2], max_rows=4, max_tokens=16, inflight=2)
    chain = Chain(plan, source)
    texts = prompts(source.vocab_size, [20, 6])
    victim = chain.submit(texts[0], SamplingParams(temperature=0, max_tokens=30))
    keeper = chain.submit(texts[1], SamplingParams(temperature=0, max_tokens=8))
    outputs = {}
    for _ in range(3):
        for event in chain.step():
            record(outputs, event)
    assert victim in outputs and outputs[victim].finish is None
    immediate = chain.cancel(victim)
    if immediate is not None:
        record(outputs, immediate)
    chain.run(outputs)
    assert outputs[victim].finish == "cancelled"
    assert len(outputs[victim].token_ids) < 30
    assert outputs[keeper].token_ids == hf_greedy(reference(tiny_models["llama"]), texts[1], 8)
    assert chain.scheduler.cache.available == plan.kv.num_blocks
