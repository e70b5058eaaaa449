"""The KV hand-off between hosts: a prefill stage streams a request's K/V for the layers
it shares with a decode stage on another host (``KvStream``), in chunks of about
``CHUNK_BYTES`` that are each a descriptor plus the keys and values as two frames; at
most ``WINDOW`` chunks wait in the socket for one decode stage (a send past that waits,
which is the bounded window: the prefill stage goes no faster than the link). The
decode stage's inbox (``KvInbox``) checks every chunk against its own cache geometry and
assembles it (``Assembly``) until the decode head has placed the request; from there on
the copy into its blocks is the one shared memory uses.

A chunk that does not fit (frames missing, sizes or positions that do not match) can
only come from a bug or a hostile peer (CURVE lets in only the plan's hosts): it raises
``EdgeError``, a worker failure that supervision handles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from kvasir.errors import KvasirError
from kvasir.model.kv_cache import PagedKVCache, flat_slots
from kvasir.ring.slots import received
from kvasir.ring.tcp_slots import EdgeError
from kvasir.transport.channels import PullChannel
from kvasir.units import MIB
from kvasir.wire.kv import KvChunk, KvReady

CHUNK_BYTES = 1 * MIB  # keys and values of one chunk, about
WINDOW = 8  # chunks queued for one decode stage before a send waits


def _frame(tensor: torch.Tensor) -> memoryview:
    array: Any = tensor.contiguous().cpu().view(torch.uint8).numpy()
    return memoryview(array).cast("B")


class KvStream:
    """A prefill stage's sends to one decode stage on another host."""

    def __init__(self, sock: zmq.Socket, cache: PagedKVCache, mine: tuple[int, int], span: tuple[int, int]) -> None:
        """``mine``: the prefill stage's layers; ``span``: those it shares with the decode stage."""
        sock.setsockopt(zmq.SNDHWM, WINDOW)
        self.socket = sock
        self.cache = cache
        self.mine = mine
        self.span = span
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, ready: KvReady) -> int:
        """The request's K/V, chunk by chunk, then its announcement; bytes sent."""
        lo, hi = self.span
        layers = slice(lo - self.mine[0], hi - self.mine[0])
        keys, values = self.cache.keys, self.cache.values
        slots = flat_slots(ready.request_id, ready.blocks, self.cache.block_size, 0, ready.num_tokens)
        per_token = 2 * (hi - lo) * keys.shape[2] * keys.shape[3] * keys.element_size()
        step = max(1, CHUNK_BYTES // per_token)
        for start in range(0, ready.num_tokens, step):
            index = slots[start : start + step].to(keys.device)
            chunk = KvChunk(ready.request_id, ready.source, self.span, start, len(index), ready.num_tokens)
            frames: list[Any] = [
                self._encoder.encode(chunk),
                _frame(keys[layers, index]),
                _frame(values[layers, index]),
            ]
            self.socket.send_multipart(frames, copy=False)
        self.socket.send(self._encoder.encode(msgspec.structs.replace(ready, blocks=())))
        return per_token * ready.num_tokens


@dataclass
class Assembly:
    """One prefill stage's share of a request, as its chunks arrive."""

    keys: torch.Tensor  # [layers, tokens, kv heads, head dim], on the CPU
    values: torch.Tensor
    received: int = 0  # positions filled
    started: float = field(default_factory=time.monotonic)  # its first chunk (a partial one expires)


class KvInbox:
    """A decode stage's KV inbox: single-frame KV messages (the decode head's placements,
    announcements from prefill stages on this host), and chunks from other hosts, which
    it checks and assembles."""

    def __init__(self, channel: PullChannel, cache: PagedKVCache, max_tokens: int) -> None:
        """``channel``: a PullChannel of KvMessage (it drops and counts what does not decode);
        ``max_tokens``: a request's positions at most (model.max_seq_len): a chunk claiming
        more is refused before anything is allocated for it."""
        self.channel = channel
        self.socket = channel.socket
        self.cache = cache
        self.max_tokens = max_tokens

    def drain(self) -> list:
        """Messages waiting: KvReady and Placement as they are, each KvChunk as
        ``(chunk, keys, values)`` with its frames checked and viewed as tensors."""
        out: list = []
        for message, frames in self.channel.drain_framed():
            if isinstance(message, KvChunk):
                out.append((message, *self._tensors(message, frames)))
            elif frames:
                self.channel.drop(f"a {type(message).__name__} came with {len(frames)} extra frames")
            else:
                out.append(message)
        return out

    def _tensors(self, chunk: KvChunk, frames: list[zmq.Frame]) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.cache.keys
        shape = (chunk.layers[1] - chunk.layers[0], chunk.num_tokens, keys.shape[2], keys.shape[3])
        nbytes = shape[0] * shape[1] * shape[2] * shape[3] * keys.element_size()
        if len(frames) != 2 or any(frame.buffer.nbytes != nbytes for frame in frames):
            sizes = [frame.buffer.nbytes for frame in frames]
            raise EdgeError(
                f"KV chunk of request {chunk.request_id}: frames of {sizes} bytes, expected two of {nbytes}"
            )
        if (
            not 0 < shape[0] <= keys.shape[0]
            or chunk.num_tokens <= 0
            or not 0 <= chunk.start < chunk.start + chunk.num_tokens <= chunk.total <= self.max_tokens
        ):
            raise EdgeError(f"KV chunk of request {chunk.request_id}: positions or layers that do not fit")
        k, v = (received(frame.buffer).view(keys.dtype).view(shape) for frame in frames)
        return k, v


def assemble(parts: dict[int, Assembly], chunk: KvChunk, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Put one chunk in its place in the request's assembly from ``chunk.source``."""
    assembly = parts.get(chunk.source)
    if assembly is None:
        shape = (keys.shape[0], chunk.total, keys.shape[2], keys.shape[3])
        assembly = parts[chunk.source] = Assembly(
            torch.empty(shape, dtype=keys.dtype), torch.empty(shape, dtype=keys.dtype)
        )
    if assembly.keys.shape[:2] != (keys.shape[0], chunk.total) or chunk.start != assembly.received:
        raise EdgeError(f"KV chunk of request {chunk.request_id} from stage {chunk.source} out of order")
    stop = chunk.start + chunk.num_tokens
    assembly.keys[:, chunk.start : stop] = keys
    assembly.values[:, chunk.start : stop] = values
    assembly.received = stop


def check_complete(assembly: Assembly | None, ready: KvReady) -> Assembly:
    if assembly is None or assembly.received != ready.num_tokens or assembly.keys.shape[1] != ready.num_tokens:
        raise KvasirError(f"KV of request {ready.request_id} from stage {ready.source} announced before all its chunks")
    return assembly
