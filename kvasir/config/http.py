"""The plan's ``[http]`` section: the OpenAI-compatible HTTP front (kvasir/http/).

No ``[http]``, no HTTP. An address other hosts can reach needs ``api_keys`` (bearer keys,
one per line), as the bridge's TCP endpoint needs CURVE keys, and TLS (``tls_cert`` and
``tls_key``) unless ``allow_plaintext`` says keys and prompts may cross the network in
clear text.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Literal

import msgspec

from kvasir.config.private import KeyFileError, check_private
from kvasir.config.resources import positive
from kvasir.errors import PlanError

_LISTEN_RE = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5})$")
MAX_WORKERS = 64  # front processes sharing the port
MAX_KEY_CHARS = 4096  # one bearer key
MAX_KEYS = 10_000
MAX_TIMEOUT_S = 3600.0
MAX_CONNECTIONS = 1 << 20  # per front (the descriptor limit is raised to fit at start)
DEFAULT_CHOICES = 16  # http.max_choices unless set (or a caller's share, when smaller)
DEFAULT_PER_CALLER = 64  # http.max_per_caller unless set (or bridge.max_per_client, when smaller)
MAX_FANOUT = 256  # http.max_choices at most (prompts x n of one request)


class HttpSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    listen: str = "127.0.0.1:8000"  # HOST:PORT
    api_keys: str | None = None  # a file of bearer keys, one per line (relative: from the plan's folder)
    workers: int = 1  # front processes sharing the one listening socket the launcher binds
    model_name: str | None = None  # the id in /v1/models and responses (default: from model.source)
    # limits (docs/operations.md): what one connection, request or caller may hold of a front
    max_connections: int = 1024  # open connections per front; beyond: the longest-idle one is closed
    header_timeout_s: float = 10.0  # from a connection's opening to its first request head
    idle_timeout_s: float = 30.0  # from a response's end to the next request head (keep-alive)
    body_timeout_s: float = 30.0  # reading one request body
    write_timeout_s: float = 30.0  # a response write the client does not take: the request is cancelled
    max_choices: int | None = None  # submissions of one request, prompts x n (default: 16, within a caller's share)
    max_per_caller: int | None = (
        None  # in flight per caller (API key, or address) per front (default: 64, within bridge.max_per_client)
    )
    max_tokens: int = 4096  # ceiling of a request's max_tokens
    allow_ignore_eos: bool = False  # ignore_eos = true runs to max_tokens whatever the model says: opt in
    tls_cert: str | None = None  # PEM certificate chain: the front serves HTTPS (relative: from the plan's folder)
    tls_key: str | None = None  # its PEM private key (readable by its owner only)
    allow_plaintext: bool = False  # a non-loopback listen without TLS: keys and prompts in clear text
    metrics_prefix: Literal["kvasir", "vllm"] = "kvasir"  # /metrics names: "vllm" for vLLM's dashboards unchanged
    reasoning: Literal["none", "think"] = "none"  # "think": a chat's <think> block comes as reasoning_content


def parse_listen(listen: str) -> tuple[str, int] | None:
    """(host, port) of "HOST:PORT" (brackets taken off an IPv6 address), or None if malformed."""
    match = _LISTEN_RE.match(listen)
    if match is None or not 0 < int(match.group("port")) < 65536:
        return None
    return match.group("host").strip("[]"), int(match.group("port"))


def is_loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or re.fullmatch(r"127(\.[0-9]{1,3}){3}", host) is not None


def check_http(http: HttpSpec, max_per_client: int) -> None:
    """Model-independent checks of ``[http]`` (the key file is read when the plan is resolved);
    ``max_per_client``: the bridge's share of one client, which a front is."""
    where = parse_listen(http.listen)
    if where is None:
        raise PlanError(f"http.listen = {http.listen!r} is not an address of the form HOST:PORT (port 1-65535)")
    if http.api_keys is None and not is_loopback(where[0]):
        raise PlanError(
            f"http.listen = {http.listen!r} is reachable from other hosts: it needs http.api_keys (a file of "
            "bearer keys, one per line), or a loopback address"
        )
    if (http.tls_cert is None) != (http.tls_key is None):
        raise PlanError("http.tls_cert and http.tls_key go together: give both (HTTPS) or neither")
    if http.tls_cert is None and not is_loopback(where[0]) and not http.allow_plaintext:
        raise PlanError(
            f"http.listen = {http.listen!r} is reachable from other hosts: serve it over TLS (http.tls_cert and "
            "http.tls_key), or set http.allow_plaintext = true to let keys and prompts cross the network in clear text"
        )
    positive("http.workers", http.workers)
    if http.workers > MAX_WORKERS:
        raise PlanError(f"http.workers = {http.workers} is more than {MAX_WORKERS} front processes")
    if http.model_name is not None and not model_name_ok(http.model_name):
        raise PlanError(
            f"http.model_name = {http.model_name!r} must be 1-256 printable characters without spaces or quotes"
        )
    _check_limits(http, max_per_client)


def _check_limits(http: HttpSpec, max_per_client: int) -> None:
    for name in ("max_connections", "max_choices", "max_per_caller", "max_tokens"):
        if getattr(http, name) is not None:
            positive(f"http.{name}", getattr(http, name))
    for name in ("header_timeout_s", "idle_timeout_s", "body_timeout_s", "write_timeout_s"):
        seconds = getattr(http, name)
        if not 0 < seconds <= MAX_TIMEOUT_S:
            raise PlanError(f"http.{name} = {seconds!r} must be in (0, {MAX_TIMEOUT_S:g}] seconds")
    if http.max_connections > MAX_CONNECTIONS:
        raise PlanError(f"http.max_connections = {http.max_connections} is more than {MAX_CONNECTIONS} per front")
    choices, per_caller = shares(http, max_per_client)
    if choices > MAX_FANOUT:
        raise PlanError(f"http.max_choices = {choices} is more than {MAX_FANOUT}")
    if not choices <= per_caller <= max_per_client:
        raise PlanError(
            f"http.max_choices = {choices} <= http.max_per_caller = {per_caller} <= "
            f"bridge.max_per_client = {max_per_client} does not hold: one request may not take more than a "
            "caller's share, nor one caller more than the front's"
        )


def shares(http: HttpSpec, max_per_client: int) -> tuple[int, int]:
    """``(max_choices, max_per_caller)`` in force: each as set, or its default within the
    share above it (a caller's within the front's, a request's within its caller's)."""
    per_caller = http.max_per_caller if http.max_per_caller is not None else min(DEFAULT_PER_CALLER, max_per_client)
    choices = http.max_choices if http.max_choices is not None else min(DEFAULT_CHOICES, per_caller)
    return choices, per_caller


def model_name_ok(name: str) -> bool:
    return 0 < len(name) <= 256 and name.isprintable() and not any(c in name for c in " \"'\\")


def default_model_name(source: str) -> str:
    """The id a plan without ``http.model_name`` serves under: the alias, or the file or
    folder name of a path (without .gguf)."""
    name = Path(source.rstrip("/")).name.removesuffix(".gguf") or "model"
    return name if model_name_ok(name) else "model"


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The front's TLS server context (TLS 1.2 at least) from PEM files; PlanError naming
    the plan key when a file is missing, open to others or does not load."""
    try:
        check_private(key)
    except KeyFileError as exc:
        raise PlanError(f"http.tls_key: {exc}") from None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise PlanError(f"http.tls_cert / http.tls_key: file not found: {exc.filename}") from None
    except (ssl.SSLError, OSError) as exc:
        raise PlanError(f"http.tls_cert / http.tls_key: cannot load {cert} with {key}: {exc}") from None
    return context


def read_api_keys(path: Path) -> frozenset[str]:
    """The bearer keys in ``path`` (one per line; blank lines and lines starting with #
    skipped; the file readable by its owner only)."""
    try:
        check_private(path)
    except KeyFileError as exc:
        raise PlanError(f"http.api_keys: {exc}") from None
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
