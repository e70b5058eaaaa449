"""CURVE key pairs for Kvasir's TCP endpoints.

``kvasir keys generate DIR`` writes ZeroMQ certificate files (the format czmq and pyzmq
share): ``NAME.key`` holds a public key, ``NAME.key_secret`` the pair (mode 0600). The
daemon's pair is ``server``; each client's public key is also copied into
``DIR/clients/``, the folder a plan names as ``bridge.client_keys`` (the allow-list).
``--host NAME`` makes a host's pair for a plan with several hosts: the folder a plan
names as ``cluster.keys`` holds every host's public key.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import zmq.auth

from kvasir.config.private import KeyFileError, check_private

SERVER = "server"
ALLOWED = "clients"


def generate(folder: Path, clients: Sequence[str], hosts: Sequence[str] = ()) -> list[Path]:
    """Make the server pair (unless it exists or only hosts are asked for), one pair per
    client name and one per host name; the files made.

    Never overwrites: an existing client or host pair of the same name is an error."""
    for kind, names in (("client", clients), ("host", hosts)):
        for name in names:
            if not name or "/" in name or name.startswith(".") or name in (SERVER, ALLOWED):
                raise KeyFileError(f"{name!r} cannot name a {kind} key (use letters, digits, '-' or '_')")
            if (folder / f"{name}.key").exists() or (folder / f"{name}.key_secret").exists():
                raise KeyFileError(f"{folder / name}.key already exists: remove it first or choose another name")
    if len(set(clients) | set(hosts)) < len(clients) + len(hosts):
        raise KeyFileError("a name is given twice: each key pair needs its own name")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    server = [] if (folder / f"{SERVER}.key_secret").exists() or not clients else [SERVER]
    allowed = folder / ALLOWED
    if clients:
        allowed.mkdir(mode=0o700, exist_ok=True)
    made: list[Path] = []
    umask = os.umask(0o077)  # no moment where a secret key is readable by others
    try:
        for name in [*server, *clients, *hosts]:
            public, secret = (Path(p) for p in zmq.auth.create_certificates(folder, name))
            os.chmod(public, 0o644)
            made += [public, secret]
            if name in clients:
                shutil.copyfile(public, allowed / public.name)
                made.append(allowed / public.name)
    finally:
        os.umask(umask)
    return made


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError:
        raise KeyFileError(f"key file not found: {path}") from None
    except ValueError:
        raise KeyFileError(f"{path} is not a CURVE key file (make one with `kvasir keys generate`)") from None
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise KeyFileError(f"{path} holds a malformed CURVE key (expected 40 Z85 characters)")
    return public, secret


def load_pair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file (readable by its owner only)."""
    public, secret = _load(path)
    if secret is None:
        raise KeyFileError(f"{path} holds only a public key: give the .key_secret file")
    check_private(path)
    return public, secret


def load_public(path: str | Path) -> bytes:
    return _load(path)[0]


def allowed_keys(folder: str | Path) -> list[bytes]:
    """The public keys in an allow-list folder (every ``*.key`` file); at least one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KeyFileError(f"client key folder not found: {folder}")
    keys = [load_public(path) for path in sorted(folder.glob("*.key"))]
    if not keys:
        raise KeyFileError(f"{folder} holds no client public keys (*.key): nobody could connect")
    return keys
