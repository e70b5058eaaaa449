"""The bridge's client-facing ROUTER sockets: the local one and the TCP one (CURVE)."""

from __future__ import annotations

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.certs import load_certificates

from kvasir.bridge.outbox import ZMQ_QUEUE
from kvasir.config.keys import load_pair
from kvasir.config.sections import BridgeSpec
from kvasir.transport.channels import BatchedSocket, make_socket
from kvasir.transport.curve import AllowList
from kvasir.units import MIB

MAX_CLIENT_MESSAGE = 16 * MIB  # a client sending more is disconnected by ZMQ


def client_router(ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    """A ROUTER for clients. A plain ROUTER silently drops events for a client whose
    queue is full or that is gone; with ROUTER_MANDATORY the send fails instead, and
    the bridge cancels that client's requests (see kvasir/bridge/outbox.py), so no event
    is lost unnoticed and no queue grows without bound."""
    sock = make_socket(ctx, zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_MESSAGE)
    sock.setsockopt(zmq.SNDHWM, ZMQ_QUEUE)  # the rest waits in the outbox, counted in bytes
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def remote_router(ctx: zmq.asyncio.Context, spec: BridgeSpec) -> tuple[BatchedSocket, AsyncioAuthenticator | None]:
    """The ROUTER for remote clients over TCP (bound later, on "serve"). With keys it is a
    CURVE server, and the returned ZAP authenticator (stop it with the context) lets in
    only the clients whose public keys are in ``client_keys``."""
    sock = client_router(ctx)
    authenticator = None
    if spec.server_key is not None and spec.client_keys is not None:  # the plan gives both or neither
        authenticator = AsyncioAuthenticator(ctx)
        authenticator.start()
        clients = AllowList(load_certificates(spec.client_keys), domain="*")  # a callback: see AllowList
        authenticator.configure_curve_callback(domain="*", credentials_provider=clients)
        sock.curve_publickey, sock.curve_secretkey = load_pair(spec.server_key)
        sock.curve_server = True
    return BatchedSocket(sock), authenticator
