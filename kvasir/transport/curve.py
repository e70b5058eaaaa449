"""CURVE on the internal sockets of a plan that spans hosts.

Every host has a key pair (``kvasir keys generate DIR --host NAME``); the plan's
``cluster.keys`` folder holds every host's public key, and each host keeps its own secret
file. A socket bound on a host is a CURVE server with that host's pair and lets in only
the plan's hosts (a ZAP handler per ZMQ context, on its own domain so that the bridge's
client allow-list is not mixed with the hosts'); the workers' and the bridge's command
sockets, which only the leader's launcher sends to, let in the leader's key alone (a
follower's key cannot drain or stop the bridge or another host's workers). A socket
connecting to another host's socket is a CURVE client that checks the owner's public
key. No internal TCP socket is ever plaintext: ``Fabric.secure`` refuses a TCP endpoint
it has no keys for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvasir.config.keys import KeyFileError, load_pair, load_public
from kvasir.errors import KvasirError
from kvasir.transport.routes import COMMAND_PREFIX, Routes

HOSTS_DOMAIN = "kvasir-hosts"  # the ZAP domain of the internal sockets
LEADER_DOMAIN = "kvasir-leader"  # of the command sockets: the leader's key only


class FabricError(KvasirError):
    """An internal TCP socket without keys, or a host key that does not load."""


@dataclass(frozen=True)
class HostKeys:
    """This host's CURVE pair and every host's public key (z85), by host name."""

    host: str
    public: bytes
    secret: bytes
    hosts: Mapping[str, bytes]

    @classmethod
    def load(
        cls, folder: str | Path, host: str, hosts: Iterable[str], secret_file: str | Path | None = None
    ) -> HostKeys:
        """``secret_file``: this host's pair (default ``folder/HOST.key_secret``)."""
        folder = Path(folder)
        try:
            public, secret = load_pair(secret_file or folder / f"{host}.key_secret")
            known = {name: load_public(folder / f"{name}.key") for name in hosts}
        except KeyFileError as exc:
            raise FabricError(f"host keys: {exc}") from None
        if known.get(host) != public:
            raise FabricError(f"host {host}'s secret key does not match {folder / (host + '.key')}")
        return cls(host, public, secret, known)


class AllowList:
    """A ZAP credentials provider: these public keys (z85) on this domain, nothing else.
    (Once one domain of a ZAP handler has a provider, every domain needs one: the handler
    then no longer reads certificate folders.)"""

    def __init__(self, keys: Iterable[bytes], domain: str = HOSTS_DOMAIN) -> None:
        self.keys = frozenset(keys)
        self.domain = domain

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == self.domain and key in self.keys


class Fabric:
    """One process's view of the hosts: who binds each TCP endpoint it connects to, and
    the keys its TCP sockets authenticate with."""

    def __init__(self, owners: Mapping[str, str], keys: HostKeys, leader: str, commands: frozenset[str]) -> None:
        """``owners``: each TCP endpoint this process may connect to, and the host that binds
        it; ``commands``: the endpoints only the ``leader`` host may connect to."""
        self.keys = keys
        self._owners = dict(owners)
        self.leader = leader
        self._commands = commands

    @classmethod
    def of(cls, routes: Routes, keys: HostKeys) -> Fabric:
        """The fabric of a plan's internal sockets."""
        owners = {routes.endpoint(name): routes.owner(name) for name in routes.names()}
        commands = frozenset(routes.endpoint(name) for name in routes.names() if name.startswith(COMMAND_PREFIX))
        return cls(owners, keys, routes.owner("control"), commands)

    def authenticator(self, ctx: zmq.Context) -> ThreadAuthenticator:
        """Start the context's ZAP handler for the hosts' domain (stop it before the context)."""
        auth = ThreadAuthenticator(ctx)
        auth.start()
        self.allow(auth)
        return auth

    def allow(self, auth) -> None:
        """Let the hosts' keys in on ``auth``'s hosts domain, and the leader's alone on its
        commands domain (a ZAP handler of any kind)."""
        auth.configure_curve_callback(domain=HOSTS_DOMAIN, credentials_provider=AllowList(self.keys.hosts.values()))
        leader = AllowList([self.keys.hosts[self.leader]], LEADER_DOMAIN)
        auth.configure_curve_callback(domain=LEADER_DOMAIN, credentials_provider=leader)

    def secure(self, sock: zmq.Socket, *, bind: str | None = None, connect: str | None = None) -> None:
        """Set CURVE on ``sock`` for the TCP endpoint it is about to bind or connect."""
        sock.curve_publickey, sock.curve_secretkey = self.keys.public, self.keys.secret
        if bind is not None:
            sock.curve_server = True
            sock.zap_domain = (LEADER_DOMAIN if bind in self._commands else HOSTS_DOMAIN).encode()
            return
        owner = self._owners.get(connect or "")
        if owner is None:
            raise FabricError(f"{connect} is not a socket of this plan's hosts")
        sock.curve_serverkey = self.keys.hosts[owner]


def end_context(ctx: zmq.Context, sockets: Iterable[zmq.Socket], auth: ThreadAuthenticator | None) -> None:
    """Close ``sockets``, then stop the ZAP handler, then end the context: in the other
    order a handshake still waiting for ZAP, or the handler's own socket closed from this
    thread, can hold up the context's end for good."""
    for sock in sockets:
        sock.close(linger=0)
    if auth is not None:
        auth.stop()
    ctx.destroy(linger=0)
