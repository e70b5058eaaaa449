"""A stage's tiers of the KV pool, opened once at its start on its own host: each tier's
root checked (kvasir/kvpool/files.py: the memory tier's folder, which the daemon made
fresh, open to nobody else; ``disk_dir`` this user's and writable by nobody else),
its folder ``ROOT/MODEL/FIRST-END`` (shared by the stages of the same layers on the
host) made or checked, and the secret that keys every slice's checksum read: the
fleet's (``cluster.keys/kvpool.secret``) in a plan across hosts, else the one kept
beside the tier (the disk tier's, else the memory tier's; made on first use).

A tier that cannot be used is refused by name in the stage's log and stats, and the
stage serves without it: a storage fault costs cache hits, never the stage.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kvasir.config.keys import read_pool_secret
from kvasir.errors import KvasirError
from kvasir.kvpool.disk import DiskTier
from kvasir.kvpool.files import Folder, Refused, reason_of
from kvasir.kvpool.health import TierHealth, TierName
from kvasir.kvpool.index import Tier
from kvasir.model.fingerprint import model_identity
from kvasir.model.source import ModelSource
from kvasir.wire.control import PoolTiers


@dataclass
class OpenTiers:
    tiers: dict[Tier, DiskTier]  # the tiers to use, fastest first
    refused: tuple[TierHealth, ...]  # and those refused (reported)
    secret: bytes


def open_tiers(settings: PoolTiers, source: ModelSource, dtype: str, layers: tuple[int, int], log) -> OpenTiers:
    """A stage's tiers, each with its folder's byte budget; the refused ones' health."""
    model = hashlib.sha256(model_identity(source.weights_dir, dtype).encode()).hexdigest()[:16]
    wanted: list[tuple[TierName, str, int]] = [
        ("host", settings.host_dir, settings.host_bytes),
        ("disk", settings.disk_dir, settings.disk_bytes),
    ]
    roots: dict[Tier, Folder] = {}
    tiers: dict[Tier, DiskTier] = {}
    refused: list[TierHealth] = []
    try:
        for tier, path, nbytes in (w for w in wanted if w[2] > 0):
            health = TierHealth(tier, path, log)
            try:
                roots[tier] = Folder.root(Path(path), make=tier == "disk", private=tier == "host")
                tiers[tier] = DiskTier(_leaf(roots[tier], model, f"{layers[0]}-{layers[1]}"), nbytes, health)
            except Refused as exc:
                health.refuse(exc.reason, str(exc))
                refused.append(health)
            except OSError as exc:
                health.refuse(reason_of(exc), f"{path}: {exc.strerror or exc}")
                refused.append(health)
        try:
            secret = _secret(settings, roots)
        except (KvasirError, OSError) as exc:  # no secret: no tier can be trusted
            for unkeyed in tiers.values():
                unkeyed.health.refuse("secret", str(exc))
                unkeyed.close()
            return OpenTiers({}, (*refused, *(t.health for t in tiers.values())), b"")
    finally:
        for root in roots.values():
            root.close()
    return OpenTiers(tiers, tuple(refused), secret)


def _leaf(root: Folder, model: str, layers: str) -> Folder:
    """``root/model/layers``, each made 0700 or checked."""
    middle = root.child(model)
    try:
        return middle.child(layers)
    finally:
        middle.close()


def _secret(settings: PoolTiers, roots: dict[Tier, Folder]) -> bytes:
    if settings.secret_file:
        return read_pool_secret(settings.secret_file)
    beside = roots.get("disk") or roots.get("host")
    return beside.secret() if beside is not None else b""
