"""The launcher and its children: settings handed to each child, its reports
(``ControlMessage``) and the launcher's ``Command``."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from kvasir.config.devices import DispatchKind, EdgeKind
from kvasir.config.experts import ShardSpec
from kvasir.config.plan import Plan
from kvasir.config.sections import Pool
from kvasir.wire.base import Role, Side, Tagged, Wire


# -- the launcher and its children -------------------------------------------------------
class KvSegment(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill stage's KV cache in shared memory, which decode stages read to copy from."""

    name: str
    layers: tuple[int, int]
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str


class HandoffWiring(msgspec.Struct, frozen=True, kw_only=True):
    """Who may hand KV to whom in a disaggregated plan (the same for every stage), by
    global stage index; each instance's stages follow its head's. With [planner] an
    instance may serve either pool (kvasir/config/roles.py): it is in both lists of
    heads, and its caches are in ``segments``; which pool it serves now is the bridge's
    choice per request, never wired."""

    segments: dict[int, KvSegment]  # caches in shared memory: every stage that may serve prefill
    layers: list[tuple[int, int]]  # every stage's layers
    lease_s: float
    prefill_heads: list[int]  # the head of every instance that may serve prefill
    decode_heads: list[int]  # and decode
    hosts: list[str] = []  # a plan across hosts: each stage's host

    def ring_of(self, head: int) -> range:
        """The global indices of the stages of the instance whose head is ``head``."""
        heads = sorted({*self.prefill_heads, *self.decode_heads})
        if head not in heads:
            raise ValueError(f"stage {head} is no instance's head")
        later = [h for h in heads if h > head]
        return range(head, later[0] if later else len(self.layers))

    def head_of(self, index: int) -> int:
        """The head of stage ``index``'s instance."""
        return max(h for h in {*self.prefill_heads, *self.decode_heads} if h <= index)


class EdgeSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One stage-to-stage edge: its slot ring's kind, name, geometry and both ends' devices."""

    kind: EdgeKind
    name: str
    slots: int
    max_tokens: int
    hidden: int
    dtype: str
    producer: str = "cpu"  # the writing stage's device
    consumer: str = "cpu"  # the reading stage's device (where CUDA IPC slots live)


class DispatchSlot(msgspec.Struct, frozen=True, kw_only=True):
    """A stage's shared-memory dispatch slot for one expert shard (kvasir/ring/expert_slots.py)."""

    name: str
    max_rows: int  # the pool's batch.max_tokens: a batch's tokens, at most
    hidden: int
    top_k: int
    dtype: str
    kind: DispatchKind = "shm"  # "pinned": page-locked by its CUDA side(s)
    stage_device: str = "cpu"
    shard_device: str = "cpu"


class PoolTiers(msgspec.Struct, frozen=True, kw_only=True):
    """A stage's share of the KV pool's tiers on its host (kvasir/config/kvpool.py): each
    tier's root folder and the bytes its folder of the stage's layers may take, with the
    stages that share it (0: no such tier); the fleet's pool secret in a plan across hosts."""

    host_dir: str = ""  # the host memory tier (under /dev/shm)
    host_bytes: int = 0
    disk_dir: str = ""
    disk_bytes: int = 0
    secret_file: str = ""  # cluster.keys/kvpool.secret ("": the secret kept beside the tier)


class ShardWiring(msgspec.Struct, frozen=True, kw_only=True):
    """An expert shard: its number (global, plan order), its stage, its plan entry and slot."""

    number: int
    stage: int  # the stage's global index
    layers: tuple[int, int]  # the stage's layers (the shard holds their MoE layers' experts)
    spec: ShardSpec  # its experts, device, threads, cpus
    slot: DispatchSlot

    @property
    def experts(self) -> tuple[int, int]:
        return self.spec.experts


class HostSegments(msgspec.Struct, frozen=True, kw_only=True):
    """The shared memory one host makes for its own workers: the edges between two of
    them, its expert shards' dispatch slots, its prefill stages' caches."""

    edges: list[EdgeSpec] = []
    slots: list[DispatchSlot] = []
    kv: list[KvSegment] = []

    def names(self) -> list[str]:
        return [spec.name for group in (self.edges, self.slots, self.kv) for spec in group]

    def renamed(self, names: dict[str, str]) -> HostSegments:
        """The same segments, each under ``names[its name]`` where that is given."""
        return self._each(lambda spec: msgspec.structs.replace(spec, name=names.get(spec.name, spec.name)))

    def without(self, names: set[str]) -> HostSegments:
        """The segments not named in ``names``."""
        return self._each(lambda spec: None if spec.name in names else spec)

    def _each(self, change) -> HostSegments:
        def each(group: list) -> list:
            return [new for new in map(change, group) if new is not None]

        return HostSegments(edges=each(self.edges), slots=each(self.slots), kv=each(self.kv))


class CudaMemoryHandle(Wire, frozen=True):
    """A CUDA allocation exported for another process (torch's storage sharing, as bytes)."""

    device: int
    handle: bytes  # the allocation's cudaIpcMemHandle
    size: int  # bytes of the shared storage
    offset: int  # its offset inside the allocation
    ref_counter: bytes  # torch's reference-counter file for the allocation
    ref_counter_offset: int
    event: bytes  # the allocation's own event handle (torch waits on it when opening)
    event_sync: bool


class EdgeHandles(Tagged, frozen=True):
    """Stage -> launcher -> the edge's other stage: one side's CUDA IPC handles, sent once
    at start-up. The consumer's half names its slot buffers and its "slot read" events,
    the producer's its "slot written" events (one interprocess event per slot)."""

    edge: str  # EdgeSpec.name
    side: Side
    index: int  # the sending stage's global index
    pid: int
    device: int  # where the events (and the consumer's buffers) live
    events: tuple[bytes, ...]
    memory: CudaMemoryHandle | None = None  # consumer only


class ModelFacts(msgspec.Struct, frozen=True):
    """What the bridge needs of the model, read once by the launcher: the bridge then
    never loads a model config (nor transformers, unless the folder has a tokenizer)."""

    vocab_size: int
    folder: str | None  # the converted model folder, where a tokenizer may be
    kv_bytes_per_token: int = 0  # one token's keys and values over every layer, in the plan's dtype


class FabricSettings(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's place among the hosts of a plan that spans several: every internal
    socket's TCP endpoint and owner (kvasir/transport/routes.py), and the keys to reach them."""

    host: str  # where the worker runs
    keys: str  # the folder of every host's public key (absolute)
    secret: str  # this host's secret key file (absolute)
    sockets: dict[str, tuple[str, str]]  # socket name -> (tcp endpoint, owner host)


class Worker(msgspec.Struct, frozen=True, kw_only=True, tag_field="role"):
    """What every child process is handed, as msgpack bytes on its stdin (never pickle):
    one struct per role below, told apart by the ``role`` tag."""

    plan: Plan  # model.source already resolved to an absolute path or alias (a pool's stage: that pool's view)
    runtime_dir: str
    launcher_pid: int
    stats_interval_s: float = 0.5
    log_level: str = "info"
    fabric: FabricSettings | None = None  # a plan across hosts: TCP with CURVE, not ipc files


class StageSettings(Worker, frozen=True, kw_only=True, tag="stage"):
    role: ClassVar[Role] = "stage"
    index: int  # global: a disaggregated plan numbers both pools' stages in one sequence
    edges: list[EdgeSpec]  # edge k runs from the pool's stage k to its stage k+1
    pool: Pool = ""
    instance: str = ""  # its instance's name (kvasir/config/fleet.py)
    first: int = 0  # global index of its ring's first stage
    handoff: HandoffWiring | None = None  # a disaggregated plan's stage
    shards: list[ShardWiring] = []  # its expert shards
    kv_pool: PoolTiers | None = None  # a plan with [kv_pool]: its tiers


class ShardSettings(Worker, frozen=True, kw_only=True, tag="shard"):
    role: ClassVar[Role] = "shard"
    index: int  # the shard's number
    wiring: ShardWiring  # its stage, experts, layers and dispatch slot
    pool: Pool = ""  # its stage's pool


class BridgeSettings(Worker, frozen=True, kw_only=True, tag="bridge"):
    role: ClassVar[Role] = "bridge"
    index: ClassVar[int] = 0
    model: ModelFacts  # the bridge never loads a model config


class FrontSettings(Worker, frozen=True, kw_only=True, tag="front"):
    role: ClassVar[Role] = "front"
    index: int
    model: ModelFacts
    listen_fd: int  # the launcher's listening socket, inherited


WorkerSettings = StageSettings | ShardSettings | BridgeSettings | FrontSettings


class Ready(Tagged, frozen=True):
    role: Role
    index: int
    pid: int


class Drained(Tagged, frozen=True):
    pass


class Heartbeat(Tagged, frozen=True):
    """A child's loop is still turning (sent about twice a second); silence means hung."""

    role: Role
    index: int
    pid: int


class Regroup(Tagged, frozen=True):
    """Bridge -> launcher: a moving instance holds no request; restart it in ``pool``
    (with ``drain``: that host is drained, park the instance instead)."""

    instance: str
    pool: Pool
    drain: str = ""


ControlMessage = Ready | Drained | Heartbeat | EdgeHandles | Regroup


CommandKind = Literal["serve", "ring_down", "parked", "attach", "drain", "stop", "hosts", "regroup"]


class Command(Wire, frozen=True):
    # "serve" (bridge: every stage is ready; bind the client endpoints, or after a restart
    # take requests again) | "ring_down" (bridge: the stages failed and are restarting) |
    # "parked" (bridge: the instance waits for its standby or drained host to join) |
    # "attach" (stage: CUDA IPC handles of its edges' other sides) | "drain" | "stop" |
    # "hosts" (bridge: which hosts are missing, whenever that changes) | "regroup" (a
    # moving instance's stages and shards, once it holds no request: serve ``pool`` now)
    kind: CommandKind
    code: str = "shutting_down"  # with "stop": the error code for requests still running
    message: str = ""  # with "ring_down": what failed; with "serve": the last failure ("" for none)
    restarts: int = 0  # with "serve": ring restarts so far
    pids: tuple[int, ...] = ()  # with "serve": the stages' pids (stats from any other process are stale)
    handles: tuple[EdgeHandles, ...] = ()  # with "attach" (stages at start-up): the other sides' CUDA IPC handles
    hosts: tuple[str, ...] = ()  # with "hosts" (bridge, a plan across hosts): the hosts missing now
    instance: str = ""  # with "serve", "ring_down" and "parked": the instance ("": every instance)
    pool: Pool | None = None  # with "serve" and "regroup": the pool the instance serves now (None: the plan's)
    plan: Plan | None = None  # with "regroup" (a stage): its ring's plan in that pool (kvasir/daemon/layout.py)
