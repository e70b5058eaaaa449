"""The head's prefix cache: full KV blocks kept by what they hold, so a prompt's shared
beginning is computed once.

A full block's *key* chains its parent block's key with its own tokens (blake2b, 16
bytes), so two blocks have the same key exactly when the tokens up to their ends are the
same. A block is registered under its key once its K/V is written on every stage (the
batch that filled it has come back); a new request takes the blocks of its longest
registered prefix instead of computing them, on every stage at once, because the head
gives every stage the same block ids. Blocks are counted per request holding them; a
registered block nobody holds keeps its K/V and its key until an allocation needs the
room, least recently used first (and a few more while that frees one run of adjacent
blocks for the new request: the stages read a run with one call). A block is only ever
shared whole and before the position its new holder starts writing at, so nobody
writes into a shared block.

Blocks are shared only within a *namespace*: the first block's key chains from the
request's root (``namespace_root``: the tenant it came from and the ``cache_salt`` it
gave), so a caller can neither hit nor time another tenant's blocks. With ``[kv]
prefix_share = "all"`` and no salt the root is empty and every client shares one cache.

With the cache off (``enabled`` False) nothing is looked up or registered, and it is
plain allocation from the BlockAllocator. With ``spill`` (a plan with ``[kv_pool]``) each
block registered and each block evicted, with its key, is listed until taken
(``take_pool_news``): the head sends them in its next descriptor, so every stage knows
which of its blocks hold which prefix (a clean stop writes those down) and writes its
slice of an evicted one down the pool's tiers before the block is written again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvasir.sched.blocks import BlockAllocator
from kvasir.wire.head import BLOCK_KEY_BYTES as KEY_BYTES

if TYPE_CHECKING:
    from kvasir.sched.requests import RequestState

EVENTS_KEPT = 1 << 15  # registered and evicted keys kept between two PrefixEvents (then a snapshot)
EVENTS_SNAPSHOT = 1 << 20  # keys in a snapshot at most (kvasir/wire/bridge.py's MAX_PREFIX_EVENTS)


def namespace_root(namespace: str, salt: str | None) -> bytes:
    """The parent of a request's first block key: its namespace (the tenant, or "" where
    the plan shares the cache between all) narrowed by its ``cache_salt``; empty, the
    unsalted chain, for no namespace and no salt."""
    if not namespace and salt is None:
        return b""
    digest = hashlib.blake2b(b"kvasir-prefix-namespace", digest_size=KEY_BYTES)
    for part in (namespace, salt if salt is not None else ""):
        encoded = part.encode()
        digest.update(len(encoded).to_bytes(4, "little") + encoded)  # length-prefixed: parts cannot run together
    digest.update(b"\x01" if salt is not None else b"\x00")
    return digest.digest()


def block_keys(tokens: Sequence[int], block_size: int, count: int, parent: bytes = b"") -> list[bytes]:
    """The chained keys of the first ``count`` full blocks of ``tokens`` (after ``parent``)."""
    keys: list[bytes] = []
    for index in range(count):
        chunk = tokens[index * block_size : (index + 1) * block_size]
        if len(chunk) != block_size:
            raise ValueError(f"block {index} is not full: {len(chunk)} of {block_size} tokens")
        digest = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        digest.update(b"".join(token.to_bytes(4, "little") for token in chunk))
        parent = digest.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Block ids for running requests, with registered full blocks reused by later ones."""

    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True, spill: bool = False) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self.spill = spill
        self._spills: list[tuple[int, bytes]] = []  # evicted (block, key) not yet sent to the stages
        self._registered: list[tuple[int, bytes]] = []  # and registered ones
        self.pooled_tokens = 0  # of hit_tokens, read back from the KV pool
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._holders: dict[int, int] = {}  # block id -> requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody; oldest use first
        self.queries = 0  # prompts looked up
        self.query_tokens = 0  # their prompt tokens
        self.hit_tokens = 0  # of those, found cached
        self.evicted = 0  # registered blocks given up for room
        self.stored: list[bytes] = []  # keys registered since the last events taken (the conductor's index)
        self.removed: list[bytes] = []  # and evicted
        self.overflowed = False  # more than EVENTS_KEPT of them: the next events are a snapshot

    @property
    def cached_blocks(self) -> int:
        """Registered blocks (held or idle)."""
        return len(self._key_of)

    @property
    def available(self) -> int:
        """Blocks an allocation can get: free ones and idle registered ones."""
        return self.allocator.free + len(self._idle)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of ``keys`` (a prompt's chained
        block keys); nothing is held yet."""
        blocks: list[int] = []
        for key in keys if self.enabled else ():
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def note(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one admitted prompt that was looked up, and how much of it was cached."""
        self.queries += 1
        self.query_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def take(self, cached: list[int], fresh: int) -> list[int] | None:
        """Hold ``cached`` (from ``lookup``) and ``fresh`` new blocks, evicting idle
        registered blocks for room if need be; None (nothing held) when they do not fit."""
        idle_cached = sum(1 for block in cached if block in self._idle)
        if fresh > self.available - idle_cached:
            return None
        for block in cached:
            self._hold(block)
        for _ in range(max(0, fresh - self.allocator.free)):
            self._evict()
        # a row reads each run of adjacent blocks with one call (kvasir/model/paged_inplace.py):
        # evict up to as many again, oldest first, while that makes room for one run
        for _ in range(fresh):
            if not self._idle or self.allocator.longest_run >= fresh:
                break
            self._evict()
        new = self.allocator.allocate(fresh)
        if new is None:  # cannot happen: the room was counted above
            raise RuntimeError(f"{fresh} KV blocks counted free but not allocated")
        for block in new:
            self._holders[block] = 1
        return cached + new

    def register(self, block: int, key: bytes) -> None:
        """Record that held ``block`` holds the prefix ``key`` (its K/V written on every
        stage). A key already held by another block keeps that block."""
        if not self.enabled or key in self._by_key or block in self._key_of:
            return
        if block not in self._holders:
            raise ValueError(f"KV block {block} registered while nobody holds it")
        self._by_key[key] = block
        self._key_of[block] = key
        self._event(self.stored, key)
        if self.spill:
            self._registered.append((block, key))

    def release(self, blocks: list[int]) -> None:
        """A request lets go of its blocks: registered ones nobody else holds go idle
        (most recently used), unregistered ones back to the allocator."""
        freed = []
        for block in blocks:
            holders = self._holders.get(block, 0)
            if holders <= 0:
                raise ValueError(f"KV block {block} given back twice or never taken")
            if holders > 1:
                self._holders[block] = holders - 1
                continue
            del self._holders[block]
            if block in self._key_of:
                self._idle[block] = None
            else:
                freed.append(block)
        if freed:
            self.allocator.release(freed)

    def _event(self, into: list[bytes], key: bytes) -> None:
        if self.overflowed:
            return
        into.append(key)
        if len(self.stored) + len(self.removed) > EVENTS_KEPT:
            self.stored, self.removed, self.overflowed = [], [], True

    def take_events(self) -> tuple[list[bytes], list[bytes], bool] | None:
        """The keys registered and evicted since the last call, or after an overflow all
        keys held now with ``reset`` True; None when nothing changed."""
        if self.overflowed:
            self.stored, self.removed, self.overflowed = [], [], False
            return list(self._by_key)[:EVENTS_SNAPSHOT], [], True
        if not self.stored and not self.removed:
            return None
        events = self.stored, self.removed, False
        self.stored, self.removed = [], []
        return events

    def take_pool_news(self) -> tuple[tuple[tuple[int, bytes], ...], tuple[tuple[int, bytes], ...]]:
        """The (block, key) of blocks registered, then of blocks evicted, since the last
        call, for the KV pool (a block may be in both: registered, then evicted)."""
        news = tuple(self._registered), tuple(self._spills)
        self._registered, self._spills = [], []
        return news

    def _hold(self, block: int) -> None:
        self._idle.pop(block, None)
        self._holders[block] = self._holders.get(block, 0) + 1

    def _evict(self) -> None:
        block, _ = self._idle.popitem(last=False)
        key = self._key_of.pop(block)
        del self._by_key[key]
        self._event(self.removed, key)
        if self.spill:
            self._spills.append((block, key))
        self.allocator.release([block])
        self.evicted += 1

    def prompt_keys(self, state: RequestState) -> list[bytes]:
        """The chained keys of the prompt's blocks a cache hit may cover (all full ones
        before its last token); none for a request that wants every prompt token scored."""
        if state.keys is None:
            reusable = (state.prompt_len - 1) // self.block_size
            wanted = self.enabled and state.sampling.prompt_logprobs < 0 and reusable > 0
            state.keys = block_keys(state.prompt, self.block_size, reusable, state.cache_root) if wanted else []
        return state.keys

    def register_computed(self, state: RequestState) -> None:
        """Put the request's blocks that are now full and written on every stage into the
        prefix cache (a decode pool's request, which has no prompt tokens here, has none)."""
        full = state.computed // self.block_size
        if not self.enabled or full <= state.registered or len(state.prompt) != state.prompt_len:
            return
        keys = state.keys if state.keys is not None else []
        if len(keys) < full:
            parent = keys[-1] if keys else state.cache_root
            known = len(keys) * self.block_size
            keys += block_keys(
                state.tokens(known, full * self.block_size - known), self.block_size, full - len(keys), parent
            )
        state.keys = keys
        for index in range(state.registered, full):
            self.register(state.blocks[index], keys[index])
        state.registered = full
