"""Overload: per-client limits, and memory that stays bounded under a submission flood."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from kvasir.client import AsyncClient
from kvasir.wire.client import Accepted, ClientEvent, ErrorEvent, Finished
from tests.support.daemon import serving_daemon
from tests.support.procs import bridge_of, children_of
from tests.support.wire import events


async def per_client(runtime_dir: Path):
    async with await AsyncClient.connect(runtime_dir) as greedy, await AsyncClient.connect(runtime_dir) as other:
        mine = [
            await greedy.submit(token_ids=[5, 6, 7], max_tokens=60, temperature=0, ignore_eos=True) for _ in range(5)
        ]
        theirs = await other.submit(token_ids=[5, 6, 7], max_tokens=3, temperature=0)
        results = await asyncio.gather(*(s.result() for s in mine))
        return results, await theirs.result()


def test_one_client_cannot_take_more_than_its_share(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], max_waiting=100, max_per_client=3).wait_ready()
    results, theirs = asyncio.run(per_client(daemon.runtime_dir))
    refused = [r for r in results if isinstance(r, ErrorEvent)]
    assert sum(isinstance(r, Finished) for r in results) == 3 and len(refused) == 2
    assert all(r.code == "overloaded" and "bridge.max_per_client" in r.message for r in refused)
    assert isinstance(theirs, Finished)  # another client still gets in


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def flood(runtime_dir: Path, clients: int, each: int, prompt: list[int]) -> dict[str, int]:
    """``clients`` connections each submit ``each`` requests as fast as they can and read
    every answer; the count of each kind of answer."""
    counts: dict[str, int] = {}

    async def one():
        async with await AsyncClient.connect(runtime_dir) as client:
            streams = [await client.submit(token_ids=prompt, max_tokens=4, temperature=0) for _ in range(each)]
            for stream in streams:
                result = await stream.result()
                kind = result.code if isinstance(result, ErrorEvent) else type(result).__name__
                counts[kind] = counts.get(kind, 0) + 1

    await asyncio.gather(*(one() for _ in range(clients)))
    return counts


def test_memory_stays_bounded_under_a_submission_flood(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], max_waiting=64, max_per_client=32).wait_ready()
    stages = set(daemon.child_pids())
    children = children_of(daemon.process.pid)
    bridge = bridge_of(daemon.process.pid, stages)
    watched = {"bridge": bridge, "head": min(stages, key=lambda pid: children.index(pid))}
    prompt = [257 + i % 60 for i in range(200)]  # ids above CPython's small-int cache: each costs memory
    asyncio.run(flood(daemon.runtime_dir, 2, 2_000, prompt))  # warm up: allocators, caches
    before = {name: rss_bytes(pid) for name, pid in watched.items()}
    counts = asyncio.run(flood(daemon.runtime_dir, 4, 10_000, prompt))
    after = {name: rss_bytes(pid) for name, pid in watched.items()}
    growth = {name: after[name] - before[name] for name in watched}
    print(f"answers {counts}; RSS before {before}, growth {growth}")
    assert sum(counts.values()) == 40_000 and counts.get("overloaded", 0) > 0
    assert set(counts) <= {"Finished", "overloaded"}
    # unbounded, the head would keep 40,000 waiting prompts: 8 million token ids, hundreds
    # of MiB; bounded queues keep the bridge and the head near where they started
    for name, grew in growth.items():
        assert grew < 100 * 2**20, f"{name} grew by {grew / 2**20:.0f} MiB"


def raw_dealer(runtime_dir: Path):
    """A bare ZMQ client: it sends what the tests say and reads only when told to."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10)
    sock.connect(f"ipc://{runtime_dir / 'client.sock'}")
    return ctx, sock


def submit_raw(sock, count: int, max_tokens: int) -> None:
    import msgspec

    from kvasir.wire.client import Submit

    for key in range(count):
        sock.send(
            msgspec.msgpack.encode(
                Submit(key=key, token_ids=[5, 6, 7], max_tokens=max_tokens, temperature=0, ignore_eos=True)
            )
        )


def wait_idle(runtime_dir: Path, requests: int, timeout_s: float = 60.0) -> tuple[int, int]:
    """Once the daemon has taken ``requests`` (a total) and holds none: its requests and
    output tokens."""
    import time

    from kvasir.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(runtime_dir) as client:
        while time.monotonic() < deadline:
            stats = client.stats()
            if stats.requests >= requests and stats.in_flight == 0:
                return stats.requests, stats.tokens_out
            time.sleep(0.1)
    raise AssertionError("requests of a client that is gone kept running")


@pytest.fixture(scope="module")
def lossy(tiny_models, tmp_path_factory):
    """The Llama's two stages with a client's queue of 50 events, for the tests of clients
    that leave or stop reading (each counts from what the daemon has done before it)."""
    with serving_daemon(
        tmp_path_factory.mktemp("lossy"), tiny_models["llama"], [(0, 3), (3, 6)], max_client_queue=50
    ) as daemon:
        yield daemon


def test_a_client_that_disconnects_loses_its_requests(lossy):
    daemon = lossy
    requests, tokens = wait_idle(daemon.runtime_dir, 0)  # what the module's tests did before
    ctx, sock = raw_dealer(daemon.runtime_dir)
    submit_raw(sock, 8, 240)
    decoder = msgspec.msgpack.Decoder(ClientEvent)
    accepted = 0
    while accepted < 8:  # all in the daemon (the tokens start meanwhile)
        accepted += sum(isinstance(event, Accepted) for event in events(decoder, sock.recv()))
    sock.close()
    ctx.term()
    after, tokens_after = wait_idle(daemon.runtime_dir, requests + 8)
    assert after == requests + 8 and tokens_after - tokens < 8 * 240 // 2  # cancelled, not run to the end for nobody
    assert "client lost" in daemon.log() and "disconnected" in daemon.log()


def test_a_client_that_stops_reading_loses_its_requests_and_others_are_served(lossy):
    daemon = lossy
    requests, tokens = wait_idle(daemon.runtime_dir, 0)  # what the module's tests did before
    ctx, sock = raw_dealer(daemon.runtime_dir)
    submit_raw(sock, 60, 200)  # 12,000 events that it never reads: more than the socket buffers hold
    after, tokens_after = wait_idle(daemon.runtime_dir, requests + 60)
    assert after == requests + 60 and tokens_after - tokens < 60 * 200
    assert "stopped reading its events" in daemon.log()
    others = asyncio.run(flood(daemon.runtime_dir, 1, 3, [5, 6, 7]))
    assert others == {"Finished": 3}
    sock.close()
    ctx.term()
