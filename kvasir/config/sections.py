"""The plan's sections: each TOML table decoded strictly into a frozen msgspec Struct
(kvasir/config/plan.py puts them together and checks their values)."""

from __future__ import annotations

from typing import Literal

import msgspec

from kvasir.config.experts import ShardSpec
from kvasir.units import MIB

PrefixShare = Literal["tenant", "all"]
# How a GGUF model's matrices are served: in their stored block format (Q4_0, Q4_1, Q8_0,
# kvasir/model/quant/), dequantised to model.dtype, or "auto": as stored where that is fast
# (bfloat16 on CPU stages), else dequantised. A model folder is the same either way.
Weights = Literal["auto", "as_stored", "dequantize"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ModelSpec(_Section, frozen=True):
    source: str = "smollm2-135m"
    dtype: str = "float32"
    weights: Weights = "auto"
    max_seq_len: int = 2048
    chat_template: str | None = (
        None  # a Jinja file used instead of the model's template (relative: from the plan's folder)
    )
    # how the model is told about tools and writes calls (kvasir/http/tools.py): "auto" reads its template
    tool_format: Literal["auto", "hermes", "llama3_json", "prompted"] = "auto"


class BatchSpec(_Section, frozen=True):
    max_rows: int = 32
    max_tokens: int = 256
    inflight: int = 3


class KvSpec(_Section, frozen=True):
    block_size: int = 16
    num_blocks: int = 1024
    prefix_cache: bool = True  # reuse the KV blocks of prompts' shared beginnings (kvasir/sched/prefix.py)
    prefix_share: PrefixShare = "tenant"  # share cached blocks within one tenant, or between "all" clients


class BridgeSpec(_Section, frozen=True):
    max_waiting: int = 1024  # requests in the daemon before new ones are refused "overloaded"
    max_per_client: int = 256  # requests one client connection may have in the daemon at once
    max_client_queue: int = (
        100_000  # events waiting for one client; beyond, it is not reading: its requests are cancelled
    )
    max_client_bytes: int = 32 * MIB  # bytes of events waiting for one client; beyond, as max_client_queue
    max_tokens_per_request: int | None = (
        None  # a request asking for more is refused (None: no ceiling; max_seq_len caps)
    )
    tcp: str | None = None  # also serve remote clients at "tcp://HOST:PORT" (CURVE keys required)
    tcp_allow_local_unauthenticated: bool = False  # a loopback tcp without keys: every local user may connect
    server_key: str | None = None  # the daemon's CURVE secret key file (`kvasir keys generate`)
    client_keys: str | None = None  # folder of the CURVE public keys (*.key) of the clients let in


class SuperviseSpec(_Section, frozen=True):
    max_restarts: int = 5  # restarts of one instance within restart_window_s; past them the instance is done for
    restart_window_s: float = 600.0
    heartbeat_timeout_s: float = 30.0  # a child silent this long is hung: killed and restarted


class StageSpec(_Section, frozen=True):
    layers: tuple[int, int]
    device: str = "cpu"
    threads: int = 1
    solo_threads: int | None = None  # threads for a batch alone in the ring (the head marks it); default: threads
    cpus: tuple[int, ...] | None = None
    edge: str | None = None  # slot kind of the edge to the next stage: auto (default) | cuda-ipc | pinned | shm
    experts: tuple[ShardSpec, ...] = ()  # expert shards of its MoE layers; none: the stage runs its experts
    host: str | None = None  # a [hosts.NAME] of the plan (default: the cluster's leader)


class InstanceSpec(_Section, frozen=True):
    """One instance: a ring of its own (its stages split every layer), optionally with its
    own widths and cache (kvasir/config/fleet.py)."""

    name: str
    stages: tuple[StageSpec, ...] = ()
    batch: BatchSpec | None = None  # default: its pool's [batch], else the plan's
    kv: KvSpec | None = None  # default: its pool's [kv], else the plan's


class PoolSpec(_Section, frozen=True):
    """One pool of a disaggregated plan: one pipeline ([[POOL.stages]]) or several
    instances ([[POOL.instances]]), optionally its own widths and cache."""

    stages: tuple[StageSpec, ...] = ()
    instances: tuple[InstanceSpec, ...] = ()
    batch: BatchSpec | None = None  # default: the plan's [batch]
    kv: KvSpec | None = None  # default: the plan's [kv]


RoutePolicy = Literal["cache_aware", "least_loaded", "round_robin"]


class RouteSpec(_Section, frozen=True):
    """How the bridge's conductor picks each request's instance (kvasir/bridge/conductor.py)."""

    policy: RoutePolicy = "cache_aware"


class HandoffSpec(_Section, frozen=True):
    lease_s: float = 60.0  # prefill KV not confirmed by the decode pool within this is freed (request failed)


Pool = Literal["", "prefill", "decode"]  # "" in a colocated plan
POOLS: tuple[Pool, ...] = ("prefill", "decode")
