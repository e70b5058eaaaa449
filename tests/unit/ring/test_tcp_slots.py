"""A network edge's slots (kvasir/ring/tcp_slots.py) over real sockets: each boundary
arrives in its slot with its descriptor, and a malformed message fails the stage."""

from __future__ import annotations

import msgspec
import pytest
import torch
import zmq

from kvasir.ring.attach import attach_ring
from kvasir.ring.tcp_slots import EdgeError, FramedDescriptors, FramedIntake
from kvasir.wire.batch import BatchDescriptor, Row
from kvasir.wire.control import EdgeSpec


def spec(dtype: str = "float32") -> EdgeSpec:
    return EdgeSpec(kind="tcp", name="tcp-edge", slots=2, max_tokens=8, hidden=16, dtype=dtype)


def descriptor(batch: int, slot: int, tokens: int) -> BatchDescriptor:
    rows = (Row(request_id=batch, start=0, num_tokens=tokens, new_blocks=(), emit=True),) if tokens else ()
    return BatchDescriptor(batch, slot if tokens else -1, tokens, rows, (), (), 0)


@pytest.fixture
def edge(tmp_path):
    ctx = zmq.Context()
    at = f"ipc://{tmp_path}/edge.sock"
    pull = ctx.socket(zmq.PULL)
    pull.bind(at)
    push = ctx.socket(zmq.PUSH)
    push.connect(at)
    yield push, pull
    ctx.destroy(linger=0)


def received(intake: FramedIntake, count: int) -> list[BatchDescriptor]:
    got: list[BatchDescriptor] = []
    while len(got) < count:
        assert intake.socket.poll(30_000), "nothing arrived"
        got += intake.drain()
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_boundaries_arrive_in_their_slots_with_their_descriptors(edge, dtype):
    push, pull = edge
    producer, consumer = attach_ring(spec(dtype), "producer"), attach_ring(spec(dtype), "consumer")
    out, intake = FramedDescriptors(push, producer), FramedIntake(pull, consumer)
    sent = [
        (descriptor(1, 0, 3), torch.randn(3, 16)),
        (descriptor(2, 1, 8), torch.randn(8, 16)),
        (descriptor(3, -1, 0), None),
    ]
    for d, boundary in sent:
        if boundary is not None:
            producer.write(d.slot, boundary)
        out.send(d)
    got = received(intake, 3)
    assert got == [d for d, _ in sent]
    for d, boundary in sent[:2]:
        assert torch.equal(consumer.read(d.slot, d.num_tokens), boundary.to(getattr(torch, dtype)))
    with pytest.raises(EdgeError, match="slot 0 has no boundary to send"):
        out.send(descriptor(4, 0, 2))  # written once, sent once


def test_a_malformed_message_on_the_edge_fails_the_stage(edge):
    push, pull = edge
    intake = FramedIntake(pull, attach_ring(spec(), "consumer"))
    head = msgspec.msgpack.encode(descriptor(1, 0, 3))
    cases = [
        ([head, bytes(3 * 16 * 4 - 1)], "a 3-token boundary is 192 bytes, the frame 191"),
        ([head], "batch 1 came in 1 frames, not 2"),
        ([msgspec.msgpack.encode(descriptor(2, -1, 0)), b"extra"], "batch 2 came in 2 frames, not 1"),
        ([b"\xc1garbage", bytes(192)], "a descriptor that does not decode"),
        ([msgspec.msgpack.encode(descriptor(5, 2, 3)), bytes(192)], "slot 2 outside"),
    ]
    for parts, expected in cases:
        push.send_multipart(parts)
        assert pull.poll(30_000)
        with pytest.raises(EdgeError, match=expected):
            intake.drain()
    with pytest.raises(EdgeError, match="does not fit"):
        intake.drop("descriptor of batch 9 does not fit the edge")
