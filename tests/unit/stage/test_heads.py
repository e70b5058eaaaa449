"""A head's inbox: cancels that overtake their request, and results no batch explains."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvasir.sched.scheduler import Scheduler
from kvasir.stage.heads import SchedulerIntake
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.batch import SamplingParams
from kvasir.wire.bridge import BridgeMessage, RequestEnded
from kvasir.wire.head import BatchResult, CancelRequest, Enqueue, HeadMessage
from tests.support.models import make_plan


@pytest.fixture
def head():
    """A colocated head's intake on real inproc sockets: (intake, send to it, read what it tells the bridge)."""
    ctx = zmq.Context()
    inbox_in, inbox_out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inbox_out.bind("inproc://head")
    inbox_in.connect("inproc://head")
    bridge_in, bridge_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    bridge_in.bind("inproc://bridge")
    bridge_out.connect("inproc://bridge")
    scheduler = Scheduler(make_plan("unused", [(0, 1), (1, 2)], inflight=1), 100)
    intake = SchedulerIntake(scheduler, PullChannel(inbox_out, HeadMessage), PushChannel(bridge_out))
    to_head = PushChannel(inbox_in)
    bridge = PullChannel(bridge_in, BridgeMessage)

    def told():
        return [m for m in bridge.drain()]

    def send(*messages):
        for m in messages:
            to_head.send(m)
        while not inbox_out.poll(100):
            pass
        intake.receive()

    yield intake, send, told
    ctx.destroy(linger=0)


def test_a_cancel_that_overtakes_its_request_wins(head):
    intake, send, told = head
    send(CancelRequest(5))
    send(Enqueue(5, (1, 2, 3), SamplingParams(max_tokens=4)))
    assert told() == [RequestEnded(5, "cancelled")]
    assert intake.scheduler.idle and intake.take(True) is None
    send(Enqueue(6, (1, 2, 3), SamplingParams(max_tokens=4)))  # others are served as usual
    assert intake.take(True)[0].rows[0].request_id == 6


def test_results_no_batch_explains_are_dropped_not_fatal(head):
    intake, send, told = head
    send(Enqueue(1, (1, 2, 3), SamplingParams(max_tokens=4)))
    descriptor, _ = intake.take(True)
    send(BatchResult(999, ()))  # no such batch in flight
    send(BatchResult(descriptor.batch_id, ()))  # the real one still lands
    assert intake.inbox.dropped == 1
    assert not intake.scheduler.inflight


def test_frames_that_do_not_decode_are_dropped(head):
    intake, send, told = head
    for junk in (b"", b"\xff\x00", msgspec.msgpack.encode(["Enqueue", "x"]), msgspec.msgpack.encode({"a": 1})):
        send_raw = intake.inbox.socket.context.socket(zmq.PUSH)
        send_raw.connect("inproc://head")
        send_raw.send(junk)
        send_raw.close(linger=-1)
    while not intake.inbox.socket.poll(100):
        pass
    intake.receive()
    assert intake.inbox.dropped == 4
