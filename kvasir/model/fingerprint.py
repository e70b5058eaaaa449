"""What a model folder's weights are, as a short digest: the leader and each follower of a
plan across hosts must serve the same model, whatever its path on each host.

Reading every byte would take seconds per gigabyte at every start, so the digest covers
the config and, per weight file, its name, size and evenly spread samples (about 1 MiB a
file): a copy gives the same digest, another model or a fine-tune of the same
architecture (every tensor changed) does not.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLES = 16  # per weight file
SAMPLE_BYTES = 64 * 1024


def model_identity(weights_dir: Path | None, dtype: str) -> str:
    """What the leader and its followers compare: the weights' fingerprint and the dtype
    they are served in."""
    return f"{model_fingerprint(weights_dir) if weights_dir is not None else 'unconverted'}/{dtype}"


def model_fingerprint(weights_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(weights_dir.iterdir()):
        if path.name == "config.json":
            digest.update(b"config\0" + path.read_bytes())
        elif path.suffix == ".safetensors":
            _sample(digest, path)
    return digest.hexdigest()[:16]


def _sample(digest, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    step = max(size // SAMPLES, 1)
    with path.open("rb") as handle:
        for offset in range(0, size, step)[:SAMPLES]:
            handle.seek(offset)
            digest.update(handle.read(SAMPLE_BYTES))
