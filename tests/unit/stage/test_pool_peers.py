"""The KV pool across hosts (kvasir/stage/pool_peers.py) on real sockets and files: a
stage serves its stored slices, another reads them in order within a window and a
deadline, and a stage's load takes from another host what its own tiers lack."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from kvasir.kvpool.slices import SliceMeta
from kvasir.kvpool.stage_side import StagePool
from kvasir.logs import setup_logging
from kvasir.model.kv_cache import PagedKVCache
from kvasir.stage.pool_peers import PeerFetcher, SliceServer
from kvasir.stage.pooling import Peers, PoolRole
from kvasir.transport.channels import PushChannel
from kvasir.transport.routes import RouteError
from kvasir.wire.batch import BatchDescriptor, PoolLoad
from kvasir.wire.bridge import BridgeMessage
from kvasir.wire.head import PoolLoaded
from tests.support.kvpool import SECRET, make_tier

LAYERS = (0, 2)
TEMPLATE = SliceMeta(model="m/float32", layers=LAYERS, block_size=4, kv_heads=2, head_dim=8, dtype="float32", key=b"")
KEYS = [bytes([n]) * 16 for n in range(1, 7)]


def cache(seed: int) -> PagedKVCache:
    kv = PagedKVCache(2, 8, 4, 2, 8, dtype=torch.float32, device=torch.device("cpu"))
    kv.keys.copy_(torch.randn(kv.keys.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def stored(pool: StagePool, count: int) -> None:
    for _ in range(500):
        if len(pool.tiers["host"]) >= count:
            return
        time.sleep(0.01)
    raise AssertionError("the writer did not store the slices")


@pytest.fixture
def hosts(tmp_path):
    """(the serving host's pool, its server, the other host's fetcher, the context)."""
    context = zmq.Context()
    there = StagePool(cache(1), {"host": make_tier(tmp_path / "there", 1 << 20)}, TEMPLATE, 1 << 20, secret=SECRET)
    there.spill([(k, KEYS[k]) for k in range(4)])  # blocks 0-3 hold keys 1-4
    stored(there, 4)
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://kvpool-7")
    server = SliceServer(router, list(there.tiers.values()), LAYERS, there.size)

    def connect(peer: int) -> zmq.Socket:
        if peer > 50:
            raise RouteError(f"no worker of the plan owns a socket called 'kvpool-{peer}'")
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"inproc://kvpool-{peer}")
        return dealer

    fetcher = PeerFetcher(connect, LAYERS, window=2)
    yield there, server, fetcher, context
    fetcher.close()
    server.close()
    there.close()
    context.term()


def test_slices_come_in_order_up_to_the_first_the_other_host_lacks(hosts):
    there, server, fetcher, _ = hosts
    got = list(fetcher.fetch(7, KEYS, time.monotonic() + 5))  # keys 5 and 6 were never stored there
    assert len(got) == 4 and server.served == 4
    assert got[2] == (there.tiers["host"].folder.path / f"{KEYS[2].hex()}.0-2.kv").read_bytes()
    assert fetcher.fetched_bytes == sum(len(data) for data in got)
    other = PeerFetcher(fetcher.connect, (0, 3))
    assert list(other.fetch(7, KEYS, time.monotonic() + 5)) == []  # other layers: nothing is served
    other.close()


def test_a_fetch_gives_up_at_its_deadline_and_garbage_is_dropped(hosts):
    _, server, fetcher, context = hosts
    silent = context.socket(zmq.ROUTER)
    silent.bind("inproc://kvpool-9")  # a peer that never answers
    started = time.monotonic()
    assert list(fetcher.fetch(9, KEYS, started + 0.3)) == []
    assert 0.25 < time.monotonic() - started < 5
    silent.close(linger=0)
    assert list(fetcher.fetch(99, KEYS, time.monotonic() + 5)) == [] and fetcher.unknown == 1  # no such stage
    rogue = context.socket(zmq.DEALER)
    rogue.connect("inproc://kvpool-7")
    rogue.send(b"\xc1 not msgpack")
    assert len(list(fetcher.fetch(7, KEYS[:1], time.monotonic() + 5))) == 1  # still serving
    assert server.malformed == 1
    rogue.close(linger=0)


def test_a_load_takes_what_its_host_lacks_from_the_other_host(hosts, tmp_path):
    there, _, fetcher, context = hosts
    here = StagePool(cache(2), {"host": make_tier(tmp_path / "here", 1 << 20)}, TEMPLATE, 1 << 20, secret=SECRET)
    here.spill([(0, KEYS[0])])  # this host has the first block only
    stored(here, 1)
    answers: list[PoolLoaded] = []
    push = context.socket(zmq.PUSH)
    push.bind("inproc://bridge")
    role = PoolRole(
        here, 3, 1, answers.append, PushChannel[BridgeMessage](push), setup_logging("warning"),
        peers=Peers(SliceServer(context.socket(zmq.ROUTER), [], LAYERS, here.size), fetcher, 5.0),
    )  # fmt: skip
    load = PoolLoad(11, (4, 5, 6, 7), tuple(KEYS[:4]), peers=((3, 7),))
    role.before(BatchDescriptor(0, -1, 0, (), (), (), 0, load=(load,)))
    assert answers == [PoolLoaded(11, 3, ("host", "remote", "remote", "remote"))]
    assert torch.equal(here.cache.keys[:, 20:32], there.cache.keys[:, 4:16])  # blocks 5-7 = there's 1-3
    assert role.counters().remote_bytes > 0
    assert [(r.tier, r.slices, r.peer) for r in role.counters().reads] == [("host", 1, -1), ("remote", 3, 7)]
    role.close()
    push.close(linger=0)
