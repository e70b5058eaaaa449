"""The KV hand-off between hosts (kvasir/stage/kv_remote.py): a prefill stage on another
host streams its K/V in chunks over a real ZMQ socket, the decode stage copies them into
its blocks exactly as it copies a shared-memory segment's, and anything malformed is a
worker failure (EdgeError)."""

from __future__ import annotations

import os
import secrets

import msgspec
import pytest
import torch
import zmq

from kvasir.errors import KvasirError
from kvasir.model.kv_cache import PagedKVCache
from kvasir.ring.tcp_slots import EdgeError
from kvasir.stage import kv_remote
from kvasir.stage.handoff import KvReceiver
from kvasir.stage.kv_remote import KvInbox, KvStream
from kvasir.stage.kv_segment import KvSegmentMap
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.control import HandoffWiring, KvSegment
from kvasir.wire.head import HeadMessage
from kvasir.wire.kv import KvChunk, KvMessage, KvReady, Placement

CPU = torch.device("cpu")


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    made = []

    def pair(name: str) -> tuple[zmq.Socket, zmq.Socket]:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"inproc://{name}")
        push.connect(f"inproc://{name}")
        made.extend([pull, push])
        return pull, push

    yield pair
    for sock in made:
        sock.close(linger=0)
    ctx.term()


def random_cache(layers: int, num_blocks: int, block_size: int, seed: int) -> PagedKVCache:
    cache = PagedKVCache(layers, num_blocks, block_size, 2, 4, dtype=torch.float32, device=CPU)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=torch.Generator().manual_seed(seed)))
    cache.values.copy_(torch.randn(cache.values.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return cache


def test_a_decode_stage_gets_streamed_and_shared_kv_alike(sockets, monkeypatch):
    """Decode stage 2 (host b, layers [1, 4)) takes [1, 2) from prefill stage 0's segment on
    its own host and [2, 4) from prefill stage 1 on host a, streamed three tokens a chunk."""
    monkeypatch.setattr(kv_remote, "CHUNK_BYTES", 3 * 2 * 2 * 2 * 4 * 4)  # 2 layers x 3 tokens, keys and values
    segment = KvSegment(
        name=f"kvasir-test-{os.getpid()}-{secrets.token_hex(3)}",
        layers=(0, 2),
        num_blocks=6,
        block_size=8,
        kv_heads=2,
        head_dim=4,
        dtype="float32",
    )
    local = KvSegmentMap(segment, create=True)
    try:
        local.keys.copy_(torch.randn(local.keys.shape))
        local.values.copy_(torch.randn(local.values.shape))
        remote = random_cache(3, 6, 8, seed=5)  # prefill stage 1's cache: layers [2, 5)
        far = KvSegment(**{**msgspec.structs.asdict(segment), "name": "unused", "layers": (2, 5)})
        wiring = wiring_of([segment, far], hosts=["b", "a", "b"])
        cache = PagedKVCache(3, 10, 4, 2, 4, dtype=torch.float32, device=CPU)
        kv_pull, kv_push = sockets("kv")
        head_pull, head_push = sockets("head")
        receiver = KvReceiver(
            2, (1, 4), cache, wiring, KvInbox(PullChannel(kv_pull, KvMessage), cache, 64), PushChannel(head_push)
        )
        assert set(receiver.sources) == {0} and receiver.remote == {1: (2, 4)}
        head = PullChannel(head_pull, HeadMessage)
        blocks, placed = (3, 1), (7, 2, 5)
        sent = KvStream(kv_push, remote, (2, 5), (2, 4)).send(KvReady(11, 1, (2, 5), blocks, 10, 0))
        assert sent == 2 * 2 * 10 * 2 * 4 * 4
        to_stage = PushChannel(kv_push)
        to_stage.send(KvReady(11, 0, (0, 2), blocks, 10, 0))
        receiver.receive()
        assert head.drain() == []  # announced, not placed
        to_stage.send(Placement(11, placed))
        receiver.receive()
        [held] = head.drain()
        assert (held.request_id, held.nbytes) == (11, 2 * 3 * 10 * 2 * 4 * 4)
        for pos in range(10):
            src, dst = blocks[pos // 8] * 8 + pos % 8, placed[pos // 4] * 4 + pos % 4
            assert torch.equal(cache.keys[0, dst], local.keys[1, src])
            assert torch.equal(cache.keys[1:3, dst], remote.keys[0:2, src])
            assert torch.equal(cache.values[1:3, dst], remote.values[0:2, src])
        assert receiver.assembling == {}
    finally:
        local.close()
        local.unlink()


def chunk_frames(chunk: KvChunk, nbytes: int, frames: int = 2) -> list[bytes]:
    return [msgspec.msgpack.encode(chunk), *[bytes(nbytes)] * frames]


@pytest.mark.parametrize(
    "frames, why",
    [
        (chunk_frames(KvChunk(1, 1, (2, 4), 0, 3, 10), 2 * 3 * 2 * 4 * 4, frames=1), "frames of"),
        (chunk_frames(KvChunk(1, 1, (2, 4), 0, 3, 10), 100), "frames of"),
        (chunk_frames(KvChunk(1, 1, (2, 4), 9, 3, 10), 2 * 3 * 2 * 4 * 4), "positions or layers"),
        (chunk_frames(KvChunk(1, 1, (2, 2), 0, 3, 10), 0), "positions or layers"),
        (chunk_frames(KvChunk(1, 0, (1, 3), 0, 3, 10), 2 * 3 * 2 * 4 * 4), "does not stream"),
        (chunk_frames(KvChunk(1, 1, (2, 4), 3, 3, 10), 2 * 3 * 2 * 4 * 4), "out of order"),
        (chunk_frames(KvChunk(1, 1, (2, 4), 0, 3, 1 << 40), 2 * 3 * 2 * 4 * 4), "positions or layers"),  # no 2^40 alloc
        (chunk_frames(KvChunk(1, 1, (2, 4), 0, 3, 65), 2 * 3 * 2 * 4 * 4), "positions or layers"),  # past max_seq_len
        (
            chunk_frames(KvChunk(1, 1, (0, 9), 0, 3, 10), 9 * 3 * 2 * 4 * 4),
            "positions or layers",
        ),  # more layers than held
    ],
)
def test_a_malformed_chunk_fails_the_stage(sockets, frames, why):
    cache = PagedKVCache(3, 10, 4, 2, 4, dtype=torch.float32, device=CPU)
    far = KvSegment(name="x", layers=(2, 5), num_blocks=6, block_size=8, kv_heads=2, head_dim=4, dtype="float32")
    wiring = wiring_of([far, far], hosts=["a", "a", "b"])
    kv_pull, kv_push = sockets("kv")
    _, head_push = sockets("head")
    receiver = KvReceiver(
        2, (1, 4), cache, wiring, KvInbox(PullChannel(kv_pull, KvMessage), cache, 64), PushChannel(head_push)
    )
    kv_push.send_multipart(frames)
    with pytest.raises(EdgeError, match=why):
        receiver.receive()


def wiring_of(prefill: list[KvSegment], hosts: list[str]) -> HandoffWiring:
    """One prefill instance of ``prefill``'s stages, then one decode stage of layers [1, 4)."""
    return HandoffWiring(
        segments=dict(enumerate(prefill)),
        layers=[s.layers for s in prefill] + [(1, 4)],
        lease_s=60.0,
        prefill_heads=[0],
        decode_heads=[len(prefill)],
        hosts=hosts,
    )


def streamed_to(sockets, expiry_s: float = 60.0) -> tuple[zmq.Socket, KvInbox, KvReceiver]:
    """Decode stage 1 (host b, layers [1, 4)), fed by prefill stage 0 on host a: the socket
    to send it chunks on, its inbox and its receiver."""
    cache = PagedKVCache(3, 10, 4, 2, 4, dtype=torch.float32, device=CPU)
    far = KvSegment(name="x", layers=(2, 5), num_blocks=6, block_size=8, kv_heads=2, head_dim=4, dtype="float32")
    wiring = wiring_of([far], hosts=["a", "b"])
    kv_pull, kv_push = sockets("kv")
    _, head_push = sockets("head")
    inbox = KvInbox(PullChannel(kv_pull, KvMessage), cache, 64)
    return kv_push, inbox, KvReceiver(1, (1, 4), cache, wiring, inbox, PushChannel(head_push), expiry_s=expiry_s)


def test_an_announcement_before_its_chunks_and_garbage_are_refused(sockets):
    kv_push, inbox, receiver = streamed_to(sockets)
    kv_push.send(b"\x93not a message")
    kv_push.send_multipart([msgspec.msgpack.encode(Placement(3, (1,))), b"extra"])
    receiver.receive()
    assert inbox.channel.dropped == 2  # dropped and counted, as any internal channel does
    kv_push.send(msgspec.msgpack.encode(KvReady(4, 0, (2, 5), (), 10, 0)))
    with pytest.raises(KvasirError, match="announced before all its chunks"):
        receiver.receive()


def test_a_partial_hand_off_expires_and_its_late_chunks_are_ignored(sockets):
    import time

    kv_push, _, receiver = streamed_to(sockets, expiry_s=0.05)
    nbytes = 2 * 3 * 2 * 4 * 4
    kv_push.send_multipart(chunk_frames(KvChunk(5, 0, (2, 4), 0, 3, 10), nbytes))  # 3 of 10 positions
    receiver.receive()
    assert set(receiver.assembling) == {5}
    time.sleep(0.1)
    receiver.receive()
    assert receiver.assembling == {} and receiver.expired == 1
    kv_push.send_multipart(chunk_frames(KvChunk(5, 0, (2, 4), 3, 3, 10), nbytes))  # late: ignored, no failure
    receiver.receive()
    assert receiver.assembling == {}
