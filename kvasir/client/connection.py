"""Where a client connects: the runtime dir's socket, or a TCP endpoint with CURVE keys;
the errors a connection attempt raises and what it did, in words."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq

from kvasir.config.keys import load_pair, load_public
from kvasir.errors import KvasirError
from kvasir.transport.channels import Endpoints
from kvasir.transport.rundir import check_client_dir

CLOSE_LINGER_MS = 200  # how long closing waits for messages queued just before it to leave
REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
LINK: dict[int, str] = {  # what a connection attempt did, for NoDaemon's message
    zmq.EVENT_CONNECT_RETRIED: "nothing accepted the connection",
    zmq.EVENT_CONNECTED: "a connection was made, but no answer came",
}


class NoDaemon(KvasirError):
    """Nothing answers at the runtime directory."""


class NotAuthorised(KvasirError):
    """The daemon's TCP endpoint refused this client (no key, or a key it does not allow)."""


@dataclass(frozen=True)
class Remote:
    """A daemon's TCP endpoint; with CURVE, this client's key pair and the daemon's public key."""

    endpoint: str  # "tcp://HOST:PORT"
    client_key: Path | None = None  # this client's .key_secret file
    server_key: Path | None = None  # the daemon's public key file (server.key)

    def configure(self, sock) -> None:
        if (self.client_key is None) != (self.server_key is None):
            raise KvasirError("a CURVE connection needs both the client's key pair and the server's public key")
        if self.client_key is not None and self.server_key is not None:
            public, secret = load_pair(self.client_key)
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.curve_serverkey = load_public(self.server_key)


def check_local(rt: Path, ends: Endpoints) -> None:
    """A runtime dir that is safe to send prompts to and has a daemon's socket in it."""
    try:
        check_client_dir(rt)
    except FileNotFoundError:
        raise NoDaemon(f"no kvasird is running at runtime dir {rt} (no such directory)") from None
    if not ends.client_path.exists():
        raise NoDaemon(f"no kvasird is running at runtime dir {rt} (no {ends.client_path.name})")
