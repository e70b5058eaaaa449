"""The tail's logits processing (kvasir/stage/logits.py) against references: Hugging Face's
logits processors where they mean the same (repetition penalty, min_p, bad words, min
new tokens, sequence bias), and vLLM's formula written out for the presence and frequency
penalties. Exact: same floats, not approximately."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from kvasir.errors import RequestError
from kvasir.sched.validation import check_sampling
from kvasir.stage.logits import LogitsShaper, keep_min_p
from kvasir.stage.sampling import RequestSampler
from kvasir.wire.batch import NewRequest, SamplingParams

VOCAB = 64
PROMPT = (3, 5, 5, 8, 13)
OUTPUT = (21, 5, 21, 21, 34, 2)


@pytest.fixture
def logits():
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(11)) * 3


def shaped(logits, generated=6, stops=frozenset({2}), **params):  # 6: all of OUTPUT
    shaper = LogitsShaper(SamplingParams(**params), stops, PROMPT, OUTPUT)
    return shaper.shape(logits, generated)


def hf(processor, logits, ids):
    return processor(torch.tensor([list(ids)]), logits[None].clone())[0]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_hugging_faces_over_prompt_and_output(logits, penalty):
    expected = hf(RepetitionPenaltyLogitsProcessor(penalty), logits, PROMPT + OUTPUT)
    assert torch.equal(shaped(logits, repetition_penalty=penalty), expected)


def test_presence_and_frequency_penalties_are_vllms_over_the_output(logits):
    expected = logits.clone()
    for tok in set(OUTPUT):
        expected[tok] -= 0.4 * OUTPUT.count(tok) + 0.9  # vLLM: frequency x count, presence once
    got = shaped(logits, frequency_penalty=0.4, presence_penalty=0.9)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(
        got[[t for t in range(VOCAB) if t not in OUTPUT]], logits[[t for t in range(VOCAB) if t not in OUTPUT]]
    )


def test_min_p_is_hugging_faces(logits):
    scores = logits.double() / 0.7
    expected = MinPLogitsWarper(0.1)(torch.zeros(1, 1, dtype=torch.long), scores[None].clone())[0]
    assert torch.equal(keep_min_p(scores, 0.1), expected)
    assert keep_min_p(scores, 0.0) is scores


def test_bad_words_are_hugging_faces_over_the_output(logits):
    words = ((7,), (34, 9), (21, 10), (1, 2, 3))  # (34, 9): the output ends with 34 ... then 2, so 9 stays
    expected = hf(NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=[]), logits, OUTPUT)
    got = shaped(logits, bad_words=words)
    assert torch.equal(got, expected) and got[7] == float("-inf") and torch.isfinite(got[9])
    ending = LogitsShaper(SamplingParams(bad_words=((2, 9),)), frozenset(), (), OUTPUT).shape(logits, 6)
    assert ending[9] == float("-inf")  # the output ends with 2: 9 is barred next


def test_min_tokens_bars_every_stop_token_until_reached(logits):
    expected = hf(MinNewTokensLengthLogitsProcessor(len(PROMPT), 8, [2, 40]), logits, PROMPT + OUTPUT)
    assert torch.equal(shaped(logits, stops=frozenset({2, 40}), min_tokens=8), expected)
    assert torch.equal(shaped(logits, generated=8, stops=frozenset({2, 40}), min_tokens=8), logits)


def test_logit_bias_is_hugging_faces_sequence_bias(logits):
    bias = ((4, 5.5), (60, -100.0))
    expected = hf(SequenceBiasLogitsProcessor({(4,): 5.5, (60,): -100.0}), logits, PROMPT)
    assert torch.equal(shaped(logits, logit_bias=bias), expected)


def test_penalties_change_what_greedy_picks_and_history_grows_with_each_token(logits):
    best = int(logits.argmax())
    sampler = RequestSampler(NewRequest(1, SamplingParams(temperature=0, frequency_penalty=2.0), 0), (), 100)
    first = sampler.pick(logits)
    sampler.finish(first, 10)
    picks = [first]
    for k in range(5):
        token = sampler.pick(logits)
        sampler.finish(token, 11 + k)
        picks.append(token)
    assert first == best and len(set(picks)) > 1  # the same logits, yet repeats get costlier


def test_a_taken_over_request_starts_from_its_history(logits):
    """A decode pool's tail gets the output so far in NewRequest: the same next pick."""
    params = SamplingParams(temperature=0, repetition_penalty=1.8)
    whole = RequestSampler(NewRequest(1, params, 0, prompt=PROMPT), (), 100)
    for k, tok in enumerate(OUTPUT):
        whole.finish(tok, len(PROMPT) + k + 1)
    taken = RequestSampler(NewRequest(1, params, 0, len(OUTPUT), PROMPT, output=OUTPUT), (), 100)
    assert whole.pick(logits) == taken.pick(logits)


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 200, "max_tokens": 100}, "min_tokens"),
        ({"logit_bias": ((VOCAB, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": tuple((k, 1.0) for k in range(301))}, "logit_bias"),
        ({"bad_words": ((),)}, "bad word"),
        ({"bad_words": ((1, -1),)}, "bad word"),
        ({"bad_words": ((1,),) * 129}, "bad words"),
    ],
)
def test_values_out_of_range_are_refused_naming_them(params, says):
    with pytest.raises(RequestError, match=says):
        check_sampling(SamplingParams(**params), VOCAB)
