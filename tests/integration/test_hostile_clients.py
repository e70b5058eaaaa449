"""Clients that hurt others by leaving, not reading, flooding or hogging: the daemon's
work and memory return to idle, everyone else's requests finish, nobody is killed as hung."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import msgspec
import zmq

from kvasir.client import AsyncClient, Client
from kvasir.transport import envelopes
from kvasir.wire.client import ClientEvent, ErrorEvent, Finished
from tests.support.daemon import settled
from tests.support.models import hf_greedy, random_prompts, reference_model
from tests.support.procs import bridge_of
from tests.support.wire import events

enc = msgspec.msgpack.encode


def dealer(ctx: zmq.Context, runtime_dir: Path, reading: bool = True) -> zmq.Socket:
    """A raw client socket; one that is not ``reading`` takes in almost nothing."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, -1)
    if not reading:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 1024)
    sock.connect(f"ipc://{runtime_dir / 'client.sock'}")
    return sock


def submit(key: int, ids: list[int], max_tokens: int, **extra) -> bytes:
    return enc(
        {
            "type": "submit",
            "key": key,
            "token_ids": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
    )


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


async def polite(runtime_dir: Path, prompts: list[list[int]], n: int) -> list:
    async with await AsyncClient.connect(runtime_dir) as client:
        streams = [await client.submit(token_ids=ids, max_tokens=n, temperature=0) for ids in prompts]
        return [await stream.result() for stream in streams]


def idle(runtime_dir: Path):
    """Stats once nothing is in the daemon: no request at the bridge or queued at the
    head, no KV held anywhere (or whatever there is after 120 s: 2,600 cancelled requests took
    over 30 s to leave on a loaded 2-core machine)."""
    stats = settled(runtime_dir, timeout_s=120.0)
    assert stats.in_flight == 0 and all(
        (s.head is None or s.head.waiting == 0) and s.kv.blocks == 0 for s in stats.stages
    ), stats
    return stats


def test_clients_that_vanish_or_stop_reading_leave_nothing_running(tiny_models, start_daemon):
    source = tiny_models["llama"]
    daemon = start_daemon(
        source,
        [(0, 3), (3, 6)],
        max_seq_len=64,
        num_blocks=800,
        max_waiting=5000,
        max_client_bytes=65536,
        heartbeat_timeout_s=5,
    ).wait_ready()
    prompts = random_prompts(320, [5, 11, 16, 7], seed=9)
    model = reference_model(source)
    ctx = zmq.Context()
    try:
        # 500 long submissions (their KV nine times the cache's 800 blocks), then gone: none may
        # stay queued at the head, outside every limit
        vanisher = dealer(ctx, daemon.runtime_dir)
        for key in range(500):
            vanisher.send(submit(key, [7] * 20, 40))
        vanisher.close()  # linger -1: every submission goes out first
        # 600 submissions from a client that reads nothing: cancelled once its events pass 64 KiB
        stuck = dealer(ctx, daemon.runtime_dir, reading=False)
        for key in range(600):
            stuck.send(submit(key, [9] * 10, 40))
        finals = asyncio.run(polite(daemon.runtime_dir, prompts, 6))
        assert [f.token_ids for f in finals] == [hf_greedy(model, ids, 6) for ids in prompts]
        stats = idle(daemon.runtime_dir)
        assert stats.clients_lost >= 2 and stats.client_bytes_waiting == 0
        assert stats.restarts == 0 and stats.state == "serving"
        assert "client lost: its requests are cancelled" in daemon.log()
        stuck.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_a_stats_flood_without_reading_is_bounded_and_starves_nobody(tiny_models, start_daemon):
    """Timeline stats replies are hundreds of times the query's size. A client sending
    them as fast as it can and reading none must not grow the bridge's memory without
    bound, nor keep its loop from beating its heartbeat (2 s here) or serving others."""
    source = tiny_models["llama"]
    daemon = start_daemon(
        source,
        [(0, 3), (3, 6)],
        max_seq_len=64,
        num_blocks=800,
        max_waiting=5000,
        max_rows=2,
        max_client_bytes=1 << 20,
        heartbeat_timeout_s=2,
    ).wait_ready()
    prompts = random_prompts(320, [6] * 40, seed=3)
    asyncio.run(polite(daemon.runtime_dir, prompts, 20))  # timelines to send: hundreds of batch spans per stage
    bridge = bridge_of(daemon.process.pid, daemon.child_pids())
    before = rss_kib(bridge)
    ctx = zmq.Context()
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        sock = dealer(ctx, daemon.runtime_dir, reading=False)
        query = enc({"type": "stats", "key": 1, "timeline": True})
        while not stop.is_set():
            sock.send(query)
            sent[0] += 1
        sock.close(linger=0)

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        time.sleep(1.0)
        model = reference_model(source)
        for _ in range(3):  # other clients are served all through the flood
            finals = asyncio.run(polite(daemon.runtime_dir, prompts[:4], 8))
            assert [f.token_ids for f in finals] == [hf_greedy(model, ids, 8) for ids in prompts[:4]]
        time.sleep(3.0)  # past the heartbeat timeout, still flooding
        grown = rss_kib(bridge) - before
    finally:
        stop.set()
        flooder.join()
        ctx.destroy(linger=0)
    with Client(daemon.runtime_dir) as client:
        stats = client.stats(timeline=True)
    offered = sent[0] * len(enc(stats)) // 1024  # KiB of replies: unbounded, the bridge would have held them all
    assert offered > 256 * 1024 and grown < min(200 * 1024, offered // 4), f"bridge grew by {grown} KiB of {offered}"
    assert stats.restarts == 0 and stats.clients_lost >= 1, stats
    assert bridge_of(daemon.process.pid, daemon.child_pids()) == bridge  # never killed as hung


def test_oversized_lists_and_texts_are_refused_before_any_walk(shared_daemon):
    daemon = shared_daemon  # every request here is refused: it is left as it was
    cases = {
        "stop list of 2,000,000": (submit(1, [5, 6], 4, stop_token_ids=[0] * 2_000_000), "invalid_request", "<= 256"),
        "prompt of 2,000,000 ids": (submit(2, [5] * 2_000_000, 4), "invalid_request", "<= 1048576"),
        "prompt of 1,000,000 ids": (submit(3, [5] * 1_000_000, 4), "too_long", "prompt of 1000000 tokens"),
        "15 MiB of text": (
            enc({"type": "submit", "key": 4, "prompt": "a" * (15 << 20)}),
            "invalid_request",
            "<= 4194304",
        ),
        "3 MiB of text": (
            enc({"type": "submit", "key": 5, "prompt": "ab " * (1 << 20)}),
            "too_long",
            "before tokenizing",
        ),
    }
    ctx = zmq.Context()
    decoder = msgspec.msgpack.Decoder(ClientEvent)
    try:
        sock = dealer(ctx, daemon.runtime_dir)
        for name, (frame, code, fragment) in cases.items():
            assert len(frame) < 16 << 20, name
            sock.send(frame)
            assert sock.poll(20_000), name
            (reply,) = events(decoder, sock.recv())
            assert isinstance(reply, ErrorEvent) and reply.code == code and fragment in reply.message, (name, reply)
            assert reply.key is not None, name  # the client's stream for it ends
        sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    with Client(daemon.runtime_dir) as client:
        final = client.generate("hello ring", max_tokens=4, temperature=0)
        assert isinstance(final, Finished)
        assert client.stats().restarts == 0


NESTED = b"\x91" * 1000 + b"\xc0"  # about 1 KB of [[[...]]]: msgspec raises RecursionError on it


def test_deeply_nested_messages_get_an_error_and_the_bridge_keeps_serving(tiny_models, shared_daemon):
    """Three ~1 KB bodies that make msgspec recurse past its limit: as a batch, as a
    field of a submission, as a batch member. The bridge used to lose its client reader
    to the first (and nothing noticed: every client hung); each now gets an error."""
    source, daemon = tiny_models["llama-tokenizer"], shared_daemon
    nested_field = b"\x83\xa4type\xa6submit\xa3key\x07\xa9token_ids" + NESTED
    nested_member = envelopes.join([submit(8, [5, 6], 2), b"\x81\xa4type" + NESTED])
    ctx = zmq.Context()
    decoder = msgspec.msgpack.Decoder(ClientEvent)
    try:
        sock = dealer(ctx, daemon.runtime_dir)
        for frame, fragment in (
            (NESTED, "nested too deeply"),
            (nested_field, "malformed message"),
            (nested_member, "nested"),
        ):
            sock.send(frame)
            assert sock.poll(10_000), fragment  # answered: the reader is alive
            (reply,) = events(decoder, sock.recv())
            assert isinstance(reply, ErrorEvent) and reply.code == "invalid_request", reply
            assert fragment in reply.message, reply
        sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    prompts = random_prompts(320, [5, 7], seed=11)
    finals = asyncio.run(polite(daemon.runtime_dir, prompts, 4))
    model = reference_model(source)
    assert [f.token_ids for f in finals] == [hf_greedy(model, ids, 4) for ids in prompts]
    with Client(daemon.runtime_dir) as client:
        assert client.stats().restarts == 0


def test_one_clients_long_requests_do_not_keep_others_waiting(tiny_models, start_daemon):
    """The cache holds four of the hog's requests at a time and 20 more wait. Admission
    is fair across clients, so another client's request, enqueued after all of the hog's,
    goes in as soon as one of the hog's ends, not after all twenty (first-in-first-out
    admission would finish at least twenty of them first); a request over the ceiling is
    refused. No wait on a stats figure: a fast machine may drain the queue between two
    stats samples."""
    source = tiny_models["llama"]
    daemon = start_daemon(
        source,
        [(0, 3), (3, 6)],
        max_seq_len=64,
        block_size=4,
        num_blocks=36,
        max_rows=4,
        max_waiting=1000,
        max_tokens_per_request=30,
    ).wait_ready()

    async def main():
        async with (
            await AsyncClient.connect(daemon.runtime_dir) as hog,
            await AsyncClient.connect(daemon.runtime_dir) as other,
        ):
            hogs = [
                asyncio.create_task(
                    (await hog.submit(token_ids=[5, 6, 7, 8], max_tokens=30, ignore_eos=True, temperature=0)).result()
                )
                for _ in range(24)
            ]
            too_many = await (await other.submit(token_ids=[5], max_tokens=31)).result()
            # Every hog request was accepted, so the bridge enqueued them all before this one.
            mine = await (await other.submit(token_ids=[9, 9, 9], max_tokens=4, temperature=0)).result()
            done_before = sum(1 for task in hogs if task.done())
            finals = [await task for task in hogs]
            return too_many, mine, done_before, finals

    too_many, mine, done_before, finals = asyncio.run(main())
    assert isinstance(too_many, ErrorEvent) and too_many.code == "invalid_request"
    assert "bridge.max_tokens_per_request" in too_many.message
    assert isinstance(mine, Finished) and len(mine.token_ids) == 4
    assert done_before <= 8, f"the other client waited for {done_before} of the hog's requests"
    assert all(isinstance(f, Finished) and len(f.token_ids) == 30 for f in finals)
