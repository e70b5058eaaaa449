"""Client library: talk to a running kvasird over its ZMQ endpoints.

Submission is pipelined: ``submit`` sends and returns at once (no round trip), so one
client can submit thousands of requests a second; a background reader routes each
event to its request's stream. An error in the reader reaches every waiting caller.

    async with await AsyncClient.connect() as client:
        stream = await client.submit("Hello", max_tokens=16)
        async for event in stream:
            ...
"""

from kvasir.client.async_client import AsyncClient
from kvasir.client.connection import NoDaemon, NotAuthorised, Remote
from kvasir.client.stream import RequestStream
from kvasir.client.sync import Client
from kvasir.transport.rundir import RuntimeDirError

__all__ = ["AsyncClient", "Client", "NoDaemon", "NotAuthorised", "Remote", "RequestStream", "RuntimeDirError"]
