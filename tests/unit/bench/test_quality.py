"""The quality check's pieces: the text, its chunks and prompts, the agreement count and
the verdicts (kvasir/bench/quality.py); the daemons' side runs in
tests/integration/test_quality_checks.py."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvasir.bench.quality import QualitySpec, agreement, chunks, perplexity, prompts, quality_text, text_facts, verdicts
from kvasir.errors import KvasirError


def test_the_text_is_the_same_prose_every_time_and_as_long_as_asked():
    text = quality_text(5_000)
    assert len(text) == 5_000 and text == quality_text(5_000)
    assert text.startswith('The "assert" statement')  # the topics in sorted order
    facts = text_facts(text, list(range(1200)))
    assert facts["source"] == "pydoc_data.topics" and facts["tokens"] == 1200 and len(facts["sha256"]) == 64


def test_chunks_are_whole_as_llama_perplexity_cuts_them_and_two_at_least():
    ids = list(range(1100))
    assert [len(c) for c in chunks(ids, 512)] == [512, 512]  # the last 76 tokens are dropped
    assert chunks(ids, 512)[1][0] == 512
    with pytest.raises(KvasirError, match="fewer than two chunks of 600"):
        chunks(ids, 600)


def test_prompts_are_cut_at_even_strides():
    cut = prompts(list(range(1000)), 4, 64)
    assert [p[0] for p in cut] == [0, 234, 468, 702] and all(len(p) == 64 for p in cut)
    with pytest.raises(KvasirError, match="too few"):
        prompts(list(range(10)), 4, 64)


def test_agreement_counts_the_reference_choosing_the_plans_token():
    async def reference(prompt: list[int], continuation: list[int]) -> list[int]:
        return [token if token % 2 else -1 for token in continuation]  # agrees on odd tokens only

    counted = asyncio.run(agreement([[1, 2, 3, 4], [5, 7]], [[0], [0]], reference))
    assert counted == {"top1_agreement": 4 / 6, "positions": 6}


def test_the_verdicts_hold_within_the_margins_only():
    spec = QualitySpec(ppl_margin=0.02, min_agreement=0.9)
    ok = verdicts(spec, {"ppl": 10.1}, {"ppl": 10.0}, {"top1_agreement": 0.95})
    assert ok["passed"] and ok["ppl_ratio"] == pytest.approx(1.01)
    high = verdicts(spec, {"ppl": 10.3}, {"ppl": 10.0}, {"top1_agreement": 0.95})
    assert not high["ppl_within_margin"] and not high["passed"]
    low = verdicts(spec, {"ppl": 9.9}, {"ppl": 10.0}, {"top1_agreement": 0.85})
    assert low["ppl_within_margin"] and not low["agreement_enough"] and not low["passed"]
    assert perplexity(2 * math.log(3), 2) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"n_ctx": 2}, "n_ctx must be at least 4"),
        ({"prompts": 0}, "prompts must be positive"),
        ({"min_agreement": 1.5}, "fraction"),
    ],
)
def test_bad_sizes_are_refused(changes, says):
    with pytest.raises(KvasirError, match=says):
        QualitySpec(**changes).check()
