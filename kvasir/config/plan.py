"""The plan file: TOML decoded strictly into frozen msgspec Structs.

``load_plan`` checks everything that can be checked without the model (types, unknown
keys, widths, devices, stage count, KV capacity); ``check_layers`` checks the stage
split against the model's layer count once the model's config is known.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection
from pathlib import Path

import msgspec

from kvasir.config.cluster import ClusterSpec, HostSpec, check_cluster
from kvasir.config.devices import DTYPES, check_edge_request
from kvasir.config.experts import check_shards, check_shards_fit
from kvasir.config.fleet import Ring, check_pools, rings
from kvasir.config.http import HttpSpec, check_http, is_loopback
from kvasir.config.kvpool import KvPoolSpec, check_kv_pool
from kvasir.config.resources import check_placement, check_solo_threads, positive
from kvasir.config.roles import PlannerSpec, check_planner
from kvasir.config.sections import (
    POOLS,
    BatchSpec,
    BridgeSpec,
    HandoffSpec,
    InstanceSpec,
    KvSpec,
    ModelSpec,
    PoolSpec,
    RouteSpec,
    StageSpec,
    SuperviseSpec,
    _Section,
)
from kvasir.config.speculative import SpeculativeSpec, check_speculative
from kvasir.errors import PlanError

_TCP_RE = re.compile(r"^tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.*-]+):(?P<port>[0-9]{1,5})$")


class Plan(_Section, frozen=True):
    model: ModelSpec = ModelSpec()
    batch: BatchSpec = BatchSpec()
    kv: KvSpec = KvSpec()
    bridge: BridgeSpec = BridgeSpec()
    supervise: SuperviseSpec = SuperviseSpec()
    handoff: HandoffSpec = HandoffSpec()
    stages: tuple[StageSpec, ...] = ()  # one instance; or several in [[instances]]
    instances: tuple[InstanceSpec, ...] = ()
    route: RouteSpec = RouteSpec()  # which instance serves each request
    prefill: PoolSpec | None = None  # a disaggregated plan has both pools and no [[stages]]
    decode: PoolSpec | None = None
    cluster: ClusterSpec | None = None  # several hosts (kvasir/config/cluster.py)
    hosts: dict[str, HostSpec] = {}
    http: HttpSpec | None = None  # the OpenAI-compatible HTTP front (kvasir/config/http.py)
    kv_pool: KvPoolSpec | None = None  # prefix blocks kept past eviction, in tiers (kvasir/config/kvpool.py)
    speculative: SpeculativeSpec | None = None  # draft tokens verified in one pass (kvasir/config/speculative.py)
    planner: PlannerSpec | None = None  # instances that move between pools (kvasir/config/roles.py)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def num_layers(self) -> int:
        return self.all_stages[-1].layers[1]

    @property
    def all_stages(self) -> tuple[StageSpec, ...]:
        """Every stage process, in global order: pool by pool, instance by instance."""
        return tuple(stage for ring in self.rings() for stage in ring.plan.stages)

    def rings(self) -> list[Ring[Plan]]:
        """Each instance as a ring plan of its own (its stages, widths and cache), in
        global stage order (kvasir/config/fleet.py)."""
        return rings(self)


def load_plan(path: str | Path) -> Plan:
    """Read, decode and check a plan file; raise PlanError with one clear line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PlanError(f"plan file not found: {path}") from None
    except IsADirectoryError:
        raise PlanError(f"plan path is a directory, not a file: {path}") from None
    except OSError as exc:
        raise PlanError(f"cannot read plan file {path}: {exc.strerror}") from None
    return parse_plan(raw, origin=str(path))


def parse_plan(raw: bytes | str, origin: str = "<plan>") -> Plan:
    """Decode plan TOML text and run every model-independent check."""
    try:
        plan = msgspec.toml.decode(raw, type=Plan)
    except msgspec.ValidationError as exc:
        raise PlanError(f"{origin}: {_describe_validation(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise PlanError(f"{origin}: malformed TOML: {_strip_prefix(str(exc))}") from None
    try:
        _check_values(plan)
    except PlanError as exc:
        raise PlanError(f"{origin}: {exc}") from None
    return plan


def _strip_prefix(message: str) -> str:
    return message.removeprefix("Invalid TOML: ").removeprefix("Invalid TOML").strip() or message


def _describe_validation(message: str) -> str:
    """Turn msgspec's '... - at `$.batch.max_rows`' into 'batch.max_rows: ...'."""
    text, sep, where = message.rpartition(" - at `")
    if not sep:
        text, where = message, ""
    key = where.rstrip("`").removeprefix("$").lstrip(".")
    prefix = f"{key}." if key else ""
    unknown = re.match(r"Object contains unknown field `(.+)`", text)
    if unknown:
        return f"{prefix}{unknown.group(1)}: unknown key (not part of the plan format)"
    missing = re.match(r"Object missing required field `(.+)`", text)
    if missing:
        return f"{prefix}{missing.group(1)}: required key is missing"
    return f"{key or 'plan'}: {text[0].lower()}{text[1:]}"


def _check_values(plan: Plan) -> None:
    model, batch, kv = plan.model, plan.batch, plan.kv
    if not model.source.strip():
        raise PlanError("model.source must name a model (built-in alias or path), got an empty string")
    if model.dtype not in (*DTYPES, "auto"):
        raise PlanError(f"model.dtype must be one of {', '.join(DTYPES)} or auto, got {model.dtype!r}")
    positive("model.max_seq_len", model.max_seq_len)
    _check_widths("batch", batch)
    _check_kv("kv", kv, model.max_seq_len)
    positive("bridge.max_waiting", plan.bridge.max_waiting)
    positive("bridge.max_per_client", plan.bridge.max_per_client)
    positive("bridge.max_client_queue", plan.bridge.max_client_queue)
    positive("bridge.max_client_bytes", plan.bridge.max_client_bytes)
    if plan.bridge.max_tokens_per_request is not None:
        positive("bridge.max_tokens_per_request", plan.bridge.max_tokens_per_request)
    _check_tcp(plan.bridge)
    sup = plan.supervise
    if sup.max_restarts < 0:
        raise PlanError(f"supervise.max_restarts must be >= 0 (0: never restart), got {sup.max_restarts}")
    for key in ("restart_window_s", "heartbeat_timeout_s"):
        value = getattr(sup, key)
        if not value > 0 or value == float("inf"):
            raise PlanError(f"supervise.{key} must be a positive number of seconds, got {value}")
    if sup.heartbeat_timeout_s < 1.0:
        raise PlanError(
            f"supervise.heartbeat_timeout_s = {sup.heartbeat_timeout_s} is too short: children beat every "
            "0.5 s and a batch may take longer (use at least 1 s)"
        )
    if not plan.handoff.lease_s > 0 or plan.handoff.lease_s == float("inf"):
        raise PlanError(f"handoff.lease_s must be a positive number of seconds, got {plan.handoff.lease_s}")
    _check_pools(plan)
    check_cluster(plan)
    if plan.http is not None:
        check_http(plan.http, plan.bridge.max_per_client)
    if plan.kv_pool is not None:
        caches = all(ring.plan.kv.prefix_cache for ring in plan.rings())
        check_kv_pool(plan.kv_pool, caches, plan.disaggregated)
    if plan.speculative is not None:
        check_speculative(plan.speculative)
    check_planner(plan, Counter(ring.pool for ring in plan.rings()))


def _check_widths(key: str, batch: BatchSpec) -> None:
    positive(f"{key}.max_rows", batch.max_rows)
    positive(f"{key}.max_tokens", batch.max_tokens)
    positive(f"{key}.inflight", batch.inflight)
    if batch.max_tokens < batch.max_rows:
        raise PlanError(
            f"{key}.max_tokens ({batch.max_tokens}) must be >= {key}.max_rows ({batch.max_rows}): "
            "every row carries at least one token"
        )


def _check_kv(key: str, kv: KvSpec, max_seq_len: int) -> None:
    positive(f"{key}.block_size", kv.block_size)
    positive(f"{key}.num_blocks", kv.num_blocks)
    capacity = kv.block_size * kv.num_blocks
    if capacity < max_seq_len:
        raise PlanError(
            f"{key}: {kv.num_blocks} blocks x {kv.block_size} tokens = {capacity} tokens cannot hold "
            f"one request of model.max_seq_len = {max_seq_len} tokens"
        )


def _check_ring(key: str, ring: Plan, spec: InstanceSpec) -> None:
    """One instance's ring: its own widths and cache, its stages."""
    where = key.removesuffix(".stages")
    if spec.batch is not None:
        _check_widths(f"{where}.batch", spec.batch)
    if spec.kv is not None:
        _check_kv(f"{where}.kv", spec.kv, ring.model.max_seq_len)
    _check_stages(ring.stages, key)


def _check_pools(plan: Plan) -> None:
    check_pools(plan, _check_ring)
    for name in POOLS if plan.disaggregated else ():
        pool = getattr(plan, name)
        if pool.batch is not None:
            _check_widths(f"{name}.batch", pool.batch)
        if pool.kv is not None:
            _check_kv(f"{name}.kv", pool.kv, plan.model.max_seq_len)
    for ring in plan.rings() if plan.disaggregated else ():
        for i, stage in enumerate(ring.plan.stages):
            workers = [(f"{ring.key}[{i}]", stage.device)]
            workers += [(f"{ring.key}[{i}].experts[{j}]", shard.device) for j, shard in enumerate(stage.experts)]
            for key, device in workers:
                if device != "cpu":
                    raise PlanError(
                        f"{key}.device = {device!r}: in this version a disaggregated plan runs on CPU "
                        "stages (the KV hand-off goes through shared memory)"
                    )


def tcp_host(endpoint: str) -> str | None:
    """HOST of "tcp://HOST:PORT" (brackets kept off an IPv6 address), or None if malformed."""
    match = _TCP_RE.match(endpoint)
    if match is None or not 0 < int(match.group("port")) < 65536:
        return None
    return match.group("host").strip("[]")


def _check_tcp(bridge: BridgeSpec) -> None:
    if (bridge.server_key is None) != (bridge.client_keys is None):
        raise PlanError("bridge.server_key and bridge.client_keys go together: give both or neither")
    if bridge.tcp is None:
        if bridge.server_key is not None:
            raise PlanError("bridge.server_key is set but bridge.tcp is not: keys only guard a TCP endpoint")
        return
    host = tcp_host(bridge.tcp)
    if host is None:
        raise PlanError(f"bridge.tcp = {bridge.tcp!r} is not an endpoint of the form tcp://HOST:PORT (port 1-65535)")
    if bridge.server_key is not None:
        if bridge.tcp_allow_local_unauthenticated:
            raise PlanError("bridge.tcp_allow_local_unauthenticated is set, but bridge.tcp has keys: leave it out")
        return
    if not is_loopback(host):
        raise PlanError(
            f"bridge.tcp = {bridge.tcp!r} is reachable from other hosts: it needs bridge.server_key and "
            "bridge.client_keys (make them with `kvasir keys generate DIR`), or a loopback address"
        )
    if not bridge.tcp_allow_local_unauthenticated:
        raise PlanError(
            f"bridge.tcp = {bridge.tcp!r} has no keys: every local user could connect (the runtime dir is the "
            "daemon user's alone): give bridge.server_key and bridge.client_keys, or write "
            "bridge.tcp_allow_local_unauthenticated = true"
        )


def _check_stages(stages: tuple[StageSpec, ...], name: str) -> None:
    if len(stages) < 2:
        raise PlanError(
            f"{name}: a pipeline needs at least two stages: head and tail are different roles "
            f"(the plan has {len(stages)})"
        )
    for i, stage in enumerate(stages):
        key = f"{name}[{i}]"
        start, end = stage.layers
        if start < 0 or end <= start:
            raise PlanError(
                f"{key}.layers = [{start}, {end}] is not a half-open range [start, end) with 0 <= start < end"
            )
        check_placement(key, stage.device, stage.threads, stage.cpus)
        check_solo_threads(key, stage.threads, stage.solo_threads)
        check_shards(key, stage.experts)
    for i, stage in enumerate(stages):
        consumer = stages[i + 1].device if i + 1 < len(stages) else None
        check_edge_request(f"{name}[{i}]", stage.edge, stage.device, consumer)
    if stages[0].layers[0] != 0:
        raise PlanError(
            f"{name}[0].layers starts at {stages[0].layers[0]}: layers [0, {stages[0].layers[0]}) are in no stage"
        )
    for i in range(len(stages) - 1):
        _, end = stages[i].layers
        nxt, _ = stages[i + 1].layers
        if nxt > end:
            raise PlanError(
                f"{name}[{i + 1}].layers: gap between stages {i} and {i + 1}: layers [{end}, {nxt}) are in no stage"
            )
        if nxt < end:
            raise PlanError(
                f"{name}[{i + 1}].layers: stages {i} and {i + 1} overlap on layers "
                f"[{nxt}, {min(end, stages[i + 1].layers[1])})"
            )


def check_model_fit(
    plan: Plan,
    num_layers: int,
    max_positions: int | None,
    num_experts: int = 0,
    moe_layers: Collection[int] = (),
) -> None:
    """Check the plan against the model: exact layer coverage (by every pool), context
    within range, expert shards only on MoE layers and covering every expert
    (``num_experts`` 0: a dense model)."""
    for ring in plan.rings():
        key, view = ring.key, ring.plan
        for i, stage in enumerate(view.stages):
            check_shards_fit(f"{key}[{i}]", stage.layers, stage.experts, num_experts, moe_layers)
        last = len(view.stages) - 1
        end = view.stages[-1].layers[1]
        if end > num_layers:
            raise PlanError(
                f"{key}[{last}].layers = {list(view.stages[-1].layers)} goes past the model's {num_layers} layers"
            )
        if end < num_layers:
            raise PlanError(
                f"{key}[{last}].layers ends at {end}: layers [{end}, {num_layers}) of the model's "
                f"{num_layers} are in no stage"
            )
    if max_positions is not None and plan.model.max_seq_len > max_positions:
        raise PlanError(
            f"model.max_seq_len = {plan.model.max_seq_len} exceeds the model's "
            f"max_position_embeddings = {max_positions}"
        )


def plan_toml(plan: Plan) -> str:
    """The plan as TOML text that ``parse_plan`` reads back into an equal Plan."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a TOML basic string
        if isinstance(v, (tuple, list)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    def table(section: msgspec.Struct) -> list[str]:
        nested = ("experts",) if isinstance(section, StageSpec) else ()  # a stage's shards: tables of their own
        items = msgspec.structs.asdict(section).items()
        return [f"{k} = {value(v)}" for k, v in items if v is not None and k not in nested]

    def stage(name: str, spec: StageSpec) -> list[str]:
        shards = [line for shard in spec.experts for line in (f"[[{name}.experts]]", *table(shard), "")]
        return [f"[[{name}]]", *table(spec), "", *shards]

    def parts(name: str, section: PoolSpec | InstanceSpec) -> list[str]:
        lines: list[str] = []
        for part in ("batch", "kv"):
            if getattr(section, part) is not None:
                lines += [f"[{name}.{part}]", *table(getattr(section, part)), ""]
        for spec in section.stages:
            lines += stage(f"{name}.stages", spec)
        return lines

    def instances(name: str, listed: tuple[InstanceSpec, ...]) -> list[str]:
        lines: list[str] = []
        for spec in listed:
            lines += [f"[[{name}]]", f"name = {value(spec.name)}", "", *parts(name, spec)]
        return lines

    lines: list[str] = []
    for name in (
        "model",
        "batch",
        "kv",
        "bridge",
        "supervise",
        "handoff",
        "route",
        "cluster",
        "http",
        "kv_pool",
        "speculative",
        "planner",
    ):
        if getattr(plan, name) is not None:
            lines += [f"[{name}]", *table(getattr(plan, name)), ""]
    for host, address in plan.hosts.items():
        lines += [f"[hosts.{host}]", *table(address), ""]
    for spec in plan.stages:
        lines += stage("stages", spec)
    lines += instances("instances", plan.instances)
    for name in POOLS:
        pool = getattr(plan, name)
        if pool is not None:
            lines += parts(name, pool) + instances(f"{name}.instances", pool.instances)
    return "\n".join(lines)


def default_plan_path() -> Path:
    return Path(__file__).parent.parent / "plans" / "smollm2-2stage.toml"
