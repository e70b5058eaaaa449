"""CURVE key pairs for Kvasir's TCP endpoints.

``kvasir keys generate DIR`` writes ZeroMQ certificate files (the format czmq and pyzmq
share): ``NAME.key`` holds a public key, ``NAME.key_secret`` the pair (mode 0600). The
daemon's pair is ``server``; each client's public key is also copied into
``DIR/clients/``, the folder a plan names as ``bridge.client_keys`` (the allow-list).
``--host NAME`` makes a host's pair for a plan with several hosts: the folder a plan
names as ``cluster.keys`` holds every host's public key, and the fleet's KV pool secret
(``kvpool.secret``, mode 0600: the key of every stored slice's checksum, the same on
every host, since a slice read from another host is checked where it lands).
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

import zmq.auth

from kvasir.config.private import KeyFileError, check_private

SERVER = "server"
ALLOWED = "clients"
POOL_SECRET = "kvpool.secret"
SECRET_TEXT = 65  # 32 bytes as 64 hex digits and a newline


def generate(folder: Path, clients: Sequence[str], hosts: Sequence[str] = (), pool_secret: bool = False) -> list[Path]:
    """Make the server pair (unless it exists or only hosts are asked for), one pair per
    client name and one per host name, and with hosts (or ``pool_secret``) the fleet's KV
    pool secret unless it exists; the files made.

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
    if (hosts or pool_secret) and not (folder / POOL_SECRET).exists():
        made.append(make_pool_secret(folder / POOL_SECRET))
    return made


def make_pool_secret(path: Path) -> Path:
    """A new pool secret at ``path`` (0600, never over an existing file or through a symlink)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, new_secret_text())
    finally:
        os.close(fd)
    return path


def read_pool_secret(path: str | Path) -> bytes:
    """The 32 bytes of a pool secret file: this user's, open to nobody else, as made by
    ``make_pool_secret`` (KeyFileError naming what is wrong otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(
            f"the KV pool secret {path} cannot be read ({exc.strerror}): make it with "
            f"`kvasir keys generate {Path(path).parent} --pool-secret` and copy it to every host"
        ) from None
    try:
        info = os.fstat(fd)
        text = os.read(fd, SECRET_TEXT + 1)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise KeyFileError(f"{path} holds a secret and must be this user's file, mode 0600 (chmod 600 {path})")
    return parse_secret(text, path)


def new_secret_text() -> bytes:
    """A new pool secret as stored: 32 random bytes in hex, and a newline."""
    return (secrets.token_hex(32) + "\n").encode()


def parse_secret(text: bytes, where: str | Path) -> bytes:
    """The 32 bytes of a pool secret's stored text (KeyFileError if it is not one)."""
    try:
        if len(text) != SECRET_TEXT or text[-1:] != b"\n":
            raise ValueError
        return bytes.fromhex(text[:-1].decode("ascii"))
    except ValueError:
        raise KeyFileError(f"{where} is not a KV pool secret (64 hex digits and a newline)") from None


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
