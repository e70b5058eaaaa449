"""Garbage on every socket in the runtime dir: random frames, messages of the wrong type,
truncated messages, oversized frames and bytes that are not even ZMTP. The launcher
never exits, nothing restarts, and the daemon answers a normal request exactly after.

One plan is disaggregated, so the runtime dir holds every kind of ring socket there is:
clients, events, the bridge's inbox, the launcher's control socket, every child's command
socket, each stage's inbox (heads: requests and results; others: descriptors), the
credit sockets and the decode stages' KV hand-off sockets. The other runs a mixture of
experts with expert shards: each shard's work socket and each stage's result socket.
"""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir.client import Client
from kvasir.wire.batch import BatchDescriptor, Credit, Row, SampledToken
from kvasir.wire.bridge import RequestEnded, TokenEvents
from kvasir.wire.control import Drained, Heartbeat, Ready
from kvasir.wire.experts import ExpertDone, ExpertWork
from kvasir.wire.head import Adopted, BatchResult, CancelRequest, KvDrop, KvHeld, KvPlaced
from kvasir.wire.kv import Placement
from tests.support.models import hf_greedy, reference_model

NOBODY = 10**9  # a request id nothing in the daemon has
# every internal message type, with values no real sender would use (a slot out of
# range, a batch not in flight, a pid that is not a child): whichever socket gets one
# either cannot decode it or recognises it as a stray
SAMPLES = [
    Credit(99),
    BatchResult(999_999, (SampledToken(NOBODY, 5, 0, None),)),
    CancelRequest(NOBODY),
    Ready("stage", 0, 1),
    Heartbeat("bridge", 0, 1),
    Drained(),
    KvDrop(NOBODY),
    KvHeld(NOBODY, 3, 10, 10, 10),
    KvPlaced(NOBODY),
    Adopted(NOBODY),
    Placement(NOBODY, ()),
    TokenEvents((SampledToken(NOBODY, 5, 0, "stop"),)),
    RequestEnded(NOBODY, "cancelled"),
    BatchDescriptor(7, 99, 1, (Row(NOBODY, 0, 1, (0,), True),), (), (), 0),
    ExpertWork(NOBODY, 999, 1),  # a layer no shard holds
    ExpertWork(NOBODY, 0, 10**6),  # more rows than any slot
    ExpertDone(NOBODY, 0, 1),  # a result for a dispatch never sent
    ExpertDone(0, 77, 1),  # from a shard that does not exist
]
ENCODED = [msgspec.msgpack.encode(m) for m in SAMPLES] + [
    msgspec.msgpack.encode({"type": "submit", "key": 1, "token_ids": [1]}),  # a client message inside
    msgspec.msgpack.encode(["Enqueue", "not an id"]),
]
frames = st.one_of(
    st.binary(max_size=80),
    st.sampled_from(ENCODED),
    st.sampled_from(ENCODED).flatmap(lambda e: st.integers(0, len(e) - 1).map(lambda n: e[:n])),  # truncated
    st.sampled_from(ENCODED).flatmap(lambda e: st.binary(min_size=1, max_size=8).map(lambda tail: e + tail)),
)
messages = st.lists(frames, min_size=1, max_size=3)
NESTED = [
    b"\x91" * 1000 + b"\xc0",  # [[[...]]]
    b"\x93\xa1x" + b"\x91" * 5000 + b"\xc0",  # a nested member of an array-like message
    b"\x82\xa4type\xa6submit\xa1x" + b"\x91" * 5000 + b"\xc0",  # a nested field of a map
]


def garbage_socket(ctx: zmq.Context, name: str):
    kind = {"client.sock": zmq.DEALER, "events.sock": zmq.XSUB}.get(name, zmq.PUSH)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDTIMEO, 5000)  # a daemon that died fails the test instead of hanging it
    return sock


def raw_bytes(path, data: bytes) -> None:
    """Bytes straight onto the unix socket: not a ZMQ peer at all."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(path))
        try:
            raw.sendall(data)
        except OSError:
            pass  # ZMQ hung up on us: fine


PLANS = {
    "disaggregated": ("llama", {"prefill": [(0, 3), (3, 6)], "decode": [(0, 2), (2, 6)]}, {}),
    "expert-shards": ("mixtral", [(0, 3), (3, 6)], {"experts": {0: [(0, 3), (3, 8)], 1: [(0, 8)]}}),
}
EXPECTED = {
    "disaggregated": ["stage-1.sock", "stage-2.sock", "credits-0.sock", "kv-2.sock", "kv-3.sock"],
    "expert-shards": ["shard-0.sock", "shard-2.sock", "experts-0.sock", "experts-1.sock", "command-shard-1.sock"],
}


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_garbage_on_every_socket_of_the_runtime_dir(tiny_models, start_daemon, kind):
    family, splits, keys = PLANS[kind]
    source = tiny_models[family]
    daemon = start_daemon(source, splits, name=kind, max_seq_len=64, num_blocks=200, **keys).wait_ready()
    names = sorted(path.name for path in daemon.runtime_dir.glob("*.sock"))
    common = ["client.sock", "events.sock", "bridge-in.sock", "control.sock", "command-bridge.sock"]
    for expected in [*common, "command-stage-0.sock", "stage-0.sock", *EXPECTED[kind]]:
        assert expected in names, names
    spray_every_socket(daemon, names)
    time.sleep(2.0)  # past a few heartbeats and stats reports
    assert daemon.process.poll() is None, daemon.log()
    with Client(daemon.runtime_dir) as client:
        final = client.generate(token_ids=[4, 8, 15], max_tokens=6, temperature=0)
        stats = client.stats()
    assert final.token_ids == hf_greedy(reference_model(source), [4, 8, 15], 6)
    assert stats.state == "serving" and stats.restarts == 0 and stats.last_failure is None, stats
    assert stats.malformed > 0  # the bridge counted what it dropped
    assert "dropped a malformed internal message" in daemon.log()


def spray_every_socket(daemon, names: list[str]) -> None:
    """Hypothesis-generated garbage on each socket, then an oversized frame and raw bytes."""
    ctx = zmq.Context()
    sockets = {}
    for name in names:
        sockets[name] = garbage_socket(ctx, name)
        sockets[name].connect(f"ipc://{daemon.runtime_dir / name}")
    sent = [0]

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(messages, min_size=len(names), max_size=len(names)))
    def spray(batch):
        for name, parts in zip(names, batch):
            sockets[name].send_multipart(parts)
            sent[0] += 1

    try:
        for sock in sockets.values():  # nesting deep enough for msgspec to raise RecursionError
            for frame in NESTED:
                sock.send(frame)
        spray()
        sockets["control.sock"].send(b"\x00" * (65 << 20))  # past the internal frame limit: that connection goes
        for name in names:
            raw_bytes(daemon.runtime_dir / name, b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
    finally:
        ctx.destroy(linger=2000)  # what was sent is delivered first
    assert sent[0] >= 150 * len(names)
