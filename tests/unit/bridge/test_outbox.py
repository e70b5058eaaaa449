"""The bridge's outbox: events for a client that does not read are bounded in bytes."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import zmq
import zmq.asyncio

from kvasir.bridge.ledger import Peer
from kvasir.bridge.outbox import BATCH_BYTES, ZMQ_QUEUE, Outbox
from kvasir.transport import envelopes
from kvasir.transport.channels import BatchedSocket


async def pair(ctx, endpoint: str, reading_hwm: int = 4):
    """A ROUTER (the bridge's side) and a connected DEALER that reads nothing, and the
    DEALER's identity as the ROUTER knows it."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, ZMQ_QUEUE)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, reading_hwm)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(endpoint)
    await dealer.send(b"hello")
    identity, _ = await router.recv_multipart()
    return router, dealer, Peer(BatchedSocket(router), identity)


@contextlib.asynccontextmanager
async def outbox_to(tmp_path, max_events: int, max_bytes: int):
    """An Outbox running against a connected client: (outbox, its DEALER, its peer, what was lost)."""
    ctx = zmq.asyncio.Context()
    router, dealer, peer = await pair(ctx, f"ipc://{tmp_path / 'c.sock'}")
    lost: list[str] = []
    outbox = Outbox(max_events=max_events, max_bytes=max_bytes, on_lost=lambda p, why: lost.append(why))
    runner = asyncio.create_task(outbox.run())
    try:
        yield outbox, dealer, peer, lost
    finally:
        runner.cancel()
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_a_client_that_stops_reading_is_lost_at_the_byte_bound(tmp_path):
    async def main():
        async with outbox_to(tmp_path, 100_000, 1 << 20) as (outbox, dealer, peer, lost):
            await send_until_lost(outbox, peer, lost)

    asyncio.run(main())


async def send_until_lost(outbox, peer, lost):
    big = b"x" * (200 << 10)  # a stats reply with a timeline
    sent = 0
    while not lost and sent < 10_000:
        outbox.deliver(peer, big)
        sent += 1
        await asyncio.sleep(0)
    assert lost and "stopped reading" in lost[0]
    # what waited is bounded: ZMQ's short queue, the kernel's buffers and at most 1 MiB here
    assert sent * len(big) < 64 << 20
    assert outbox.waiting_bytes == 0
    for _ in range(100):  # once lost, its events are dropped at once, not queued
        outbox.deliver(peer, big)
    assert outbox.waiting_bytes == 0 and outbox.dropped >= 100 and len(lost) == 1


def test_a_slow_reader_gets_every_event_in_order(tmp_path):
    async def main():
        async with outbox_to(tmp_path, 100_000, 64 << 20) as (outbox, dealer, peer, lost):
            await read_slowly(outbox, dealer, peer, lost)

    asyncio.run(main())


async def read_slowly(outbox, dealer, peer, lost):
    events = [msgspec.msgpack.encode(f"event {i} " * 200) for i in range(3000)]  # encoded, as the bridge's are
    for event in events:  # far more than ZMQ's queue holds: most wait in the outbox
        outbox.deliver(peer, event)
    await asyncio.sleep(0)  # the turn ends: its events leave, joined into messages of at most BATCH_BYTES
    assert outbox.waiting_bytes > 0
    got: list[bytes] = []
    messages = 0
    while len(got) < len(events):
        body = await asyncio.wait_for(dealer.recv(), 10)
        assert len(body) <= BATCH_BYTES + 16
        got.extend(envelopes.split(body))
        messages += 1
        if messages % 10 == 0:
            await asyncio.sleep(0.001)  # a reader slower than the writer
    assert got == events and not lost and outbox.waiting_bytes == 0
    assert messages < len(events) // 10  # events travel many to a message


def test_a_client_that_is_gone_is_lost_at_once(tmp_path):
    async def main():
        ctx = zmq.asyncio.Context()
        router, dealer, peer = await pair(ctx, f"ipc://{tmp_path / 'c.sock'}")
        lost = []
        outbox = Outbox(max_events=10, max_bytes=1 << 20, on_lost=lambda p, why: lost.append(why))
        dealer.close(linger=0)
        for _ in range(200):
            outbox.deliver(peer, b"token")
            if lost:
                break
            await asyncio.sleep(0.01)  # the ROUTER notices the disconnect
        assert lost == ["disconnected"]
        router.close(linger=0)
        ctx.term()

    asyncio.run(main())
