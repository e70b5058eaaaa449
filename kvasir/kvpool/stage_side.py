"""A stage's side of the pool: its slices of evicted prefix blocks written down its tiers,
and read back into its KV cache.

``spill`` runs on the stage's batch path, before the batch whose new blocks were freed by
the evictions: it only copies each block's keys and values out of the cache (a few hundred
KiB a block) into a queue bounded in bytes; a full queue drops the slice (counted), never
waits. A writer thread encodes each queued slice once and stores it in every tier (the
host memory tier, then the disk tier, which survives a restart). The stage takes the
tiers' changes since it last asked (``take_events``: slices stored and removed, and at
first everything the tiers held at start) for the bridge, whose index then knows where a
block is complete. A writer that fails raises from the next ``spill`` or
``take_events``: the stage process fails loudly, never with a silently stopped pool (a
storage fault is no failure of the writer: the tier drops the slice and counts it,
kvasir/kvpool/disk.py).

``load`` reads a slice back into a block from the first tier holding it: a slice that is
missing, unreadable, corrupt or made with anything else is not used (the caller
recomputes the block) and a bad one is removed. ``secret`` keys every slice's checksum
(kvasir/kvpool/slices.py).

The stage also keeps which of its blocks hold which prefix (``registered``, from the
head's descriptors; an evicted block leaves it), so that a clean stop (``close``) writes
down the slices of the prefixes still in the cache, within ``PUT_TIMEOUT_S``.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import msgspec
import torch

from kvasir.kvpool.disk import DiskTier
from kvasir.kvpool.health import TierHealth
from kvasir.kvpool.index import Tier
from kvasir.kvpool.slices import SliceError, SliceMeta, decode_slice, encode_slice, slice_bytes

PUT_TIMEOUT_S = 5.0  # closing: how long the writer gets to store what is queued (under the launcher's stop wait)
MAX_SNAPSHOT = 1 << 20  # keys in the first events of a tier (kvasir/wire/bridge.py MAX_PREFIX_EVENTS)


@dataclass
class StageCounters:
    spilled: int = 0  # slices queued for writing
    dropped: int = 0  # slices dropped: the queue was full
    loaded: int = 0  # slices read back into the cache
    missing: int = 0  # slices asked for that no tier holds (computed)
    unusable: int = 0  # slices corrupt or made with something else (removed; computed)


@dataclass
class TierEvents:
    """One tier's changes: ``reset``: ``stored`` is all it holds (the first events)."""

    tier: Tier
    stored: list[bytes]
    removed: list[bytes]
    reset: bool = False


class StagePool:
    """One stage's slices in ``tiers`` (tried in order); ``template``: its SliceMeta less
    the key; ``refused``: the health of tiers refused at start (reported, never used)."""

    def __init__(
        self,
        cache,
        tiers: dict[Tier, DiskTier],
        template: SliceMeta,
        max_queued_bytes: int,
        *,
        secret: bytes,
        refused: tuple[TierHealth, ...] = (),
    ) -> None:
        self.cache = cache  # kvasir/model/kv_cache.py PagedKVCache
        self.tiers = tiers
        self.template = template
        self.secret = secret
        self.healths = [tier.health for tier in tiers.values()] + list(refused)
        self.max_queued_bytes = max_queued_bytes
        self.counters = StageCounters()
        self._queue: queue.SimpleQueue[tuple[bytes, torch.Tensor, torch.Tensor] | None] = queue.SimpleQueue()
        self._queued_bytes = 0
        self._lock = threading.Lock()  # the queue's bytes
        self._tier_lock = threading.Lock()  # the tiers' indexes and their changes (the writer and the stage)
        self._changes: dict[Tier, dict[bytes, bool]] = {name: {} for name in tiers}  # key -> stored (False: removed)
        self._snapshot: dict[Tier, list[bytes]] | None = {
            name: [key for key, layers in tier.stored() if layers == template.layers][-MAX_SNAPSHOT:]
            for name, tier in tiers.items()
        }
        for tier in tiers.values():
            tier.take_gone()  # what the reload evicted was never reported
        self._held: dict[int, bytes] = {}  # block -> the prefix key the head registered it under
        self._failure: BaseException | None = None
        self._writer = threading.Thread(target=self._write_all, name="kvpool-writer", daemon=True)
        self._writer.start()

    def registered(self, blocks: list[tuple[int, bytes]]) -> None:
        """The head registered each (block id, prefix key): the block holds that prefix."""
        self._held.update(blocks)

    def spill(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copy each (block id, prefix key)'s slice out of the cache, to be written down
        (unless every tier holds it already); the blocks no longer hold their prefixes."""
        self._raise_failure()
        size = self.template.payload_bytes
        for block, key in blocks:
            self._held.pop(block, None)
            with self._tier_lock:
                if all((key, self.template.layers) in tier for tier in self.tiers.values()):
                    continue
            with self._lock:
                if self._queued_bytes + size > self.max_queued_bytes:
                    self.counters.dropped += 1
                    continue
                self._queued_bytes += size
            keys, values = self._block(block)
            self._queue.put((key, keys.to("cpu", copy=True), values.to("cpu", copy=True)))
            self.counters.spilled += 1

    def load(self, block: int, key: bytes) -> Tier | None:
        """Read block ``key``'s slice into ``block``: the tier it came from, or None
        (nothing written) when no tier has a usable one."""
        where, size = (key, self.template.layers), self.size(key)
        for name, tier in self.tiers.items():
            with self._tier_lock:
                data = tier.get(where, size)
            if data is None:
                continue
            if self.place(block, key, data):
                return name
            with self._tier_lock:
                tier.discard(where)
        self.counters.missing += 1
        return None

    def place(self, block: int, key: bytes, data: bytes) -> bool:
        """Read one stored slice of ``key`` (a tier's file, or another host's) into
        ``block``; False (nothing written, counted) when it is corrupt or made with anything else."""
        try:
            keys, values = decode_slice(data, msgspec.structs.replace(self.template, key=key), self.secret)
        except SliceError:
            self.counters.unusable += 1
            return False
        cache_keys, cache_values = self._block(block)
        cache_keys.copy_(keys)
        cache_values.copy_(values)
        self.counters.loaded += 1
        return True

    def size(self, key: bytes) -> int:
        """The stored size of this stage's slice of block ``key``."""
        return slice_bytes(msgspec.structs.replace(self.template, key=key))

    def take_events(self) -> list[TierEvents]:
        """Each tier's changes since the last call (the first call: all it holds)."""
        self._raise_failure()
        with self._tier_lock:
            for name, tier in self.tiers.items():
                for key, layers in tier.take_gone():
                    if layers == self.template.layers:
                        self._changes[name][key] = False
            changes = {name: self._changes[name] for name in self.tiers}
            self._changes = {name: {} for name in self.tiers}
            snapshot, self._snapshot = self._snapshot, None
        events = []
        for name, changed in changes.items():
            stored = [key for key, kept in changed.items() if kept]
            removed = [key for key, kept in changed.items() if not kept]
            if snapshot is not None:  # least recently used first, as the tier holds them
                gone = set(removed) | set(stored)
                held = [key for key in snapshot[name] if key not in gone]
                events.append(TierEvents(name, [*held, *stored], [], reset=True))
            elif stored or removed:
                events.append(TierEvents(name, stored, removed))
        return events

    def close(self) -> None:
        """Write down the prefixes the cache still holds, store what is queued (bounded
        by PUT_TIMEOUT_S), then stop the writer."""
        if self._failure is None:
            self.spill(list(self._held.items()))
        self._queue.put(None)
        self._writer.join(PUT_TIMEOUT_S)
        if not self._writer.is_alive():  # a writer still at work keeps its folders' descriptors
            for tier in self.tiers.values():
                tier.close()

    def _block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.cache.block_size
        span = slice(block * size, (block + 1) * size)
        return self.cache.keys[:, span], self.cache.values[:, span]

    def _write_all(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                key, keys, values = item
                meta = msgspec.structs.replace(self.template, key=key)
                data = encode_slice(meta, keys, values, self.secret)
                for name, tier in self.tiers.items():
                    with self._tier_lock:
                        if tier.put((key, meta.layers), data):
                            self._changes[name][key] = True
                with self._lock:
                    self._queued_bytes -= meta.payload_bytes
        except BaseException as exc:  # raised again on the stage's own thread
            self._failure = exc

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the KV pool's writer failed: {self._failure!r}") from self._failure
