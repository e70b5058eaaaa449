"""A plan file made ready to serve: the plan and its model source, checked together."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvasir.config.http import default_model_name, read_api_keys, tls_context
from kvasir.config.keys import POOL_SECRET, KeyFileError, allowed_keys, load_pair, load_public, read_pool_secret
from kvasir.config.plan import Plan, check_model_fit, load_plan
from kvasir.daemon.dtype import DtypeChoice, auto_dtype, checkpoint_dtype, cpu_flags
from kvasir.errors import ModelSourceError, PlanError
from kvasir.model.quant.linear import int4_kernels_available
from kvasir.model.quant.stored import check_weights
from kvasir.model.source import ModelSource, resolve_source
from kvasir.model.tokenizer import read_template


def resolve_plan(path: str | Path) -> tuple[Plan, ModelSource]:
    """Load a plan, resolve its model and key files (relative paths from the plan's
    folder), check the fit and that the keys load."""
    path = Path(path)
    plan = load_plan(path)
    base = path.parent.resolve()
    try:
        source = resolve_source(plan.model.source, base_dir=base)
        plan = resolve_dtype(plan, source)
        check_model_fit(plan, source.num_layers, source.max_positions, source.num_experts, source.moe_layers)
        plan = resolve_weights(plan, source)
        plan = resolve_draft(plan, source, base)
        plan = resolve_template(resolve_http(resolve_cluster(resolve_keys(plan, base), base), base), base)
    except (PlanError, ModelSourceError) as exc:
        raise PlanError(f"{path}: {exc}") from None
    return plan, source


def resolve_draft(plan: Plan, source: ModelSource, base: Path) -> Plan:
    """A plan drafting with a model: that model found (a relative path from the plan's
    folder, written back absolute for the workers), prepared, and of the target's vocabulary."""
    spec = plan.speculative
    if spec is None or spec.draft_model is None:
        return plan
    try:
        draft = resolve_source(spec.draft_model, base_dir=base)
    except ModelSourceError as exc:
        raise PlanError(f"speculative.draft_model: {exc}") from None
    if draft.weights_dir is None:
        raise PlanError(
            f"speculative.draft_model {spec.draft_model!r} is not prepared yet: run `kvasir model prepare "
            f"{spec.draft_model}` first"
        )
    if draft.vocab_size != source.vocab_size:
        raise PlanError(
            f"speculative.draft_model {spec.draft_model!r} has a vocabulary of {draft.vocab_size} tokens, the "
            f"model {source.vocab_size}: a draft model must share the model's tokenizer"
        )
    builtin = draft.cache_name == spec.draft_model
    where = spec.draft_model if builtin else str((base / Path(spec.draft_model).expanduser()).resolve())
    return msgspec.structs.replace(plan, speculative=msgspec.structs.replace(spec, draft_model=where))


def resolve_dtype(plan: Plan, source: ModelSource) -> Plan:
    """The plan with ``model.dtype = "auto"`` replaced by the dtype it comes to here."""
    if plan.model.dtype != "auto":
        return plan
    dtype = dtype_choice(plan, source).dtype
    return msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, dtype=dtype))


def resolve_weights(plan: Plan, source: ModelSource) -> Plan:
    """The plan with ``model.weights`` as it comes to for every worker ("as_stored" or
    "dequantize"), once the plan's choice is checked (kvasir/model/quant/stored.py)."""
    kernels = int4_kernels_available()
    served = check_weights(plan.model.weights, plan.model.dtype, worker_devices(plan), source.packed, kernels=kernels)
    return msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, weights=served))


def dtype_choice(plan: Plan, source: ModelSource) -> DtypeChoice:
    """What ``model.dtype = "auto"`` comes to for this model and machine, and why."""
    wanted, origin = checkpoint_dtype(
        getattr(source.config, "dtype", None), source.stored_gguf is not None, source.scheme is not None
    )
    return auto_dtype(wanted, origin, worker_devices(plan), cpu_flags())


def worker_devices(plan: Plan) -> list[str]:
    """Every stage's and expert shard's device, in every instance."""
    stages = [stage for ring in plan.rings() for stage in ring.plan.stages]
    return [stage.device for stage in stages] + [shard.device for stage in stages for shard in stage.experts]


def resolve_keys(plan: Plan, base: Path) -> Plan:
    """The plan with absolute key paths, once both load (PlanError naming the key if not)."""
    bridge = plan.bridge
    if bridge.server_key is None or bridge.client_keys is None:  # the plan check: both or neither
        return plan
    server_key, client_keys = base / bridge.server_key, base / bridge.client_keys
    try:
        load_pair(server_key)
    except KeyFileError as exc:
        raise PlanError(f"bridge.server_key: {exc}") from None
    try:
        allowed_keys(client_keys)
    except KeyFileError as exc:
        raise PlanError(f"bridge.client_keys: {exc}") from None
    bridge = msgspec.structs.replace(bridge, server_key=str(server_key), client_keys=str(client_keys))
    return msgspec.structs.replace(plan, bridge=bridge)


def resolve_cluster(plan: Plan, base: Path) -> Plan:
    """The plan with an absolute ``cluster.keys``, once every host's public key loads."""
    if plan.cluster is None or plan.cluster.keys is None:  # the plan check: hosts need keys
        return plan
    folder = base / plan.cluster.keys
    if not folder.is_dir():
        raise PlanError(f"cluster.keys: host key folder not found: {folder}")
    for name in sorted(plan.hosts):
        try:
            load_public(folder / f"{name}.key")
        except KeyFileError as exc:
            raise PlanError(
                f"cluster.keys: host {name}: {exc} (make the pairs with `kvasir keys generate DIR --host {name}`)"
            ) from None
    if plan.kv_pool is not None:  # every host keys its slices' checksums with the fleet's one secret
        try:
            read_pool_secret(folder / POOL_SECRET)
        except KeyFileError as exc:
            raise PlanError(f"cluster.keys: [kv_pool] across hosts needs the fleet's pool secret: {exc}") from None
    return msgspec.structs.replace(plan, cluster=msgspec.structs.replace(plan.cluster, keys=str(folder)))


def resolve_template(plan: Plan, base: Path) -> Plan:
    """The plan with an absolute ``model.chat_template``, once the file reads."""
    if plan.model.chat_template is None:
        return plan
    path = base / plan.model.chat_template
    try:
        read_template(path)
    except ValueError as exc:
        raise PlanError(f"model.chat_template: {exc}") from None
    return msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, chat_template=str(path)))


def resolve_http(plan: Plan, base: Path) -> Plan:
    """The plan with an absolute ``http.api_keys`` (once its keys read) and a
    ``http.model_name`` (derived from model.source when the plan gives none)."""
    http = plan.http
    if http is None:
        return plan
    api_keys = http.api_keys
    if api_keys is not None:
        read_api_keys(base / api_keys)
        api_keys = str(base / api_keys)
    cert, key = http.tls_cert, http.tls_key
    if cert is not None and key is not None:  # the plan check: both or neither
        cert, key = str(base / cert), str(base / key)
        tls_context(cert, key)
    name = http.model_name or default_model_name(plan.model.source)
    http = msgspec.structs.replace(http, api_keys=api_keys, model_name=name, tls_cert=cert, tls_key=key)
    return msgspec.structs.replace(plan, http=http)
