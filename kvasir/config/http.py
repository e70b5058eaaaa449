"""The plan's ``[http]`` section: the OpenAI-compatible HTTP front (kvasir/http/).

No ``[http]``, no HTTP. An address other hosts can reach needs ``api_keys`` (bearer keys,
one per line), as the bridge's TCP endpoint needs CURVE keys.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from kvasir.config.placement import positive
from kvasir.errors import PlanError

_LISTEN_RE = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5})$")
MAX_WORKERS = 64  # front processes sharing the port
MAX_KEY_CHARS = 4096  # one bearer key
MAX_KEYS = 10_000


class HttpSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    listen: str = "127.0.0.1:8000"  # HOST:PORT
    api_keys: str | None = None  # a file of bearer keys, one per line (relative: from the plan's folder)
    workers: int = 1  # front processes sharing the one listening socket the launcher binds
    model_name: str | None = None  # the id in /v1/models and responses (default: from model.source)


def parse_listen(listen: str) -> tuple[str, int] | None:
    """(host, port) of "HOST:PORT" (brackets taken off an IPv6 address), or None if malformed."""
    match = _LISTEN_RE.match(listen)
    if match is None or not 0 < int(match.group("port")) < 65536:
        return None
    return match.group("host").strip("[]"), int(match.group("port"))


def is_loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or re.fullmatch(r"127(\.[0-9]{1,3}){3}", host) is not None


def check_http(http: HttpSpec) -> None:
    """Model-independent checks of ``[http]`` (the key file is read when the plan is resolved)."""
    where = parse_listen(http.listen)
    if where is None:
        raise PlanError(f"http.listen = {http.listen!r} is not an address of the form HOST:PORT (port 1-65535)")
    if http.api_keys is None and not is_loopback(where[0]):
        raise PlanError(
            f"http.listen = {http.listen!r} is reachable from other hosts: it needs http.api_keys (a file of "
            "bearer keys, one per line), or a loopback address"
        )
    positive("http.workers", http.workers)
    if http.workers > MAX_WORKERS:
        raise PlanError(f"http.workers = {http.workers} is more than {MAX_WORKERS} front processes")
    if http.model_name is not None and not model_name_ok(http.model_name):
        raise PlanError(
            f"http.model_name = {http.model_name!r} must be 1-256 printable characters without spaces or quotes"
        )


def model_name_ok(name: str) -> bool:
    return 0 < len(name) <= 256 and name.isprintable() and not any(c in name for c in " \"'\\")


def default_model_name(source: str) -> str:
    """The id a plan without ``http.model_name`` serves under: the alias, or the file or
    folder name of a path (without .gguf)."""
    name = Path(source.rstrip("/")).name.removesuffix(".gguf") or "model"
    return name if model_name_ok(name) else "model"


def read_api_keys(path: Path) -> frozenset[str]:
    """The bearer keys in ``path`` (one per line; blank lines and lines starting with # skipped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError(f"http.api_keys: key file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"http.api_keys: cannot read {path}: {exc}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise PlanError(f"http.api_keys: {path} holds no key (one bearer key per line)")
    if len(keys) > MAX_KEYS:
        raise PlanError(f"http.api_keys: {path} holds {len(keys)} keys, more than {MAX_KEYS}")
    for number, key in enumerate(keys, 1):
        if len(key) > MAX_KEY_CHARS or not key.isprintable() or any(c.isspace() for c in key):
            raise PlanError(
                f"http.api_keys: key {number} of {path} is not one printable word of at most 4096 characters"
            )
    return frozenset(keys)
