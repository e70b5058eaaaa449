from __future__ import annotations

import pytest
import torch

from kvasir.errors import BatchError
from kvasir.stage.sampling import RequestSampler, Sampler
from kvasir.wire.batch import BatchDescriptor, NewRequest, Row, SamplingParams

VOCAB = 50


def sampler_for(seed=7, eos=(), max_seq_len=1000, **params):
    return RequestSampler(NewRequest(1, SamplingParams(**params), seed), eos, max_seq_len)


def draws(seed, logits, n=40, **params):
    s = sampler_for(seed=seed, **params)
    return [s.pick(logits) for _ in range(n)]


@pytest.fixture
def logits():
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2


def test_greedy_is_argmax(logits):
    assert draws(1, logits, 5, temperature=0) == [int(logits.argmax())] * 5


def test_same_seed_same_output_different_seed_differs(logits):
    a = draws(11, logits, temperature=1.0, top_p=0.95, top_k=30)
    assert a == draws(11, logits, temperature=1.0, top_p=0.95, top_k=30)
    assert a != draws(12, logits, temperature=1.0, top_p=0.95, top_k=30)
    assert len(set(a)) > 1


def test_top_k_limits_choices(logits):
    allowed = set(torch.topk(logits, 3).indices.tolist())
    picked = set(draws(5, logits, 300, temperature=2.0, top_k=3))
    assert picked <= allowed and len(picked) > 1
    assert set(draws(5, logits, 20, temperature=1.5, top_k=1)) == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_nucleus(logits):
    probs = torch.softmax(logits, -1)
    ordered = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(ordered.values, -1)
    need = int((cumulative < 0.6).sum()) + 1  # tokens until the nucleus reaches 0.6
    nucleus = set(ordered.indices[:need].tolist())
    picked = set(draws(9, logits, 400, temperature=1.0, top_p=0.6))
    assert picked <= nucleus and len(picked) > 1
    assert set(draws(9, logits, 20, temperature=1.0, top_p=1e-6)) == {int(logits.argmax())}


def test_greedy_takes_the_first_of_equal_best_tokens():
    tied = torch.zeros(VOCAB)
    tied[[4, 11, 30]] = 2.5
    assert draws(1, tied, 3, temperature=0) == [4] * 3


def test_draws_follow_the_softmax_distribution():
    """Pearson's chi-square over 6,000 draws of one request (each token seeded by its
    index) against the softmax: below 20.5, the 0.1 % critical value at 5 degrees of
    freedom; a masked token (-inf) is never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5])
    probs = torch.softmax(logits.double(), -1)
    picked = draws(21, logits, 6000, temperature=1.0)
    counts = torch.bincount(torch.tensor(picked), minlength=len(logits)).double()
    assert counts[5] == 0
    expected = probs * len(picked)
    possible = expected > 0
    chi_square = float((((counts - expected) ** 2)[possible] / expected[possible]).sum())
    assert chi_square < 20.5, (chi_square, counts.tolist())


def test_temperature_sharpens(logits):
    cold = draws(4, logits, 300, temperature=0.05)
    hot = draws(4, logits, 300, temperature=5.0)
    assert len(set(cold)) < len(set(hot))


def test_finish_reasons():
    s = sampler_for(eos=(2,), max_tokens=3, stop_token_ids=(9,))
    assert s.finish(5, length=10) is None
    assert s.finish(2, length=11) == "stop"
    s = sampler_for(eos=(2,), max_tokens=3, stop_token_ids=(9,))
    assert s.finish(9, length=10) == "stop"
    s = sampler_for(max_tokens=2)
    assert s.finish(5, length=10) is None and s.finish(5, length=11) == "length"
    s = sampler_for(max_tokens=100, max_seq_len=12)
    assert s.finish(5, length=11) is None and s.finish(5, length=12) == "length"
    # ignore_eos runs past the model's EOS ids, but explicit stop ids still stop
    s = sampler_for(eos=(2,), max_tokens=3, stop_token_ids=(9,), ignore_eos=True)
    assert s.finish(2, length=10) is None and s.finish(9, length=11) == "stop"
    s = sampler_for(eos=(2,), max_tokens=2, ignore_eos=True)
    assert s.finish(2, length=10) is None and s.finish(2, length=11) == "length"


def descriptor(rows, new=(), release=()):
    return BatchDescriptor(1, 0, sum(r.num_tokens for r in rows), tuple(rows), tuple(release), tuple(new), 0)


def test_sampler_uses_emitting_rows_and_forgets_finished(logits):
    sampler = Sampler(eos_ids=(), max_seq_len=100)
    new = [NewRequest(i, SamplingParams(temperature=0, max_tokens=1 if i == 1 else 5), 0) for i in (1, 2)]
    rows = [Row(1, 0, 4, (0,), True), Row(2, 0, 3, (1,), False)]
    result = sampler.sample(descriptor(rows, new), logits[None])
    assert [(t.request_id, t.token_id, t.finish) for t in result.tokens] == [(1, int(logits.argmax()), "length")]
    assert len(sampler) == 1
    with pytest.raises(BatchError, match="no sampling spec"):
        sampler.sample(descriptor([Row(1, 4, 1, (), True)]), logits[None])
    with pytest.raises(BatchError, match="1 emitting rows, 2 logits"):
        sampler.sample(descriptor([Row(2, 3, 1, (), True)]), torch.stack([logits, logits]))
    sampler.sample(descriptor([Row(3, 0, 1, (), False)], release=(2,)), torch.empty(0, VOCAB))
    assert len(sampler) == 0


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324, 1e-300, 1e-12])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 1e-300), (3, 0.5)])
def test_tiny_temperatures_pick_the_best_token_instead_of_crashing(logits, temperature, top_k, top_p):
    # logits / 1e-38 overflows float32 to inf and softmax gives NaN: multinomial raised
    picked = draws(3, logits, 10, temperature=temperature, top_k=top_k, top_p=top_p)
    assert picked == [int(logits.argmax())] * 10


@pytest.mark.parametrize("temperature", [1e300, 1.7976931348623157e308])
def test_huge_temperatures_draw_from_a_flat_distribution(logits, temperature):
    picked = draws(3, logits, 200, temperature=temperature)
    assert all(0 <= t < VOCAB for t in picked) and len(set(picked)) > 20


def test_non_finite_logits_fall_back_to_the_best_finite_token():
    bad = torch.zeros(VOCAB)
    bad[7] = 3.0
    bad[2] = float("nan")
    for params in ({"temperature": 0}, {"temperature": 0.7}, {"temperature": 1e-38, "top_p": 0.5}):
        assert sampler_for(**params).pick(bad) == 7
    bad[9] = float("inf")
    assert sampler_for(temperature=0.7).pick(bad) == 9


def test_logprobs_are_the_models_own_and_only_when_asked(logits):
    sampler = Sampler(eos_ids=(), max_seq_len=100)
    new = [
        NewRequest(1, SamplingParams(temperature=0.7, logprobs=3), 5),
        NewRequest(2, SamplingParams(temperature=0), 5),
        NewRequest(3, SamplingParams(temperature=0, logprobs=0), 5),
    ]
    rows = [Row(k, 0, 2, (k,), True) for k in (1, 2, 3)]
    noisy = logits.clone()
    noisy[7] = float("nan")
    scored, plain, chosen_only = sampler.sample(descriptor(rows, new), torch.stack([logits, logits, noisy])).tokens
    expected = torch.log_softmax(logits, dim=-1)  # before the temperature: the model's distribution
    assert scored.logprob == pytest.approx(float(expected[scored.token_id]), abs=1e-5)
    best = torch.topk(expected, 3)
    assert [t for t, _ in scored.top] == best.indices.tolist()
    assert [v for _, v in scored.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert (plain.logprob, plain.top) == (0.0, ())
    assert (
        chosen_only.top == () and chosen_only.logprob <= 0.0 and chosen_only.logprob == chosen_only.logprob
    )  # not NaN


def test_prompt_chunks_are_scored_token_by_token_and_the_last_position_is_sampled():
    sampler = Sampler(eos_ids=(), max_seq_len=100)
    prompt = (4, 9, 1, 7, 3)
    new = NewRequest(1, SamplingParams(temperature=0, prompt_logprobs=2), 5, prompt=prompt)
    table = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5))
    first = descriptor([Row(1, 0, 3, (0,), False)], [new])
    assert sampler.scored(first) == (1,)
    assert sampler.sample(first, table[:3]).tokens == ()  # three scored positions, nothing emitted
    [chunk] = sampler.take_prompt_scores()
    expected = torch.log_softmax(table, dim=-1)
    assert (chunk.first, chunk.token_ids) == (1, prompt[1:4])
    assert list(chunk.logprobs) == pytest.approx([float(expected[k, prompt[k + 1]]) for k in range(3)], abs=1e-5)
    assert [len(top) for top in chunk.top] == [2, 2, 2]
    assert chunk.top[0][0][0] == int(expected[0].argmax())
    last = descriptor([Row(1, 3, 2, (), True)])
    assert sampler.scored(last) == (1,)
    emitted = torch.cat([table[5:6], table[3:5]])  # the emitting row's logits first, then the scored tokens
    [token] = sampler.sample(last, emitted).tokens
    assert token.token_id == int(table[5].argmax())
    [tail] = sampler.take_prompt_scores()
    assert (tail.first, tail.token_ids) == (4, (3,))  # position 4 (the last prompt token) from position 3's logits
    assert tail.logprobs[0] == pytest.approx(float(expected[3, 3]), abs=1e-5)
    assert sampler.scored(descriptor([Row(1, 5, 1, (), True)])) == ()  # decode rows are never scored
    with pytest.raises(BatchError, match="emitting rows"):
        wrong = descriptor([Row(1, 5, 1, (), True)])
        sampler.scored(wrong)
        sampler.sample(wrong, table[:3])
