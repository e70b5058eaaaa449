"""A stage's side of the pool (kvasir/kvpool/stage_side.py) on a real paged KV cache:
evicted blocks' slices written down and read back bit for bit into other blocks; a full
queue drops, a corrupt slice is never used, a failed writer fails the stage loudly."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from kvasir.kvpool.disk import file_name
from kvasir.kvpool.slices import SliceMeta, encode_slice
from kvasir.kvpool.stage_side import StagePool
from kvasir.model.kv_cache import PagedKVCache
from tests.support.kvpool import SECRET, make_tier

TEMPLATE = SliceMeta(model="m/float32", layers=(2, 5), block_size=4, kv_heads=2, head_dim=8, dtype="float32", key=b"")


def cache() -> PagedKVCache:
    kv = PagedKVCache(3, 8, 4, 2, 8, dtype=torch.float32, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    kv.keys.copy_(torch.randn(kv.keys.shape, generator=generator))
    kv.values.copy_(torch.randn(kv.values.shape, generator=generator))
    return kv


def settle(pool: StagePool, count: int, tier: str = "disk") -> list[bytes]:
    """The keys the writer stored in ``tier``, once there are ``count`` (bounded wait)."""
    stored: list[bytes] = []
    for _ in range(500):
        stored += [key for events in pool.take_events() if events.tier == tier for key in events.stored]
        if len(stored) >= count:
            return stored
        time.sleep(0.01)
    raise AssertionError(f"{len(stored)} of {count} slices stored")


def test_spilled_slices_come_back_bit_for_bit_in_other_blocks(tmp_path):
    kv = cache()
    pool = StagePool(kv, {"disk": make_tier(tmp_path, 1 << 20)}, TEMPLATE, 1 << 20, secret=SECRET)
    before = kv.keys[:, 4:8].clone(), kv.values[:, 4:8].clone()  # block 1
    pool.spill([(1, b"a" * 16), (2, b"b" * 16)])
    assert sorted(settle(pool, 2)) == [b"a" * 16, b"b" * 16]
    kv.keys[:, 4:8] = 0  # block 1 reused by another request
    assert pool.load(6, b"a" * 16) == "disk"  # the prefix comes back into block 6
    assert torch.equal(kv.keys[:, 24:28], before[0]) and torch.equal(kv.values[:, 24:28], before[1])
    assert pool.load(7, b"z" * 16) is None and pool.counters.missing == 1  # never stored
    pool.close()


def test_a_full_queue_drops_and_a_corrupt_slice_is_never_used(tmp_path):
    kv = cache()
    tier = make_tier(tmp_path, 1 << 20)
    cramped = StagePool(
        kv, {"disk": make_tier(tmp_path / "cramped", 1 << 20)}, TEMPLATE, TEMPLATE.payload_bytes - 1, secret=SECRET
    )
    cramped.spill([(0, b"a" * 16), (1, b"b" * 16)])  # no room for one slice queued: dropped, not waited for
    assert cramped.counters.dropped == 2 and cramped.counters.spilled == 0
    cramped.close()
    pool = StagePool(kv, {"disk": tier}, TEMPLATE, 1 << 20, secret=SECRET)
    pool.spill([(0, b"a" * 16)])
    stored = settle(pool, 1)
    path = tmp_path / file_name((stored[0], TEMPLATE.layers))
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    untouched = kv.keys[:, 20:24].clone()
    assert pool.load(5, stored[0]) is None  # corrupt: not used, removed, counted
    assert torch.equal(kv.keys[:, 20:24], untouched) and (stored[0], TEMPLATE.layers) not in tier
    assert tier.counters.corrupt == 1
    pool.close()


def test_a_writer_that_fails_fails_the_stage(tmp_path):
    kv = cache()
    wrong = msgspec.structs.replace(TEMPLATE, head_dim=4)  # a bug: slices of another shape than the cache's
    pool = StagePool(kv, {"disk": make_tier(tmp_path / "tier", 1 << 20)}, wrong, 1 << 20, secret=SECRET)
    pool.spill([(0, b"a" * 16)])
    pool.close()
    with pytest.raises(RuntimeError, match="the KV pool's writer failed"):
        pool.take_events()


def test_a_folder_moved_away_under_a_tier_changes_nothing_it_holds_it_open(tmp_path):
    kv = cache()
    pool = StagePool(kv, {"disk": make_tier(tmp_path / "tier", 1 << 20)}, TEMPLATE, 1 << 20, secret=SECRET)
    (tmp_path / "tier").rename(tmp_path / "moved")
    (tmp_path / "tier").symlink_to(tmp_path / "elsewhere")  # a path planted in its place is never walked
    pool.spill([(0, b"a" * 16)])
    assert settle(pool, 1) == [b"a" * 16] and len(list((tmp_path / "moved").glob("*.kv"))) == 1
    assert pool.load(3, b"a" * 16) == "disk" and not (tmp_path / "elsewhere").exists()
    pool.close()


def test_slices_go_to_every_tier_load_from_the_first_and_come_back_after_a_restart(tmp_path):
    kv = cache()
    host, disk = make_tier(tmp_path / "host", 1 << 20), make_tier(tmp_path / "disk", 1 << 20)
    pool = StagePool(kv, {"host": host, "disk": disk}, TEMPLATE, 1 << 20, secret=SECRET)
    assert {events.tier: (events.stored, events.reset) for events in pool.take_events()} == {
        "host": ([], True),
        "disk": ([], True),
    }  # the first events say what each tier holds: nothing yet
    pool.spill([(1, b"a" * 16), (2, b"b" * 16)])
    settle(pool, 2, "host")
    assert len(disk) == 2
    assert pool.load(6, b"a" * 16) == "host"
    (tmp_path / "host" / f"{(b'a' * 16).hex()}.2-5.kv").unlink()  # the memory tier lost it: the disk has it
    assert pool.load(6, b"a" * 16) == "disk"
    assert [(e.tier, e.removed) for e in pool.take_events()] == [("host", [b"a" * 16])]  # its file went: reported
    pool.close()
    again = StagePool(
        kv, {"disk": make_tier(tmp_path / "disk", 1 << 20)}, TEMPLATE, 1 << 20, secret=SECRET
    )  # a restart
    [events] = again.take_events()
    assert events.reset and sorted(events.stored) == [b"a" * 16, b"b" * 16]
    assert events.stored == [key for key, _ in again.tiers["disk"].stored()]  # least recently used first
    assert again.load(0, b"b" * 16) == "disk" and torch.equal(kv.keys[:, 0:4], kv.keys[:, 8:12])
    again.close()


def test_a_clean_close_writes_down_the_prefixes_still_cached_and_nothing_twice(tmp_path):
    kv = cache()
    disk = make_tier(tmp_path, 1 << 20)
    pool = StagePool(kv, {"disk": disk}, TEMPLATE, 1 << 20, secret=SECRET)
    pool.registered([(1, b"a" * 16), (2, b"b" * 16), (3, b"c" * 16)])
    pool.spill([(2, b"b" * 16)])  # evicted: written now, and no longer block 2's
    settle(pool, 1)
    pool.spill([(2, b"b" * 16)])  # every tier has it already: not copied again
    assert pool.counters.spilled == 1
    pool.close()
    assert sorted(key for key, _ in disk.stored()) == [b"a" * 16, b"b" * 16, b"c" * 16]
    again = StagePool(kv, {"disk": make_tier(tmp_path, 1 << 20)}, TEMPLATE, 1 << 20, secret=SECRET)
    assert again.load(0, b"c" * 16) == "disk" and torch.equal(kv.keys[:, 0:4], kv.keys[:, 12:16])
    again.close()


def test_a_slice_planted_without_the_fleets_secret_is_never_used(tmp_path):
    kv = cache()
    tier = make_tier(tmp_path, 1 << 20)
    pool = StagePool(kv, {"disk": tier}, TEMPLATE, 1 << 20, secret=SECRET)
    key = b"p" * 16
    meta = msgspec.structs.replace(TEMPLATE, key=key)
    forged = encode_slice(meta, torch.ones(meta.shape), torch.ones(meta.shape), b"another secret")
    assert len(forged) == pool.size(key)  # right in every way but the key of its checksum
    assert tier.put((key, TEMPLATE.layers), forged)
    untouched = kv.keys[:, 0:4].clone()
    assert pool.load(0, key) is None and pool.counters.unusable == 1
    assert torch.equal(kv.keys[:, 0:4], untouched) and not (tmp_path / file_name((key, TEMPLATE.layers))).exists()
    pool.close()
