"""The head's side of reading prefix blocks back from the KV pool (docs/architecture.md,
The KV pool): which admitted requests' blocks the next descriptor asks every stage to
read back, and what the stages' answer makes of them.

A request whose prompt's next blocks the pool holds (``pooled``, the bridge's word) is
admitted with blocks for them as usual, then waits, unscheduled, while its stages read
them; the blocks every stage read count as cached (registered in the prefix cache, so
later requests share them), and its computing starts after them. Whatever was not read
(a stage missed a slice, or the wait timed out) is computed, overwriting whatever a
stage did read there.
"""

from __future__ import annotations

from kvasir.sched.prefix import PrefixCache
from kvasir.sched.requests import RequestState
from kvasir.wire.batch import PoolLoad

TIERS = ("host", "disk", "remote")  # the order of RequestState.pooled_tokens


class PoolLoads:
    def __init__(self, cache: PrefixCache, block_size: int) -> None:
        self.cache = cache
        self.block_size = block_size
        self.pending: list[PoolLoad] = []  # for the next descriptor

    def ask(self, state: RequestState, keys: list[bytes], cached: int) -> bool:
        """Have the stages read the request's pool blocks after its ``cached`` ones back
        (``keys``: its prompt's block keys a hit may cover); True: it waits for them."""
        until = min(state.pooled, len(keys))
        if until <= cached:
            return False
        blocks, wanted = tuple(state.blocks[cached:until]), tuple(keys[cached:until])
        self.pending.append(PoolLoad(state.request_id, blocks, wanted, state.peers))
        state.loading = until - cached
        return True

    def take(self) -> tuple[PoolLoad, ...]:
        loads, self.pending = tuple(self.pending), []
        return loads

    def answered(self, state: RequestState, tiers: list[str]) -> None:
        """Every stage read back the first ``len(tiers)`` of the request's pool blocks
        (``tiers``: the slowest tier each came from, host < disk < remote; [] when one
        read none or the wait timed out): they count as cached, the rest is computed."""
        count = min(len(tiers), state.loading)
        first = state.registered
        keys = state.keys or []
        for index in range(first, first + count):
            self.cache.register(state.blocks[index], keys[index])
        state.registered = first + count
        state.computed = state.cached_tokens = state.registered * self.block_size
        size = self.block_size
        state.pooled_tokens = tuple(sum(1 for tier in tiers[:count] if tier == t) * size for t in TIERS)  # type: ignore[assignment]
        self.cache.hit_tokens += count * self.block_size
        self.cache.pooled_tokens += count * self.block_size
        state.loading = 0
