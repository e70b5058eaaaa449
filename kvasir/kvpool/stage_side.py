"""A stage's side of the pool: its slices of evicted prefix blocks written down a tier,
and read back into its KV cache.

``spill`` runs on the stage's batch path, before the batch whose new blocks were freed by
the evictions: it only copies each block's keys and values out of the cache (a few hundred
KiB a block) into a queue bounded in bytes; a full queue drops the slice (counted), never
waits. A writer thread encodes and stores what is queued; the stage takes the keys stored
since it last asked (``take_stored``) for its report to the bridge, whose index then knows
where a block is complete. A writer that fails raises from the next ``spill`` or
``take_stored``: the stage process fails loudly, never with a silently stopped pool.

``load`` reads a slice back into a block: a slice that is missing, corrupt or made with
anything else is not used (the caller recomputes the block) and a bad one is removed.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import msgspec
import torch

from kvasir.kvpool.disk import DiskTier
from kvasir.kvpool.slices import SliceError, SliceMeta, decode_slice, encode_slice

PUT_TIMEOUT_S = 5.0  # closing: how long the writer gets to store what is queued


@dataclass
class StageCounters:
    spilled: int = 0  # slices queued for writing
    dropped: int = 0  # slices dropped: the queue was full
    loaded: int = 0  # slices read back into the cache
    unusable: int = 0  # slices missing, corrupt or made with something else (recomputed)


class StagePool:
    """One stage's slices in ``tier``; ``template``: its SliceMeta less the key."""

    def __init__(self, cache, tier: DiskTier, template: SliceMeta, max_queued_bytes: int) -> None:
        self.cache = cache  # kvasir/model/kv_cache.py PagedKVCache
        self.tier = tier
        self.template = template
        self.max_queued_bytes = max_queued_bytes
        self.counters = StageCounters()
        self._queue: queue.SimpleQueue[tuple[bytes, torch.Tensor, torch.Tensor] | None] = queue.SimpleQueue()
        self._queued_bytes = 0
        self._lock = threading.Lock()  # the queue's bytes and the stored keys
        self._tier_lock = threading.Lock()  # the tier's index (the writer and the loader both use it)
        self._stored: list[bytes] = []
        self._failure: BaseException | None = None
        self._writer = threading.Thread(target=self._write_all, name="kvpool-writer", daemon=True)
        self._writer.start()

    def spill(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copy each (block id, prefix key)'s slice out of the cache, to be written down."""
        self._raise_failure()
        size = self.template.payload_bytes
        for block, key in blocks:
            with self._lock:
                if self._queued_bytes + size > self.max_queued_bytes:
                    self.counters.dropped += 1
                    continue
                self._queued_bytes += size
            keys, values = self._block(block)
            self._queue.put((key, keys.to("cpu", copy=True), values.to("cpu", copy=True)))
            self.counters.spilled += 1

    def load(self, block: int, key: bytes) -> bool:
        """Read block ``key``'s slice into ``block``; False (nothing written) when it cannot be used."""
        where = (key, self.template.layers)
        with self._tier_lock:
            data = self.tier.get(where)
        if data is None:
            self.counters.unusable += 1
            return False
        try:
            keys, values = decode_slice(data, msgspec.structs.replace(self.template, key=key))
        except SliceError:
            with self._tier_lock:
                self.tier.discard(where)
            self.counters.unusable += 1
            return False
        cache_keys, cache_values = self._block(block)
        cache_keys.copy_(keys)
        cache_values.copy_(values)
        self.counters.loaded += 1
        return True

    def take_stored(self) -> list[bytes]:
        """The keys whose slices were stored since the last call."""
        self._raise_failure()
        with self._lock:
            stored, self._stored = self._stored, []
        return stored

    def close(self) -> None:
        """Store what is queued (bounded by PUT_TIMEOUT_S), then stop the writer."""
        self._queue.put(None)
        self._writer.join(PUT_TIMEOUT_S)

    def _block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.cache.block_size
        span = slice(block * size, (block + 1) * size)
        return self.cache.keys[:, span], self.cache.values[:, span]

    def _write_all(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                key, keys, values = item
                meta = msgspec.structs.replace(self.template, key=key)
                data = encode_slice(meta, keys, values)
                with self._tier_lock:
                    stored = self.tier.put((key, meta.layers), data)
                with self._lock:
                    self._queued_bytes -= meta.payload_bytes
                    if stored:
                        self._stored.append(key)
        except BaseException as exc:  # raised again on the stage's own thread
            self._failure = exc

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the KV pool's writer failed: {self._failure!r}") from self._failure
