"""The disk tier (kvasir/kvpool/disk.py): bounded in bytes, least recently used evicted
first, found again by a new tier on the same folder (a restart), and nothing half-written
or foreign kept."""

from __future__ import annotations

import os

import pytest

from kvasir.kvpool.disk import file_name
from tests.support.kvpool import make_tier


def where(n: int, layers: tuple[int, int] = (0, 3)) -> tuple[bytes, tuple[int, int]]:
    return (n.to_bytes(16, "big"), layers)


def test_slices_are_kept_by_key_and_layers_and_read_back(tmp_path):
    tier = make_tier(tmp_path, 1000)
    assert tier.put(where(1), b"a" * 100) and tier.put(where(1, (3, 6)), b"b" * 100)
    assert tier.get(where(1), 100) == b"a" * 100 and tier.get(where(1, (3, 6)), 100) == b"b" * 100
    assert tier.get(where(2), 100) is None and tier.counters.misses == 1 and tier.counters.hits == 2
    assert tier.put(where(1), b"c" * 50) and tier.get(where(1), 50) == b"c" * 50 and tier.bytes == 150


def test_the_least_recently_used_go_first_and_the_bound_holds(tmp_path):
    tier = make_tier(tmp_path, 300)
    for n in range(3):
        tier.put(where(n), bytes([n]) * 100)
    tier.get(where(0), 100)  # 0 used again: 1 is now the oldest
    tier.put(where(3), b"x" * 150)
    assert where(1) not in tier and where(2) not in tier and where(0) in tier and where(3) in tier
    assert tier.bytes == 250 <= 300 and tier.counters.evicted == 2
    assert sum(path.stat().st_size for path in tmp_path.glob("*.kv")) == 250  # the files went with them
    assert not tier.put(where(4), b"y" * 301) and tier.counters.refused == 1 and where(0) in tier


def test_a_restart_finds_what_was_stored_in_the_order_it_was_used(tmp_path):
    tier = make_tier(tmp_path, 1000)
    for n in range(3):
        tier.put(where(n), bytes([n]) * 10)
    for n, when in ((0, 3000), (1, 1000), (2, 2000)):  # last uses: 1, then 2, then 0
        os.utime(tmp_path / file_name(where(n)), (when, when))
    (tmp_path / f"{'ab' * 16}.0-3.kv.999999999.partial").write_bytes(b"half")  # a writer that died mid-write
    (tmp_path / "notes.txt").write_text("not ours")
    again = make_tier(tmp_path, 1000)
    assert again.stored() == [where(1), where(2), where(0)] and again.bytes == 30
    assert again.get(where(2), 10) == bytes([2]) * 10
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [".ledger", *(file_name(w) for w in again.stored())]
    )
    smaller = make_tier(tmp_path, 20)  # a smaller bound at start: the oldest use goes (2's was the get above)
    assert smaller.stored() == [where(0), where(2)] and smaller.bytes == 20 and smaller.counters.evicted == 1


def test_a_file_gone_or_found_corrupt_is_forgotten(tmp_path):
    tier = make_tier(tmp_path, 1000)
    tier.put(where(1), b"a" * 10)
    tier.put(where(2), b"b" * 10)
    (tmp_path / file_name(where(1))).unlink()
    assert tier.get(where(1), 10) is None and where(1) not in tier and tier.bytes == 10
    tier.discard(where(2))
    assert where(2) not in tier and tier.counters.corrupt == 1 and not list(tmp_path.glob("*.kv"))
    with pytest.raises(ValueError, match="holds nothing"):
        make_tier(tmp_path, 0)
