"""Every wire type Kvasir exchanges, as msgspec Structs, one tagged union per socket edge.

The batch descriptor is decided once by the head and travels unchanged to every stage;
each message carries only what its receiver lacks (a request's sampling spec on its
first appearance, a row's KV blocks as growth since the stage last saw the request).
Tensors never travel inside these bodies: boundaries sit in slots (shared memory,
page-locked shared memory or CUDA IPC buffers) and descriptors name the slot.

Edges:
    client  -> bridge   ClientMessage   (Submit | Cancel | StatsQuery)
    bridge  -> client   ClientEvent     (Accepted | TokenOut | Finished | Cancelled | ErrorEvent | StatsReply)
    bridge  -> PUB      TokenOut
    bridge, tail -> head HeadMessage    (Enqueue | CancelRequest | BatchResult)
    stage k -> stage k+1 BatchDescriptor
    stage k+1 -> stage k Credit
    stages  -> bridge   BridgeMessage   (TokenEvents | RequestEnded | StageStats | HandoffReport)

A disaggregated plan runs two rings (DESIGN.md section 2): the prefill pool's and the
decode pool's. Their heads and stages add:
    prefill tail -> decode head  HeadMessage (Handoff)
    prefill head -> decode head  HeadMessage (KvDrop | CancelRequest)
    decode head -> prefill head  HeadMessage (KvPlaced | Adopted)
    decode stage -> decode head  HeadMessage (KvHeld)
    prefill stage, decode head -> decode stage  KvMessage (KvReady | Placement)
    children -> launcher ControlMessage (Ready | Drained | Heartbeat | EdgeHandles)
    launcher -> children Command
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvasir.plan import Plan

# Size limits of a client's submission, checked while decoding (msgspec reads a list's
# length before its items, so an oversized list is refused without being walked). The
# model's own limits (max_seq_len, vocabulary) are checked after, in kvasir/validation.py.
MAX_PROMPT_TOKENS = 1 << 20  # token ids in one prompt (max_seq_len is the real bound)
MAX_PROMPT_CHARS = 1 << 22  # characters of one prompt text
MAX_STOP_TOKEN_IDS = 256  # stop token ids of one request


class _Wire(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    pass


class _Tagged(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag=True):
    pass


# -- requests and batches -------------------------------------------------------------
class SamplingParams(_Wire):
    """How the tail picks tokens for one request and when it stops."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = no nucleus filtering
    top_k: int = 0  # 0 = no top-k filtering
    seed: int | None = None  # same seed, same output
    max_tokens: int = 128  # output tokens at most
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past the model's end-of-sequence ids (benchmarks)


class NewRequest(_Wire):
    """A request's spec, sent in the descriptor of its first batch only."""

    request_id: int
    sampling: SamplingParams
    seed: int  # the resolved seed (a request without one gets a random seed at the head)
    generated: int = 0  # output tokens already sampled elsewhere (1 in the decode pool: the prefill pool's first)


class Row(_Wire):
    """One request's share of a packed batch: ``num_tokens`` tokens from ``start``."""

    request_id: int
    start: int  # position of the row's first token
    num_tokens: int
    new_blocks: tuple[int, ...]  # KV block ids added since the stage last saw the request
    emit: bool  # the row ends at the request's newest token: the tail samples after it


class BatchDescriptor(_Wire):
    """The composition of one physical batch, decided once by the head.

    A descriptor with no rows only carries releases (slot -1, no boundary).
    """

    batch_id: int
    slot: int  # boundary slot index on the edge it travels
    num_tokens: int
    rows: tuple[Row, ...]
    release: tuple[int, ...]  # requests whose KV every stage frees before running this batch
    new_requests: tuple[NewRequest, ...]
    scheduled_ns: int  # CLOCK_MONOTONIC time the head fixed the composition


class SampledToken(_Wire):
    request_id: int
    token_id: int
    index: int  # position in the request's output
    finish: str | None  # None while running, else "stop" | "length"
    scheduled_ns: int = 0  # on a request's first token: when its first batch was scheduled


class Credit(_Wire):
    """A consumer hands a boundary slot back to its producer."""

    slot: int


# -- the head's inbox ---------------------------------------------------------------------
class Enqueue(_Tagged):
    request_id: int
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    client: int = 0  # the bridge's number for the submitting client (fair admission across clients)


class CancelRequest(_Tagged):
    request_id: int


class BatchResult(_Tagged):
    """What the tail sends back to the head for one batch: it closes the ring."""

    batch_id: int
    tokens: tuple[SampledToken, ...]


class Handoff(_Tagged):
    """Prefill tail -> decode head: a request's prompt is done and its first token sampled
    (and not its last); its KV is on its way from the prefill stages to the decode stages."""

    request_id: int
    prompt_len: int
    first_token: int
    sampling: SamplingParams
    seed: int
    ready_ns: int  # when the prefill tail handed it over


class KvDrop(_Tagged):
    """Prefill head -> decode head: a request whose prompt KV was announced to the decode
    stages ended in the prefill pool (finished at its first token, cancelled, failed);
    the decode stages forget its parts."""

    request_id: int


class KvHeld(_Tagged):
    """Decode stage -> decode head: the stage holds its layers of a request's KV."""

    request_id: int
    stage: int  # global stage index
    nbytes: int  # KV bytes the stage copied
    copy_ns: int  # how long the copy took
    held_ns: int  # when it was done (CLOCK_MONOTONIC)


class KvPlaced(_Tagged):
    """Decode head -> prefill head: the request has decode blocks and is being copied; the
    hand-off lease starts now (waiting for decode blocks is back-pressure, not a fault)."""

    request_id: int


class Adopted(_Tagged):
    """Decode head -> prefill head: every decode stage holds the request's KV (or it was
    dropped); the prefill pool frees the request's blocks."""

    request_id: int


HeadMessage = Enqueue | CancelRequest | BatchResult | Handoff | KvDrop | KvHeld | KvPlaced | Adopted


# -- KV hand-off to a decode stage ----------------------------------------------------------------
class KvReady(_Tagged):
    """Prefill stage -> decode stage: a request's prompt KV for ``layers`` sits in the
    prefill stage's cache segment at ``blocks`` (held there until the decode head adopts it)."""

    request_id: int
    source: int  # global index of the prefill stage (which cache segment to read)
    layers: tuple[int, int]  # the prefill stage's layers
    blocks: tuple[int, ...]  # the request's block table in the prefill pool
    num_tokens: int  # positions [0, num_tokens) hold K/V
    sent_ns: int


class Placement(_Tagged):
    """Decode head -> decode stage: the request's decode blocks (copy its parts there once
    they are all announced); no blocks = forget the request's parts and table."""

    request_id: int
    blocks: tuple[int, ...]


KvMessage = KvReady | Placement


# -- stages to the bridge -----------------------------------------------------------------
class TokenEvents(_Tagged):
    tokens: tuple[SampledToken, ...]


class RequestEnded(_Tagged):
    """The head ended a request without a token: cancelled, or refused (code + message)."""

    request_id: int
    code: str  # "cancelled" or an error code
    message: str = ""


class BatchSpan(_Wire):
    """One batch on one stage: when the stage took it and handed it on, and what it held."""

    batch_id: int
    start_ns: int  # CLOCK_MONOTONIC, comparable across the daemon's processes
    end_ns: int
    prefill_tokens: int  # tokens of multi-token rows (prompt chunks)
    decode_tokens: int  # tokens of single-token rows


class StageStats(_Tagged):
    index: int
    layers: tuple[int, int]
    pid: int
    wall_s: float  # since the stage started serving
    busy_s: float
    starved_s: float
    blocked_s: float
    batches: int
    rows: int
    tokens: int
    inflight: int  # batches in flight (head only; 0 elsewhere)
    kv_requests: int  # requests whose KV the stage holds
    kv_blocks: int  # KV blocks those requests hold on this stage
    waiting: int = 0  # requests queued for admission (head only; 0 elsewhere)
    hop_s: float = 0.0  # of busy and waiting time: spent handing boundaries over (slots, descriptors, credits)
    spans: tuple[BatchSpan, ...] = ()  # batches run since the previous report (the bridge keeps a bounded timeline)
    pool: str = ""  # "prefill" | "decode" in a disaggregated plan; "" in a colocated one
    handoff_bytes: int = 0  # decode stages: KV bytes received from the prefill pool
    handoff_s: float = 0.0  # decode stages: of busy time, spent copying them
    handing_off: int = 0  # prefill head: requests handed to the decode pool, not yet taken (their blocks held)
    device: str = "cpu"  # where the stage's slice, KV cache and attention live
    gpu_bytes: int = 0  # CUDA stages: device memory held by live tensors (weights, KV cache, slots, activations)
    gpu_reserved_bytes: int = 0  # CUDA stages: device memory reserved by the caching allocator


class HandoffReport(_Tagged):
    """Decode head -> bridge: one request's KV hand-off, measured."""

    request_id: int
    nbytes: int  # KV bytes moved, all decode stages together
    seconds: float  # from the prefill tail handing the request over to the last decode stage's copy
    copy_s: float  # the slowest decode stage's copy (they copy in parallel)


BridgeMessage = TokenEvents | RequestEnded | StageStats | HandoffReport


# -- clients ----------------------------------------------------------------------------------
class _Client(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    pass


class Submit(_Client, tag="submit"):
    key: int  # the client's own handle for the request, echoed in Accepted
    prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    chat: bool = False
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False


class Cancel(_Client, tag="cancel"):
    request_id: int


class StatsQuery(_Client, tag="stats"):
    key: int
    timeline: bool = False  # include each stage's recent batch spans


ClientMessage = Submit | Cancel | StatsQuery


class Accepted(_Client, tag="accepted"):
    key: int
    request_id: int


class TokenOut(_Client, tag="token"):
    request_id: int
    index: int
    token_id: int
    text: str


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    queued_s: float  # submission to the request's first batch
    first_token_s: float  # submission to the first token (TTFT)
    per_token_s: float  # mean time between output tokens after the first
    total_s: float
    second_token_s: float | None = None  # first to second token (in a disaggregated plan it includes the KV hand-off)


class HandoffTimings(msgspec.Struct, frozen=True, kw_only=True):
    """A request's KV hand-off between pools (disaggregated plans only)."""

    kv_bytes: int
    seconds: float  # first token sampled (prefill pool) -> every decode stage holds the KV
    copy_s: float  # of which copying (the slowest decode stage; they copy in parallel)
    gibps: float  # effective bandwidth of the copy: kv_bytes / copy_s, in GiB/s


class Finished(_Client, tag="finished"):
    request_id: int
    reason: str  # "stop" | "length"
    token_ids: list[int]
    usage: Usage
    timings: Timings
    handoff: HandoffTimings | None = None


class Cancelled(_Client, tag="cancelled"):
    request_id: int


class ErrorEvent(_Client, tag="error"):
    code: str
    message: str
    request_id: int | None = None
    key: int | None = None  # set when the error answers a submission before it had an id


class DaemonStats(msgspec.Struct, frozen=True, kw_only=True):
    uptime_s: float
    requests: int  # accepted since start
    in_flight: int  # accepted and not yet ended
    tokens_out: int = 0  # output tokens streamed to clients since start
    waiting_limit: int
    vocab_size: int
    max_seq_len: int
    stages: list[StageStats]
    timeline: list[list[BatchSpan]] = []  # per stage, oldest first (only when asked for)
    state: str = "serving"  # "serving" | "restarting" (a child failed; new requests get "restarting") | "draining"
    restarts: int = 0  # ring restarts since the daemon started
    last_failure: str | None = None  # what the last failure was (a child's exit, a missed heartbeat)
    last_failure_age_s: float | None = None  # seconds since it
    handoff: HandoffSummary | None = None  # disaggregated plans: KV hand-offs since start
    client_bytes_waiting: int = 0  # events queued in the bridge for clients that read slower than they are sent
    clients_lost: int = 0  # clients the bridge gave up on (gone, or not reading): their requests cancelled, events dropped
    malformed: int = 0  # internal messages the bridge dropped because they did not decode


class HandoffSummary(msgspec.Struct, frozen=True, kw_only=True):
    count: int  # requests handed from the prefill pool to the decode pool
    kv_bytes: int  # in all
    p50_s: float  # hand-off time (first token sampled -> decode holds the KV), over the most recent hand-offs
    p99_s: float
    gibps: float  # effective copy bandwidth over the most recent hand-offs: their bytes / their copy time


class StatsReply(_Client, tag="stats"):
    key: int
    stats: DaemonStats


ClientEvent = Accepted | TokenOut | Finished | Cancelled | ErrorEvent | StatsReply


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
    """Who hands KV to whom in a disaggregated plan (the same for every stage): prefill
    stage i has global index i, decode stage j has global index len(prefill) + j."""

    prefill: list[KvSegment]
    decode: list[tuple[int, int]]  # each decode stage's layers
    lease_s: float

    @property
    def decode_head(self) -> int:
        return len(self.prefill)


class EdgeSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One stage-to-stage edge: its slot ring's kind, name, geometry and both ends' devices."""

    kind: str  # "shm" | "pinned" | "cuda-ipc" (kvasir/edges.py)
    name: str
    slots: int
    max_tokens: int
    hidden: int
    dtype: str
    producer: str = "cpu"  # the writing stage's device
    consumer: str = "cpu"  # the reading stage's device (where CUDA IPC slots live)


class CudaMemoryHandle(_Wire):
    """A CUDA allocation exported for another process (torch's storage sharing, as bytes)."""

    device: int
    handle: bytes  # the allocation's cudaIpcMemHandle
    size: int  # bytes of the shared storage
    offset: int  # its offset inside the allocation
    ref_counter: bytes  # torch's reference-counter file for the allocation
    ref_counter_offset: int
    event: bytes  # the allocation's own event handle (torch waits on it when opening)
    event_sync: bool


class EdgeHandles(_Tagged):
    """Stage -> launcher -> the edge's other stage: one side's CUDA IPC handles, sent once
    at start-up. The consumer's half names its slot buffers and its "slot read" events,
    the producer's its "slot written" events (one interprocess event per slot)."""

    edge: str  # EdgeSpec.name
    side: str  # "producer" | "consumer"
    index: int  # the sending stage's global index
    pid: int
    device: int  # where the events (and the consumer's buffers) live
    events: tuple[bytes, ...]
    memory: CudaMemoryHandle | None = None  # consumer only


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a child process needs, handed over as msgpack bytes (never pickle)."""

    role: str  # "stage" | "bridge"
    index: int  # stage index (0 for the bridge)
    plan: Plan  # model.source already resolved to an absolute path or alias
    runtime_dir: str
    launcher_pid: int
    edges: list[EdgeSpec]  # edge k runs from the pool's stage k to its stage k+1
    pool: str = ""  # "prefill" | "decode" (plan is then that pool's view), "" colocated
    first: int = 0  # global index of the pool's first stage (index is global)
    handoff: HandoffWiring | None = None
    stats_interval_s: float = 0.5
    log_level: str = "info"


class Ready(_Tagged):
    role: str
    index: int
    pid: int


class Drained(_Tagged):
    pass


class Heartbeat(_Tagged):
    """A child's loop is still turning (sent about twice a second); silence means hung."""

    role: str
    index: int
    pid: int


ControlMessage = Ready | Drained | Heartbeat | EdgeHandles


CommandKind = Literal["serve", "ring_down", "attach", "drain", "stop"]


class Command(_Wire):
    # "serve" (bridge: every stage is ready; bind the client endpoints, or after a restart
    # take requests again) | "ring_down" (bridge: the stages failed and are restarting) |
    # "attach" (stage: CUDA IPC handles of its edges' other sides) | "drain" | "stop"
    kind: CommandKind
    code: str = "shutting_down"  # with "stop": the error code for requests still running
    message: str = ""  # with "ring_down": what failed; with "serve": the last failure ("" for none)
    restarts: int = 0  # with "serve": ring restarts so far
    pids: tuple[int, ...] = ()  # with "serve": the stages' pids (stats from any other process are stale)
    handles: tuple[EdgeHandles, ...] = ()  # with "attach" (stages at start-up): the other sides' CUDA IPC handles
