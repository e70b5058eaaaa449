"""The head's drafting policy, driven through the real scheduler (no model): which decode
rows carry prompt-lookup drafts, within which budget, and when speculation backs off."""

from __future__ import annotations

import msgspec

from kvasir.config.speculative import SpeculativeSpec
from kvasir.sched.scheduler import Scheduler
from kvasir.sched.speculation import PROBE_EVERY, NgramDrafter
from kvasir.wire.batch import SampledToken, SamplingParams
from kvasir.wire.head import BatchResult
from tests.support.models import make_plan

VOCAB = 100
LOOP = [11, 12, 13, 14] * 4  # a prompt whose continuation prompt lookup can guess


def scheduler(reserve_output=True, **spec) -> Scheduler:
    plan = make_plan("unused", [(0, 1), (1, 2)], max_rows=8, max_tokens=64, inflight=1, prefix_cache=False)
    spec.setdefault("method", "ngram")
    return Scheduler(msgspec.structs.replace(plan, speculative=SpeculativeSpec(**spec)), VOCAB, reserve_output)


def answer(s: Scheduler, batch, tokens: dict[int, list[int]]):
    """The tail's word on a batch: for each emitting row, the given tokens (default: one, 11)."""
    sampled = []
    for row in batch.descriptor.rows:
        if row.emit:
            out = tokens.get(row.request_id, [11])
            sampled += [SampledToken(row.request_id, t, 0, None) for t in out]
    return s.complete(BatchResult(batch.descriptor.batch_id, tuple(sampled)))


def decode_batch(s: Scheduler, *requests: list[int], **params):
    """Submit prompts, run their prefill (each gets first token 11); the next batch: their decode rows."""
    ids = [s.submit(list(p), SamplingParams(max_tokens=64, **params)) for p in requests]
    while any(rid not in s.running or not s.running[rid].output for rid in ids):
        batch = s.next_batch()
        answer(s, batch, {row.request_id: [11] for row in batch.descriptor.rows if not row.draft})
    return ids, s.next_batch()


def wrong(batch) -> dict[int, list[int]]:
    """Each row's answer: a token of the loop other than its first draft (rejecting it)."""
    return {row.request_id: [12 if row.draft[:1] != (12,) else 13] for row in batch.descriptor.rows}


def test_a_decode_row_carries_the_prompts_continuation_as_drafts():
    s = scheduler(num_tokens=3)
    (rid,), batch = decode_batch(s, LOOP)
    (row,) = batch.descriptor.rows
    assert row.draft == (12, 13, 14)  # "... 14 11" occurred, followed by 12 13 14
    assert row.num_tokens == 4 and batch.token_ids.tolist() == [11, 12, 13, 14]
    answer(s, batch, {rid: [12, 13, 99]})  # two confirmed, then the model's own token
    (row,) = s.next_batch().descriptor.rows
    assert row.start == len(LOOP) + 3  # the third draft's K/V is overwritten by this row


def test_no_drafts_for_a_request_that_turns_them_off_or_whose_tokens_never_recur():
    s = scheduler()
    _, batch = decode_batch(s, LOOP, speculative=False)
    assert batch.descriptor.rows[0].draft == ()
    s = scheduler()
    _, batch = decode_batch(s, list(range(20, 40)))
    assert batch.descriptor.rows[0].draft == ()


def test_a_batch_with_more_decode_rows_than_max_rows_drafts_for_none():
    s = scheduler(max_rows=2)
    _, batch = decode_batch(s, LOOP, LOOP, LOOP)
    assert all(row.draft == () for row in batch.descriptor.rows)
    assert s.speculation.counters().full_rows == 3
    s = scheduler(max_rows=3)
    _, batch = decode_batch(s, LOOP, LOOP, LOOP)
    assert all(len(row.draft) == 4 for row in batch.descriptor.rows)


def test_drafts_take_only_the_budget_the_rows_own_tokens_leave():
    plan = make_plan("unused", [(0, 1), (1, 2)], max_rows=4, max_tokens=12, inflight=1, prefix_cache=False)
    s = Scheduler(msgspec.structs.replace(plan, speculative=SpeculativeSpec(method="ngram", ngram_min=1)), VOCAB)
    _, batch = decode_batch(s, LOOP[:4], LOOP[:4], LOOP[:4])
    rows = batch.descriptor.rows
    assert [len(row.draft) for row in rows] == [4, 4, 1]  # 3 tokens of the rows' own, 9 to draft with
    assert batch.descriptor.num_tokens == 12


def test_a_request_whose_drafts_are_rarely_confirmed_only_probes_until_one_is():
    s = scheduler(num_tokens=4, min_acceptance=0.3, ngram_min=1)  # every token of the loop recurs
    (rid,), batch = decode_batch(s, LOOP)
    for expected in (4, 3):  # rejected twice: its rate falls to 0.25 (and its rows shrink meanwhile)
        assert len(batch.descriptor.rows[0].draft) == expected
        answer(s, batch, wrong(batch))
        batch = s.next_batch()
    drafts = []
    for _ in range(PROBE_EVERY):
        drafts.append(len(batch.descriptor.rows[0].draft))
        answer(s, batch, wrong(batch))
        batch = s.next_batch()
    assert drafts == [0] * (PROBE_EVERY - 1) + [1]  # quiet, then one probe (rejected)
    assert s.speculation.counters().quiet_rows == PROBE_EVERY  # (the batch after the probe is quiet again)
    drafts = []
    for _ in range(2 * PROBE_EVERY - 1):  # a rejected probe doubles the wait for the next
        drafts.append(len(batch.descriptor.rows[0].draft))
        answer(s, batch, wrong(batch))
        batch = s.next_batch()
    assert drafts == [0] * (2 * PROBE_EVERY - 1)
    (row,) = batch.descriptor.rows
    assert len(row.draft) == 1
    answer(s, batch, {rid: [row.draft[0], 11]})  # the probe is confirmed: its rate climbs back
    assert len(s.next_batch().descriptor.rows[0].draft) == 2  # one more than its rows lately had confirmed


def test_a_requests_rows_grow_while_their_drafts_are_confirmed_and_shrink_when_not():
    s = scheduler(num_tokens=6, ngram_min=1)
    (rid,), batch = decode_batch(s, LOOP)
    sizes = []
    for confirmed in (6, 6, 0, 1, 1, 3, 3):
        row = batch.descriptor.rows[0]
        sizes.append(len(row.draft))
        taken = list(row.draft[:confirmed])
        answer(s, batch, {rid: taken + [12 if row.draft[len(taken) : len(taken) + 1] != (12,) else 13]})
        batch = s.next_batch()
    assert sizes == [6, 6, 6, 4, 3, 3, 4]


def test_drafts_never_take_budget_a_waiting_prompt_could_use():
    plan = make_plan("unused", [(0, 1), (1, 2)], max_rows=4, max_tokens=12, inflight=1, prefix_cache=False)
    s = Scheduler(msgspec.structs.replace(plan, speculative=SpeculativeSpec(method="ngram", ngram_min=1)), VOCAB)
    (rid,), batch = decode_batch(s, LOOP[:4])
    (row,) = batch.descriptor.rows
    assert len(row.draft) == 4  # nothing else to run: the row drafts
    answer(s, batch, {rid: [*row.draft, 12]})  # all confirmed
    s.submit(list(range(20, 26)), SamplingParams(max_tokens=4))  # a 6-token prompt arrives
    batch = s.next_batch()
    assert [(len(r.draft), r.num_tokens) for r in batch.descriptor.rows] == [(4, 5), (0, 6)]  # 12 - 1 - 6 spare
    answer(s, batch, {})
    s.submit(list(range(30, 50)), SamplingParams(max_tokens=4))  # a prompt longer than the budget
    batch = s.next_batch()
    assert len(batch.descriptor.rows) == 3 and all(r.draft == () for r in batch.descriptor.rows)


def test_a_decode_pool_drafts_from_the_prompt_the_prefill_pool_announced():
    prefill = scheduler(reserve_output=False)
    assert prefill.speculation is None  # its requests leave at their first token
    prefill.submit(LOOP, SamplingParams(max_tokens=8))
    (announced,) = prefill.next_batch().descriptor.new_requests
    assert announced.prompt == tuple(LOOP)  # for the tail to hand on with the request
    decode = scheduler()
    decode.reserve(7, len(LOOP), [11], SamplingParams(max_tokens=8), seed=1, context=tuple(LOOP))
    decode.unpark(7)
    (row,) = decode.next_batch().descriptor.rows
    assert row.draft == (12, 13, 14, 11)


def test_with_a_draft_model_a_request_starts_at_one_draft_and_grows():
    plan = make_plan("unused", [(0, 1), (1, 2)], max_rows=8, max_tokens=64, inflight=1, prefix_cache=False)
    spec = SpeculativeSpec(method="draft", draft_model="unused", num_tokens=4, ngram_min=1)
    # the policy's view of a draft model: drafts that cost a pass each (any drafter gives them here)
    s = Scheduler(msgspec.structs.replace(plan, speculative=spec), VOCAB, drafter=NgramDrafter(spec))
    (rid,), batch = decode_batch(s, LOOP)
    sizes = []
    for _ in range(4):
        row = batch.descriptor.rows[0]
        sizes.append(len(row.draft))
        answer(s, batch, {rid: [*row.draft, 11 + (row.draft[-1] - 10) % 4]})  # all confirmed, the loop goes on
        batch = s.next_batch()
    assert sizes == [1, 2, 3, 4]
