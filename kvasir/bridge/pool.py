"""The bridge's view of the KV pool (docs/architecture.md, The KV pool): the index of
which stage slices each host's tiers hold (kvasir/kvpool/index.py), fed by the stages'
``PoolEvents``, and for a routed request how many of its prompt's first blocks its
instance can read back (sent to its head in the ``Enqueue``).

A stage reports what its tiers hold as soon as it starts, which may be before the
launcher says its instance serves: events from a process the bridge does not know yet
are kept (a bounded number per stage) and applied once it serves, so that after a
restart the first request of a known prefix already finds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvasir.bridge.pool_choice import Fetch, Rates, worth_fetching
from kvasir.config.cluster import worker_host
from kvasir.config.plan import Plan
from kvasir.kvpool.index import PoolIndex, Slot
from kvasir.sched.prefix import block_keys
from kvasir.wire.bridge import PoolEvents
from kvasir.wire.stats import StageStats

EARLY_KEPT = 64  # events kept per stage whose process does not serve yet
KEYS_PER_BLOCK = 4  # the index holds this many keys per KV block of every instance, besides the tiers'
UNSIZED_KEYS = 1 << 18  # the tiers' share of the index when the model's KV size is not known
MAX_KEYS = 1 << 22  # at most (a few hundred bytes a key)


@dataclass(frozen=True)
class Pooled:
    """What an instance reads back of a prompt (PoolView.pooled)."""

    blocks: int
    peers: tuple[tuple[int, int], ...] = ()
    why: str = ""


class PoolView:
    def __init__(self, plan: Plan, kv_bytes_per_token: int = 0) -> None:
        """``kv_bytes_per_token``: the model's, to size the index to the blocks the tiers can hold."""
        self.slot_of: dict[int, Slot] = {}  # global stage index -> its host and layers
        self.layout: dict[str, list[Slot]] = {}  # instance -> its stages' slots
        self.block_size: dict[str, int] = {}
        self.first: dict[str, int] = {}  # instance -> its head's global index
        blocks, block_size = 0, 0
        for ring in plan.rings():
            slots = [(worker_host(plan.cluster, stage.host) or "", stage.layers) for stage in ring.plan.stages]
            self.layout[ring.name] = slots
            self.block_size[ring.name] = ring.plan.kv.block_size
            self.slot_of.update({ring.first + k: slot for k, slot in enumerate(slots)})
            self.first[ring.name] = ring.first
            blocks += ring.plan.kv.num_blocks
            block_size = max(block_size, ring.plan.kv.block_size)
        self.stage_at = {slot: index for index, slot in sorted(self.slot_of.items(), reverse=True)}  # the first
        self.index = PoolIndex(
            max_keys=min(MAX_KEYS, KEYS_PER_BLOCK * blocks + self._tier_blocks(plan, block_size * kv_bytes_per_token))
        )
        self._early: dict[int, deque[PoolEvents]] = {}
        self.kv_bytes_per_token = kv_bytes_per_token
        self.num_layers = plan.num_layers
        self.rates = Rates({}, {})

    def _tier_blocks(self, plan: Plan, block_bytes: int) -> int:
        """How many blocks every host's tiers hold together (their bytes over a block's)."""
        pool = plan.kv_pool
        if pool is None or block_bytes <= 0:
            return UNSIZED_KEYS
        hosts = len({host for host, _ in self.slot_of.values()})
        return hosts * (pool.host_bytes + pool.disk_bytes) // block_bytes

    def note(self, events: PoolEvents, current: bool) -> None:
        """A stage's tiers changed (``current``: it serves its instance now)."""
        slot = self.slot_of.get(events.stage)
        if slot is None:
            return
        if not current:
            early = self._early.setdefault(events.stage, deque(maxlen=EARLY_KEPT))
            if events.reset or any(kept.pid != events.pid for kept in early):
                early.clear()  # a snapshot, or a newer process of the stage: what came before is stale
            early.append(events)
            return
        if events.reset:
            self.index.reset(slot, events.tier)
        for key in events.removed:
            self.index.removed(key, slot, events.tier)
        for key in events.stored:
            self.index.stored(key, slot, events.tier)

    def serve(self, pids: Sequence[int]) -> None:
        """An instance serves with processes ``pids``: their early events count now."""
        for stage in list(self._early):
            kept = [events for events in self._early[stage] if events.pid in pids]
            if kept:
                del self._early[stage]
                for events in kept:
                    self.note(events, current=True)

    def measured(self, report: StageStats) -> None:
        """A stage's latest figures: its fetches from other hosts, its tokens per busy second."""
        if report.kv_pool is not None:
            self.rates.fetched[report.index] = (report.kv_pool.remote_bytes, report.kv_pool.remote_s)
        self.rates.ran[report.index] = (report.tokens, report.busy_s)

    def prefilled(self, instance: str, tokens: int, seconds: float) -> None:
        """A request on ``instance`` computed ``tokens`` prompt tokens in ``seconds`` (from
        its first batch to its first token)."""
        self.rates.prefilled(instance, tokens, seconds)

    def pooled(self, instance: str, prompt: Sequence[int], root: bytes) -> Pooled:
        """How many of the prompt's first blocks every stage of ``instance`` reads back,
        (stage, peer) for each stage that reads what its host lacks from a stage of the
        same layers on another host (global indexes), and why, where another host is
        involved (kvasir/bridge/pool_choice.py)."""
        layout, size = self.layout.get(instance), self.block_size.get(instance, 0)
        if not layout or size <= 0 or len(self.index) == 0:
            return Pooled(0)
        keys = block_keys(prompt, size, max(len(prompt) - 1, 0) // size, root)  # the last token is always computed
        count, sources = self.index.reach(keys, layout)
        if count == 0 or not any(sources):
            return Pooled(count)
        first = self.first[instance]
        local = [self.index.held(keys, slot) for slot in layout]
        fetches, peers = [], []
        for k, (host, (_, layers)) in enumerate(zip(sources, layout, strict=True)):
            if host is not None:
                fetches.append(Fetch(first + k, count - local[k], (layers[1] - layers[0]) / self.num_layers))
                peers.append((first + k, self.stage_at[(host, layers)]))
        own = min(min(local), count)
        stages = range(first, first + len(layout))
        tokens, block_bytes = (count - own) * size, size * self.kv_bytes_per_token
        fetch, why = worth_fetching(fetches, tokens, block_bytes, instance, stages, self.rates)
        return Pooled(count, tuple(peers), why) if fetch else Pooled(own, (), why)

    def forget_hosts(self, hosts: Sequence[str]) -> None:
        """Hosts that are gone take their tiers out of the index."""
        for host in hosts:
            self.index.forget_host(host)
