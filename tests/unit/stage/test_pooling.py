"""A stage's part in the KV pool (kvasir/stage/pooling.py) on a real paged cache and disk
tier: spills and loads named by a descriptor, hostile ones answered without harm, the
tiers' changes sent to the bridge; and a head's wait for every stage's answer."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from kvasir.kvpool.slices import SliceMeta
from kvasir.kvpool.stage_side import StagePool
from kvasir.logs import setup_logging
from kvasir.model.kv_cache import PagedKVCache
from kvasir.stage.pooling import LoadWaits, PoolRole
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.batch import BatchDescriptor, PoolLoad
from kvasir.wire.bridge import BridgeMessage, PoolEvents
from kvasir.wire.head import PoolLoaded
from tests.support.kvpool import SECRET, make_tier

TEMPLATE = SliceMeta(model="m/float32", layers=(0, 2), block_size=4, kv_heads=2, head_dim=8, dtype="float32", key=b"")
A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def descriptor(spill=(), load=()) -> BatchDescriptor:
    return BatchDescriptor(0, -1, 0, (), (), (), 0, spill=tuple(spill), load=tuple(load))


@pytest.fixture
def role(tmp_path):
    """(the stage's PoolRole, its answers to the head, the bridge's end of its events)."""
    cache = PagedKVCache(2, 8, 4, 2, 8, dtype=torch.float32, device=torch.device("cpu"))
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=torch.Generator().manual_seed(1)))
    context = zmq.Context()
    bridge = PullChannel[BridgeMessage](context.socket(zmq.PULL), BridgeMessage)
    bridge.socket.bind("inproc://bridge")
    push = context.socket(zmq.PUSH)
    push.connect("inproc://bridge")
    answers: list[PoolLoaded] = []
    pool = StagePool(cache, {"disk": make_tier(tmp_path, 1 << 20)}, TEMPLATE, 1 << 20, secret=SECRET)
    part = PoolRole(pool, 3, 1234, answers.append, PushChannel[BridgeMessage](push), setup_logging("warning"))
    yield part, answers, bridge
    part.close()
    push.close(linger=0)
    bridge.socket.close(linger=0)
    context.term()


def events(part: PoolRole, bridge: PullChannel, stored: int) -> list[PoolEvents]:
    """The events the stage sent the bridge, once ``stored`` keys were stored (bounded wait)."""
    got: list[PoolEvents] = []
    for _ in range(500):
        part.events()
        got += [m for m in bridge.drain() if isinstance(m, PoolEvents)]
        if sum(len(e.stored) for e in got) >= stored:
            return got
        time.sleep(0.01)
    raise AssertionError(got)


def test_spills_then_loads_in_order_and_answers_the_head(role):
    part, answers, bridge = role
    blocks = part.pool.cache.keys
    before = blocks[:, 4:8].clone()
    part.before(descriptor(spill=[(1, A), (2, B), (99, C)]))  # block 99 does not exist: skipped
    first, *rest = events(part, bridge, 2)
    assert first.reset and first.stage == 3 and first.pid == 1234 and first.tier == "disk"
    assert sorted(key for e in [first, *rest] for key in e.stored) == [A, B]
    part.before(descriptor(load=[PoolLoad(7, (5, 6, 7), (A, C, B))]))  # C was never stored: B is not read
    assert answers == [PoolLoaded(7, 3, ("disk",))]
    assert torch.equal(blocks[:, 20:24], before)
    assert part.counters().loaded == 1 and part.counters().missing == 1
    [read] = part.counters().reads  # by tier: one slice from disk, timed
    assert (read.tier, read.slices, read.bytes, read.peer) == ("disk", 1, TEMPLATE.payload_bytes, -1)
    assert read.seconds > 0


def test_hostile_loads_are_answered_with_nothing_and_the_stage_goes_on(role):
    part, answers, _ = role
    part.before(descriptor(spill=[(0, A)]))
    hostile = [PoolLoad(1, (0, 1), (A,)), PoolLoad(2, (-1,), (A,)), PoolLoad(3, (8,), (A,))]
    part.before(descriptor(load=hostile))  # lengths that differ, blocks out of range
    assert [(a.request_id, a.tiers) for a in answers] == [(1, ()), (2, ()), (3, ())]


def test_a_head_counts_the_blocks_every_stage_read_at_the_slowest_tier():
    waits = LoadWaits(range(4, 7), timeout_s=5.0)
    waits.expect(10, now=100.0)
    waits.expect(11, now=100.0)
    assert waits.answer(PoolLoaded(10, 4, ("host", "host", "host"))) is None
    assert waits.answer(PoolLoaded(10, 9, ())) is None  # not a stage of this ring: ignored
    assert waits.answer(PoolLoaded(10, 5, ("host", "disk"))) is None
    assert waits.answer(PoolLoaded(10, 6, ("host", "host", "disk"))) == ["host", "disk"]
    assert waits.answer(PoolLoaded(10, 6, ())) is None and len(waits) == 1  # answered: forgotten
    assert waits.expired(104.0) == [] and waits.expired(105.0) == [11] and len(waits) == 0
