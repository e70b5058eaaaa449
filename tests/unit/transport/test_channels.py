"""BatchedSocket: batched asyncio I/O over ZMQ without lost wake-ups."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
import zmq.asyncio

from kvasir.transport.channels import BatchedSocket


def echo(ctx: zmq.Context, endpoint: str, stop: threading.Event) -> None:
    """A ROUTER that sends every message straight back (a thread with a plain socket)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(50):
            sock.send_multipart(sock.recv_multipart())
    sock.close()


def test_one_socket_shared_by_a_reader_and_writers_never_stalls(tmp_path):
    # A reader task waits on the socket while writer tasks send on it: every send may
    # consume the edge-triggered descriptor's notification of an arrived reply, which
    # must still wake the reader. Thousands of round trips, each bounded by a timeout.
    endpoint = f"ipc://{tmp_path / 'echo.sock'}"
    ctx = zmq.asyncio.Context()
    stop = threading.Event()
    peer = threading.Thread(target=echo, args=(zmq.Context.shadow(ctx.underlying), endpoint, stop))
    peer.start()

    async def main() -> int:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)  # small queue: writers also wait for room
        sock.connect(endpoint)
        io = BatchedSocket(sock, max_batch=7)
        waiting: dict[bytes, asyncio.Future] = {}

        async def reader() -> None:
            while True:
                for reply in await io.recv_batch():
                    waiting.pop(reply).set_result(None)

        async def writer(name: int) -> int:
            done = 0
            for i in range(600):
                key = f"{name}-{i}".encode()
                waiting[key] = asyncio.get_running_loop().create_future()
                await io.send(key)
                if i % 3 == 0:
                    await asyncio.wait_for(waiting[key], 5)
                    done += 1
            return done

        task = asyncio.create_task(reader())
        try:
            counts = await asyncio.wait_for(asyncio.gather(*(writer(n) for n in range(6))), 60)
            await asyncio.wait_for(asyncio.gather(*waiting.values()), 10)
        finally:
            task.cancel()
            sock.close()
        return sum(counts)

    try:
        assert asyncio.run(main()) == 6 * 200
    finally:
        stop.set()
        peer.join()
        ctx.term()


@pytest.mark.parametrize("frames", [[b"one"], [b"id", b"body"], [b"a", b"b", b"c"]])
def test_multipart_frames_arrive_whole(tmp_path, frames):
    endpoint = f"ipc://{tmp_path / 'pair.sock'}"
    ctx = zmq.asyncio.Context()

    async def main():
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind(endpoint)
        b.connect(endpoint)
        try:
            await BatchedSocket(a).send_multipart(frames)
            return await asyncio.wait_for(BatchedSocket(b).recv_batch(multipart=True), 5)
        finally:
            a.close(linger=0)
            b.close(linger=0)

    assert asyncio.run(main()) == [frames]
    ctx.term()


def test_a_send_to_a_vanished_client_does_not_swallow_anothers_message(tmp_path):
    # The bridge's ROUTER (ROUTER_MANDATORY) sends an event to a client that is gone: the
    # send fails with EHOSTUNREACH, and on its way ZMQ may consume the descriptor's
    # notification of a message another client has just sent. The waiting reader must
    # still wake (before the fix it slept until some later message arrived).
    endpoint = f"ipc://{tmp_path / 'router.sock'}"
    ctx = zmq.asyncio.Context()
    plain = zmq.Context()

    async def main():
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(endpoint)
        io = BatchedSocket(router)
        client = plain.socket(zmq.DEALER)
        client.connect(endpoint)
        try:
            client.send(b"hello")
            identity, _ = (await asyncio.wait_for(io.recv_batch(multipart=True), 5))[0]
            reader = asyncio.create_task(io.recv_batch(multipart=True))
            await asyncio.sleep(0.05)  # the reader is waiting on the descriptor
            client.send(b"stats?")
            time.sleep(0.1)  # arrived, and the event loop has not run since
            with pytest.raises(zmq.ZMQError) as failed:
                io.send_now([b"gone", b"an event"])
            assert failed.value.errno == zmq.EHOSTUNREACH
            return identity, await asyncio.wait_for(reader, 5)
        finally:
            client.close(linger=0)
            router.close(linger=0)

    identity, messages = asyncio.run(main())
    assert messages == [[identity, b"stats?"]]
    plain.term()
    ctx.term()
