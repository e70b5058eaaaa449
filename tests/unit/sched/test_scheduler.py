from __future__ import annotations

import math

import pytest

from kvasir.errors import BatchError, RequestError
from kvasir.sched.scheduler import Scheduler
from kvasir.wire.batch import SampledToken, SamplingParams
from kvasir.wire.head import BatchResult
from tests.support.models import make_plan

VOCAB = 100


def scheduler(**kw):
    """Without the prefix cache: these tests repeat prompts (tests/unit/sched/test_scheduler_prefix.py has it on)."""
    kw.setdefault("prefix_cache", False)
    plan = make_plan("unused", [(0, 1), (1, 2)], **kw)
    return Scheduler(plan, VOCAB)


def prompt(n):
    return [3 + i % 90 for i in range(n)]


def finish_batch(s, batch, finish=None, token=7):
    tokens = tuple(SampledToken(r.request_id, token, 0, finish) for r in batch.descriptor.rows if r.emit)
    return s.complete(BatchResult(batch.descriptor.batch_id, tokens))


def test_widths_bound_every_batch_and_long_prompts_are_chunked():
    s = scheduler(max_rows=3, max_tokens=10, inflight=1)
    s.submit(prompt(25), SamplingParams(max_tokens=2))
    chunks = []
    for _ in range(4):
        batch = s.next_batch()
        (row,) = batch.descriptor.rows
        assert batch.descriptor.num_tokens == row.num_tokens == len(batch.token_ids) <= 10
        chunks.append((row.start, row.num_tokens, row.emit))
        finish_batch(s, batch)
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True), (25, 1, True)]  # then a decode row


def test_decode_rows_come_first_and_rows_are_capped():
    s = scheduler(max_rows=3, max_tokens=12, inflight=1)
    for _ in range(2):
        s.submit(prompt(4), SamplingParams(max_tokens=5))
    finish_batch(s, s.next_batch())  # both prefills in one batch
    for _ in range(3):
        s.submit(prompt(9), SamplingParams(max_tokens=5))
    batch = s.next_batch()
    rows = batch.descriptor.rows
    assert len(rows) == 3
    assert [(r.request_id, r.num_tokens) for r in rows[:2]] == [(1, 1), (2, 1)]  # decode first
    assert rows[2].request_id == 3 and rows[2].num_tokens == 9 and rows[2].emit
    assert batch.descriptor.num_tokens == 11


def test_inflight_limit_and_no_request_in_two_batches():
    s = scheduler(max_rows=2, max_tokens=4, inflight=2)
    for _ in range(6):
        s.submit(prompt(3), SamplingParams(max_tokens=3))
    first, second = s.next_batch(), s.next_batch()
    assert s.next_batch() is None  # two batches outstanding
    members = [r.request_id for b in (first, second) for r in b.descriptor.rows]
    assert len(members) == len(set(members))
    finish_batch(s, first)
    third = s.next_batch()
    ids = {r.request_id for r in third.descriptor.rows}
    assert ids.isdisjoint(r.request_id for r in second.descriptor.rows)


def test_a_batch_fixed_with_no_other_in_flight_is_marked_solo():
    s = scheduler(max_rows=1, max_tokens=4, inflight=2)
    s.submit(prompt(3), SamplingParams(max_tokens=3))
    alone = s.next_batch()
    assert alone.descriptor.solo  # the ring was empty
    s.submit(prompt(3), SamplingParams(max_tokens=3))
    beside = s.next_batch()
    assert not beside.descriptor.solo  # the first is still in flight
    finish_batch(s, alone)
    assert not s.next_batch().descriptor.solo  # the second still is
    finish_batch(s, beside)


def test_admission_reserves_kv_and_waits_for_room():
    # 8 blocks of 4 tokens; each request needs ceil((6 + 10) / 4) = 4 blocks
    s = scheduler(max_rows=8, max_tokens=64, inflight=1, block_size=4, num_blocks=8, max_seq_len=32)
    ids = [s.submit(prompt(6), SamplingParams(max_tokens=10)) for _ in range(3)]
    batch = s.next_batch()
    assert [r.request_id for r in batch.descriptor.rows] == ids[:2]
    assert s.blocks.free == 0 and len(s.waiting) == 1
    # blocks travel as growth: only those covering the row's tokens
    assert [len(r.new_blocks) for r in batch.descriptor.rows] == [2, 2]
    events = finish_batch(s, batch, finish="stop")
    assert [e.finish for e in events] == ["stop", "stop"]
    nxt = s.next_batch()
    assert set(nxt.descriptor.release) == set(ids[:2])  # released in the next descriptor
    assert [r.request_id for r in nxt.descriptor.rows] == [ids[2]]


def test_block_growth_is_sent_once():
    s = scheduler(max_rows=1, max_tokens=8, inflight=1, block_size=4)
    s.submit(prompt(3), SamplingParams(max_tokens=20))
    seen = []
    for _ in range(8):
        batch = s.next_batch()
        (row,) = batch.descriptor.rows
        seen.extend(row.new_blocks)
        assert len(seen) == math.ceil((row.start + row.num_tokens) / 4)
        finish_batch(s, batch)
    assert len(seen) == len(set(seen))


def test_new_request_spec_travels_once():
    s = scheduler(inflight=1)
    s.submit(prompt(2), SamplingParams(seed=5, max_tokens=3))
    first = s.next_batch()
    assert [(n.request_id, n.seed) for n in first.descriptor.new_requests] == [(1, 5)]
    finish_batch(s, first)
    assert s.next_batch().descriptor.new_requests == ()


def test_cancel_waiting_running_and_in_flight():
    s = scheduler(max_rows=1, max_tokens=8, inflight=1)
    a = s.submit(prompt(2), SamplingParams(max_tokens=9))
    b = s.submit(prompt(2), SamplingParams(max_tokens=9))
    assert s.cancel(b).finish == "cancelled"  # waiting: ends at once
    batch = s.next_batch()
    assert s.cancel(a) is None  # in flight: ends when its batch returns
    events = finish_batch(s, batch)
    assert [(e.request_id, e.finish, e.token_id) for e in events] == [(a, "cancelled", None)]
    assert s.next_batch() is None and s.idle
    assert s.blocks.free == s.blocks.num_blocks


def test_results_for_unknown_batches_are_refused():
    s = scheduler()
    with pytest.raises(BatchError, match="not in flight"):
        s.complete(BatchResult(99, ()))
    s.submit(prompt(2), SamplingParams())
    batch = s.next_batch()
    with pytest.raises(BatchError, match="not in it"):
        s.complete(BatchResult(batch.descriptor.batch_id, (SampledToken(42, 1, 0, None),)))


@pytest.mark.parametrize(
    "ids, code, fragment",
    [
        ([], "invalid_request", "prompt is empty"),
        ("hello", "invalid_request", "not text"),
        ([1, VOCAB], "invalid_request", "prompt token 1 = 100 is not a token id"),
        ([1, -1], "invalid_request", "prompt token 1 = -1"),
        ([1, 2.0], "invalid_request", "prompt token 1 = 2.0"),
        ([1, True], "invalid_request", "prompt token 1 = True"),
        (list(range(1, 65)), "too_long", "prompt of 64 tokens leaves no room"),
    ],
)
def test_bad_prompts_are_refused(ids, code, fragment):
    s = scheduler(max_seq_len=64, num_blocks=64, block_size=4)
    with pytest.raises(RequestError) as info:
        s.submit(ids, SamplingParams())
    assert info.value.code == code and fragment in info.value.message
    assert not s.waiting


@pytest.mark.parametrize(
    "params, fragment",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p must be a finite number in (0, 1]"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(seed=-5), "seed must be an integer"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(stop_token_ids=(VOCAB,)), "stop token id 100"),
        (dict(logprobs=21), "logprobs must be an integer in [0, 20]"),
        (dict(logprobs=-2), "logprobs must be an integer in [0, 20]"),
    ],
)
def test_bad_sampling_parameters_are_refused(params, fragment):
    s = scheduler()
    with pytest.raises(RequestError) as info:
        s.submit([1, 2, 3], SamplingParams(**params))
    assert info.value.code == "invalid_request" and fragment in info.value.message


def step(s, batch):
    """Complete a batch as a tail would: token 7, finished once max_tokens are out."""
    tokens = []
    for row in batch.descriptor.rows:
        if row.emit:
            state = s.running[row.request_id]
            done = len(state.output) + 1 >= state.sampling.max_tokens
            tokens.append(SampledToken(row.request_id, 7, len(state.output), "length" if done else None))
    return s.complete(BatchResult(batch.descriptor.batch_id, tuple(tokens)))


def run_to_end(s, rounds=500):
    """Run batches until idle; the order in which requests were first scheduled."""
    order = []
    for _ in range(rounds):
        batch = s.next_batch()
        if batch is None:
            break
        order += [n.request_id for n in batch.descriptor.new_requests]
        step(s, batch)
    return order


def test_admission_is_fair_across_clients():
    """Client 1's long requests fill the cache; when one ends, client 2's request (which
    fits) is admitted, where first-come-first-served would wait for client 1's next."""
    s = scheduler(max_rows=8, max_tokens=64, inflight=1, block_size=4, num_blocks=60, max_seq_len=128)
    short = s.submit(prompt(4), SamplingParams(max_tokens=10), client=1)  # 4 blocks
    hogs = [s.submit(prompt(4), SamplingParams(max_tokens=60), client=1) for _ in range(7)]  # 16 blocks each
    first = s.next_batch()
    assert [n.request_id for n in first.descriptor.new_requests] == [short, *hogs[:3]]
    polite = s.submit(prompt(4), SamplingParams(max_tokens=44), client=2)  # 12 blocks: not yet
    step(s, first)
    for _ in range(9):
        batch = s.next_batch()
        assert not batch.descriptor.new_requests
        step(s, batch)  # the last of these finishes the short one
    assert s.held == {1: 48}
    batch = s.next_batch()
    assert [n.request_id for n in batch.descriptor.new_requests] == [polite]
    assert s.held == {1: 48, 2: 12}


def test_fair_admission_keeps_each_clients_order_and_skips_cancelled():
    s = scheduler(max_rows=1, max_tokens=8, inflight=1, block_size=4, num_blocks=64, max_seq_len=64)
    a = [s.submit(prompt(2), SamplingParams(max_tokens=1), client=1) for _ in range(3)]
    b = [s.submit(prompt(2), SamplingParams(max_tokens=1), client=2) for _ in range(3)]
    s.cancel(a[1])
    assert run_to_end(s) == [a[0], a[2], b[0], b[1], b[2]]  # nobody holds blocks at each admission: oldest first
    assert s.idle and not s.queues and not s.held


def test_a_result_naming_strangers_changes_nothing():
    s = scheduler(inflight=1)
    s.submit(prompt(3), SamplingParams(max_tokens=3))
    batch = s.next_batch()
    stranger = BatchResult(batch.descriptor.batch_id, (SampledToken(999, 7, 0, None),))
    with pytest.raises(BatchError, match="not in it"):
        s.complete(stranger)
    assert finish_batch(s, batch)[0].token_id == 7  # the real result still lands
