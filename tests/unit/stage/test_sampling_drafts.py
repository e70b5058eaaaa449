"""The tail's check of draft tokens keeps the model's distribution: a draft is kept while
the sample at its position equals it, which is the rejection-sampling rule for a
proposal that puts all its mass on the draft. Pearson's chi-square over thousands of
seeded requests, on a six-token vocabulary; with the same seed a row with drafts emits
what rows without them would."""

from __future__ import annotations

import pytest
import torch

from kvasir.stage.sampling import Sampler
from kvasir.wire.batch import BatchDescriptor, NewRequest, Row, SamplingParams

FIRST = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])  # logits after the request's newest token
SECOND = torch.tensor([-0.5, 1.0, 2.0, 0.0, 0.5, -1.0])  # after the first draft
CRITICAL = 20.5  # chi-square's 0.1 % critical value at 5 degrees of freedom
RUNS = 3000


def emitted(seed: int, draft: tuple[int, ...], params: SamplingParams) -> list[int]:
    """The tokens a row with ``draft`` emits for a fresh request with ``seed``."""
    sampler = Sampler(eos_ids=(), max_seq_len=100)
    new = NewRequest(1, params, seed, generated=1)
    row = Row(1, 5, 1 + len(draft), (0, 1), True, draft=draft)
    logits = torch.stack([FIRST, SECOND, FIRST][: 1 + len(draft)])
    result = sampler.sample(BatchDescriptor(1, 0, row.num_tokens, (row,), (), (new,), 0), logits)
    return [token.token_id for token in result.tokens]


def chi_square(picked: list[int], logits: torch.Tensor) -> float:
    expected = torch.softmax(logits.double(), -1) * len(picked)
    counts = torch.bincount(torch.tensor(picked), minlength=len(logits)).double()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [0, 4])  # the likeliest token, and an unlikely one
def test_the_first_token_keeps_its_distribution_and_the_next_follows_a_confirmed_draft(draft):
    params = SamplingParams(temperature=1.0, max_tokens=50)
    runs = [emitted(seed, (draft, 1), params) for seed in range(RUNS)]
    firsts = [run[0] for run in runs]
    assert chi_square(firsts, FIRST) < CRITICAL
    seconds = [run[1] for run in runs if run[0] == draft]  # the draft confirmed: the next sample stands
    assert len(seconds) == firsts.count(draft) and all(len(run) == 1 for run in runs if run[0] != draft)
    assert chi_square(seconds, SECOND) < CRITICAL * (1 if draft == 0 else 2), len(seconds)


def one_by_one(seed: int, params: SamplingParams) -> list[int]:
    """Two rows without drafts for a fresh request with ``seed``: FIRST's logits, then SECOND's."""
    sampler = Sampler(eos_ids=(), max_seq_len=100)
    new = NewRequest(1, params, seed, generated=1)
    tokens = []
    for step, logits in enumerate((FIRST, SECOND)):
        row = Row(1, 5 + step, 1, (0, 1) if not step else (), True)
        descriptor = BatchDescriptor(1 + step, 0, 1, (row,), (), (new,) if not step else (), 0)
        tokens += [t.token_id for t in sampler.sample(descriptor, logits[None]).tokens]
    return tokens


def test_with_a_seed_a_row_with_drafts_emits_what_rows_without_them_would():
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=50)
    for seed in range(200):
        plain = one_by_one(seed, params)
        with_drafts = emitted(seed, (plain[0], 2), params)
        assert with_drafts[:2] == plain  # the draft confirmed: the next position's sample is the next token


def test_counts_of_drafts_checked_and_confirmed_travel_on_the_last_token():
    params = SamplingParams(temperature=0, max_tokens=2)
    best = int(FIRST.argmax())
    sampler = Sampler(eos_ids=(), max_seq_len=100, speculative=True)
    new = NewRequest(1, params, 0)
    row = Row(1, 0, 3, (0,), True, draft=(best, 3))
    result = sampler.sample(BatchDescriptor(1, 0, 3, (row,), (), (new,), 0), torch.stack([FIRST, SECOND, FIRST]))
    first, last = result.tokens
    assert (first.token_id, last.token_id, last.finish) == (best, int(SECOND.argmax()), "length")
    assert (last.passes, last.drafted, last.accepted) == (1, 2, 1)  # the second draft (3) was not the model's
    assert (first.passes, first.drafted) == (0, 0)
    totals = sampler.drafts()
    assert (totals.rows, totals.tokens, totals.draft_rows, totals.drafted, totals.accepted) == (1, 2, 1, 2, 1)
    assert Sampler(eos_ids=(), max_seq_len=100).drafts() is None  # a plan without [speculative] reports nothing
