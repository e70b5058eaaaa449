"""The scheduler with a KV pool (kvasir/sched/pool_loads.py): evicted blocks are named
for the stages to write down before anything overwrites them, and a request whose
prefix the pool holds waits for its stages to read it back, then computes only the rest."""

from __future__ import annotations

import msgspec

from kvasir.config.kvpool import KvPoolSpec
from kvasir.sched.prefix import block_keys
from kvasir.sched.scheduler import Scheduler
from kvasir.wire.batch import SampledToken, SamplingParams
from kvasir.wire.head import BatchResult
from tests.support.models import make_plan

VOCAB, BLOCK = 100, 4
POOL = KvPoolSpec(disk_dir="/unused", disk_bytes=1 << 20)


def scheduler(pool: bool = True, num_blocks: int = 8) -> Scheduler:
    plan = make_plan("unused", [(0, 1), (1, 2)], block_size=BLOCK, num_blocks=num_blocks, max_seq_len=32, inflight=1)
    return Scheduler(msgspec.structs.replace(plan, kv_pool=POOL if pool else None), VOCAB)


def finish(s: Scheduler) -> None:
    """Run every batch to its end (one token each, "length" at the request's last)."""
    while (batch := s.next_batch()) is not None:
        tokens = tuple(
            SampledToken(r.request_id, 7, 0, "length" if s.running[r.request_id].sampling.max_tokens == 1 else None)
            for r in batch.descriptor.rows
            if r.emit
        )
        s.complete(BatchResult(batch.descriptor.batch_id, tokens))


def prompt(first: int, length: int = 13) -> list[int]:
    return [first + i for i in range(length)]


def test_evicted_blocks_are_named_in_the_descriptor_that_reuses_them():
    s = scheduler()
    s.submit(prompt(10), SamplingParams(max_tokens=1))
    finish(s)  # 4 blocks held, 3 full ones registered, then idle
    keys = block_keys(prompt(10), BLOCK, 3)
    s.submit(prompt(40, 24), SamplingParams(max_tokens=1))  # needs 7 of 8 blocks: registered ones go
    batch = s.next_batch()
    assert batch is not None
    spilled = batch.descriptor.spill
    assert len(spilled) == s.cache.evicted >= 2
    assert [key for _, key in spilled] == keys[: len(spilled)]  # least recently used first, with their blocks
    assert {block for block, _ in spilled} <= set(batch.descriptor.rows[0].new_blocks)
    plain = scheduler(pool=False)
    plain.submit(prompt(10), SamplingParams(max_tokens=1))
    finish(plain)
    plain.submit(prompt(40, 24), SamplingParams(max_tokens=1))
    assert plain.next_batch().descriptor.spill == () and plain.cache.evicted >= 2  # type: ignore[union-attr]


def test_a_pooled_prefix_is_read_back_before_the_request_runs_and_then_shared():
    s = scheduler()
    rid = s.submit(prompt(10), SamplingParams(max_tokens=1), pooled=3)
    assert s.next_batch() is None  # it waits for its stages: no row yet
    side = s.release_only()
    assert side is not None and side.rows == ()
    [load] = side.load
    state = s.running[rid]
    assert load.request_id == rid and load.blocks == tuple(state.blocks[:3])
    assert list(load.keys) == block_keys(prompt(10), BLOCK, 3)
    s.loaded(rid, ["host", "disk"])  # every stage read the first two, one of them from disk
    batch = s.next_batch()
    assert batch is not None
    [row] = batch.descriptor.rows
    assert (row.start, row.num_tokens) == (8, 5)  # the third block is computed
    [new] = batch.descriptor.new_requests
    assert (new.cached_tokens, new.pooled_tokens) == (8, (4, 4, 0))
    assert s.cache.pooled_tokens == 8
    s.complete(BatchResult(batch.descriptor.batch_id, (SampledToken(rid, 7, 0, "length"),)))
    again = s.submit(prompt(10), SamplingParams(max_tokens=1))  # the read-back blocks are in the cache now
    rows = s.next_batch().descriptor.rows  # type: ignore[union-attr]
    assert rows[0].request_id == again and rows[0].start == 12


def test_a_timed_out_or_cancelled_load_computes_or_ends_the_request():
    s = scheduler()
    late = s.submit(prompt(10), SamplingParams(max_tokens=1), pooled=3)
    gone = s.submit(prompt(50), SamplingParams(max_tokens=1), pooled=3)
    s.next_batch()
    assert len(s.release_only().load) == 2  # type: ignore[union-attr]
    s.loaded(late, [])  # no answer in time: the whole prompt is computed
    emitted = s.cancel(gone)
    assert emitted is not None and emitted.finish == "cancelled" and gone not in s.running
    s.loaded(gone, ["host"] * 3)  # a late answer for a cancelled request changes nothing
    rows = s.next_batch().descriptor.rows  # type: ignore[union-attr]
    assert [(r.request_id, r.start) for r in rows] == [(late, 0)]
    assert s.running[late].cached_tokens == 0 and s.cache.pooled_tokens == 0


def test_the_pool_never_covers_the_last_prompt_token_nor_more_than_it_holds():
    s = scheduler()
    rid = s.submit(prompt(10, 12), SamplingParams(max_tokens=1), pooled=9)  # 3 full blocks; the last is computed
    s.next_batch()
    [load] = s.release_only().load  # type: ignore[union-attr]
    assert len(load.blocks) == 2
    s.loaded(rid, ["host"] * 5)  # a stage claiming more than asked counts for what was asked
    assert s.running[rid].computed == 8
