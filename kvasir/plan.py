"""The plan file: TOML decoded strictly into frozen msgspec Structs.

``load_plan`` checks everything that can be checked without the model (types, unknown
keys, widths, devices, stage count, KV capacity); ``check_layers`` checks the stage
split against the model's layer count once the model's config is known.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec

from kvasir.errors import PlanError

DTYPES = ("float32", "bfloat16", "float16")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:(0|[1-9][0-9]*))?)$")


class _Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ModelSpec(_Section):
    source: str = "smollm2-135m"
    dtype: str = "float32"
    max_seq_len: int = 2048


class BatchSpec(_Section):
    max_rows: int = 32
    max_tokens: int = 256
    inflight: int = 3


class KvSpec(_Section):
    block_size: int = 16
    num_blocks: int = 1024


class BridgeSpec(_Section):
    max_waiting: int = 1024


class StageSpec(_Section):
    layers: tuple[int, int]
    device: str = "cpu"
    threads: int = 1
    cpus: tuple[int, ...] | None = None


class Plan(_Section):
    model: ModelSpec = ModelSpec()
    batch: BatchSpec = BatchSpec()
    kv: KvSpec = KvSpec()
    bridge: BridgeSpec = BridgeSpec()
    stages: tuple[StageSpec, ...] = ()

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]


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


def _positive(key: str, value: int) -> None:
    if value <= 0:
        raise PlanError(f"{key} must be a positive integer, got {value}")


def _check_values(plan: Plan) -> None:
    model, batch, kv = plan.model, plan.batch, plan.kv
    if not model.source.strip():
        raise PlanError("model.source must name a model (built-in alias or path), got an empty string")
    if model.dtype not in DTYPES:
        raise PlanError(f"model.dtype must be one of {', '.join(DTYPES)}, got {model.dtype!r}")
    _positive("model.max_seq_len", model.max_seq_len)
    _positive("batch.max_rows", batch.max_rows)
    _positive("batch.max_tokens", batch.max_tokens)
    _positive("batch.inflight", batch.inflight)
    if batch.max_tokens < batch.max_rows:
        raise PlanError(
            f"batch.max_tokens ({batch.max_tokens}) must be >= batch.max_rows ({batch.max_rows}): "
            "every row carries at least one token"
        )
    _positive("kv.block_size", kv.block_size)
    _positive("kv.num_blocks", kv.num_blocks)
    capacity = kv.block_size * kv.num_blocks
    if capacity < model.max_seq_len:
        raise PlanError(
            f"kv: {kv.num_blocks} blocks x {kv.block_size} tokens = {capacity} tokens cannot hold "
            f"one request of model.max_seq_len = {model.max_seq_len} tokens"
        )
    _positive("bridge.max_waiting", plan.bridge.max_waiting)
    _check_stages(plan.stages)


def _check_stages(stages: tuple[StageSpec, ...]) -> None:
    if len(stages) < 2:
        raise PlanError(
            f"stages: a pipeline needs at least two stages: head and tail are different roles "
            f"(the plan has {len(stages)})"
        )
    for i, stage in enumerate(stages):
        key = f"stages[{i}]"
        start, end = stage.layers
        if start < 0 or end <= start:
            raise PlanError(
                f"{key}.layers = [{start}, {end}] is not a half-open range [start, end) with 0 <= start < end"
            )
        if not _DEVICE_RE.match(stage.device):
            raise PlanError(f"{key}.device = {stage.device!r} is not a device (use 'cpu', 'cuda' or 'cuda:N')")
        _positive(f"{key}.threads", stage.threads)
        if stage.cpus is not None:
            if not stage.cpus:
                raise PlanError(f"{key}.cpus is empty: list at least one CPU or leave the key out")
            if any(c < 0 for c in stage.cpus) or len(set(stage.cpus)) != len(stage.cpus):
                raise PlanError(f"{key}.cpus = {list(stage.cpus)} must be distinct non-negative CPU numbers")
    if stages[0].layers[0] != 0:
        raise PlanError(
            f"stages[0].layers starts at {stages[0].layers[0]}: layers [0, {stages[0].layers[0]}) are in no stage"
        )
    for i in range(len(stages) - 1):
        _, end = stages[i].layers
        nxt, _ = stages[i + 1].layers
        if nxt > end:
            raise PlanError(
                f"stages[{i + 1}].layers: gap between stages {i} and {i + 1}: "
                f"layers [{end}, {nxt}) are in no stage"
            )
        if nxt < end:
            raise PlanError(
                f"stages[{i + 1}].layers: stages {i} and {i + 1} overlap on layers "
                f"[{nxt}, {min(end, stages[i + 1].layers[1])})"
            )


def check_model_fit(plan: Plan, num_layers: int, max_positions: int | None) -> None:
    """Check the plan against the model: exact layer coverage, context within range."""
    last = len(plan.stages) - 1
    end = plan.stages[-1].layers[1]
    if end > num_layers:
        raise PlanError(
            f"stages[{last}].layers = {list(plan.stages[-1].layers)} goes past the model's "
            f"{num_layers} layers"
        )
    if end < num_layers:
        raise PlanError(
            f"stages[{last}].layers ends at {end}: layers [{end}, {num_layers}) of the model's "
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
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a TOML basic string
        if isinstance(v, (tuple, list)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    def table(section: _Section) -> list[str]:
        return [f"{k} = {value(v)}" for k, v in msgspec.structs.asdict(section).items() if v is not None]

    lines: list[str] = []
    for name in ("model", "batch", "kv", "bridge"):
        lines += [f"[{name}]", *table(getattr(plan, name)), ""]
    for stage in plan.stages:
        lines += ["[[stages]]", *table(stage), ""]
    return "\n".join(lines)
