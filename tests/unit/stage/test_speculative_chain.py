"""Speculative decoding through the in-process chain (the real scheduler, stages, KV
caches and sampler): greedy output with prompt-lookup or draft-model drafts is Hugging
Face's greedy output, and seeded sampled output is the output without drafts, on a model
whose drafts are mostly confirmed (it loops, or drafts for itself), on random models
where most are not (so most rows roll K/V back), and with experts on shards."""

from __future__ import annotations

import msgspec
import pytest

from kvasir.config.speculative import SpeculativeSpec
from kvasir.stage.chain import Chain
from kvasir.wire.batch import SamplingParams
from tests.support.models import hf_greedy, random_prompts
from tests.support.models import reference_model as reference

SPLITS = [(0, 2), (2, 4), (4, 6)]
SHARDS = {0: [(0, 3), (3, 8)]}
NGRAM = SpeculativeSpec(method="ngram", num_tokens=4, ngram_min=1)


def speculative(plan, spec=NGRAM):
    return msgspec.structs.replace(plan, speculative=spec)


def run(plan, source, prompts, params) -> tuple[list[list[int]], Chain]:
    chain = Chain(plan, source)
    ids = [chain.submit(p, params) for p in prompts]
    done = chain.run()
    return [done[rid].token_ids for rid in ids], chain


@pytest.mark.parametrize("family", ["llama-loop", "llama", "qwen2", "mixtral"])
def test_greedy_output_with_drafts_is_hf_greedy_output(tiny_models, plan_for, family):
    experts = SHARDS if family == "mixtral" else None
    plan, source = plan_for(tiny_models[family], SPLITS, max_rows=4, max_tokens=24, inflight=2, experts=experts)
    texts = random_prompts(source.vocab_size, [5, 12, 30, 3, 17], seed=4)
    texts = [t + t[:4] for t in texts]  # the prompt's start recurs: lookup finds something to propose
    outputs, chain = run(speculative(plan), source, texts, SamplingParams(temperature=0, max_tokens=30))
    model = reference(tiny_models[family])
    assert outputs == [hf_greedy(model, t, 30)[: len(out)] for t, out in zip(texts, outputs)]
    assert all(len(out) == 30 or out[-1] in source.eos_token_ids for out in outputs)
    totals = chain.sampler.totals
    assert totals.drafted > 0
    if family == "llama-loop":
        assert totals.accepted > totals.drafted / 2 and totals.tokens > 2 * totals.rows  # fewer passes than tokens


@pytest.mark.parametrize(("family", "draft"), [("llama-loop", "llama-loop"), ("llama", "llama-draft")])
def test_a_draft_models_greedy_drafts_leave_greedy_output_as_hf_gives_it(tiny_models, plan_for, family, draft):
    plan, source = plan_for(tiny_models[family], SPLITS, max_rows=4, max_tokens=24, inflight=2)
    spec = SpeculativeSpec(method="draft", draft_model=str(tiny_models[draft]), num_tokens=3)
    texts = random_prompts(source.vocab_size, [5, 12, 30, 3], seed=7)
    outputs, chain = run(speculative(plan, spec), source, texts, SamplingParams(temperature=0, max_tokens=20))
    model = reference(tiny_models[family])
    assert outputs == [hf_greedy(model, t, 20)[: len(out)] for t, out in zip(texts, outputs)]
    totals = chain.sampler.totals
    assert totals.drafted > 0
    if family == draft:  # a model drafting for itself is always right
        assert totals.accepted == totals.drafted
    sampled = SamplingParams(temperature=0.9, seed=4, max_tokens=20)
    assert run(speculative(plan, spec), source, texts, sampled)[0] == run(plan, source, texts, sampled)[0]


@pytest.mark.parametrize("family", ["llama-loop", "llama"])
def test_seeded_sampling_with_drafts_is_the_output_without_them(tiny_models, plan_for, family):
    plan, source = plan_for(tiny_models[family], SPLITS[:1] + [(2, 6)], max_rows=4, max_tokens=24, inflight=1)
    texts = random_prompts(source.vocab_size, [6, 14, 9], seed=5)
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=24, repetition_penalty=1.05)
    without, _ = run(plan, source, texts, params)
    with_drafts, chain = run(speculative(plan), source, texts, params)
    assert with_drafts == without
    assert chain.sampler.totals.drafted > 0


def test_a_full_batch_backs_off_and_the_output_is_the_same(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["llama-loop"], SPLITS, max_rows=8, max_tokens=64, inflight=1)
    texts = random_prompts(source.vocab_size, [4] * 6, seed=6)
    params = SamplingParams(temperature=0, max_tokens=12)
    tight = speculative(plan, msgspec.structs.replace(NGRAM, max_rows=3))
    outputs, chain = run(tight, source, texts, params)
    assert outputs == run(plan, source, texts, params)[0]
    counts = chain.scheduler.speculation.counters()
    assert counts.full_rows > 0 and chain.sampler.totals.drafted == 0  # six decode rows a batch: never drafted
