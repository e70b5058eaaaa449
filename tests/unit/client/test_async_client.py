"""The client library's failure messages say what the connection did."""

from __future__ import annotations

import socket

import pytest

from kvasir.client import Client, NoDaemon, Remote
from tests.support.daemon import free_port


def test_nothing_listening_is_named(tmp_path):
    with pytest.raises(NoDaemon, match="nothing accepted the connection within 1 s"):
        Client(tmp_path, timeout_s=1.0, remote=Remote(f"tcp://127.0.0.1:{free_port()}"))


def test_a_silent_listener_is_not_a_daemon(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # accepts TCP, never speaks ZMQ
        with pytest.raises(NoDaemon, match="a connection was made, but no answer came within 1 s"):
            Client(tmp_path, timeout_s=1.0, remote=Remote(f"tcp://127.0.0.1:{s.getsockname()[1]}"))


def test_messages_queued_just_before_closing_still_leave(tmp_path):
    """A cancel followed at once by close (what `kvasir generate` does on Ctrl-C) reaches
    the bridge: here a ROUTER standing in for it, which answers the connect's stats query
    and records what else arrives, batches opened."""
    import asyncio
    import threading

    import msgspec
    import zmq

    from kvasir.client import AsyncClient
    from kvasir.transport import envelopes
    from kvasir.wire.client import Cancel, ClientMessage, DaemonStats, StatsQuery, StatsReply

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    got: list = []
    EMPTY = DaemonStats(uptime_s=1.0, requests=0, in_flight=0, waiting_limit=1, vocab_size=1, max_seq_len=1, stages=[])

    def bridge() -> None:
        while router.poll(5_000):
            identity, body = router.recv_multipart()
            for member in envelopes.members(body):
                message = decoder.decode(member)
                got.append(message)
                if isinstance(message, StatsQuery):
                    reply = StatsReply(key=message.key, stats=EMPTY)
                    router.send_multipart([identity, msgspec.msgpack.encode(reply)])
            if any(isinstance(m, Cancel) for m in got):
                return

    async def client() -> None:
        remote = Remote(f"tcp://127.0.0.1:{port}")
        connected = await AsyncClient.connect(tmp_path, timeout_s=5.0, remote=remote)
        await connected.cancel(41)
        await connected.cancel(42)
        await connected.close()  # in the same turn: neither cancel was sent yet

    fake = threading.Thread(target=bridge)
    fake.start()
    try:
        asyncio.run(client())
        fake.join(10)
    finally:
        router.close(linger=0)
        ctx.term()
    assert [m.request_id for m in got if isinstance(m, Cancel)] == [41, 42]
