"""A stage's view of its expert shards' answers: only the answer to each shard's
outstanding dispatch counts, whatever else reaches the socket and in whatever order."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvasir.stage.shard_links import ShardLost, ShardResults
from kvasir.transport.channels import PullChannel
from kvasir.wire.experts import ExpertDone, ExpertMessage, ExpertWork


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://results")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://results")
    yield PullChannel[ExpertMessage](pull, ExpertMessage), push
    ctx.destroy(linger=0)


def send(push, *messages) -> None:
    for message in messages:
        push.send(msgspec.msgpack.encode(message))


def test_a_stray_answer_after_the_real_one_does_not_displace_it(sockets):
    inbox, push = sockets
    beats = []
    results = ShardResults(inbox, lambda: beats.append(1), wait_s=2.0)
    results.expect(0, 242)
    results.expect(1, 7)
    # the real answers, then strays: another seq for shard 0, an unknown shard, work
    send(push, ExpertDone(242, 0, 3), ExpertDone(10**9, 0, 1), ExpertDone(7, 77, 1), ExpertWork(1, 0, 1))
    send(push, ExpertDone(7, 1, 2))
    assert results.wait(0, 242) == ExpertDone(242, 0, 3)
    assert results.wait(1, 7) == ExpertDone(7, 1, 2)
    assert inbox.dropped == 3


def test_an_answer_never_given_fails_the_wait_after_its_bound_beating_meanwhile(sockets):
    inbox, push = sockets
    beats = []
    results = ShardResults(inbox, lambda: beats.append(1), wait_s=0.3)
    results.expect(0, 5)
    send(push, ExpertDone(4, 0, 1))  # an earlier dispatch's answer: not this one
    with pytest.raises(ShardLost, match="shard-0 did not answer dispatch 5 within 0.3 s"):
        results.wait(0, 5)
    assert beats and inbox.dropped == 1
