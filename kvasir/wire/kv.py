"""KV hand-off to a decode stage (``KvMessage``): where a handed-off request's K/V lies and
where the decode head placed it; between hosts, the K/V itself (``KvChunk``)."""

from __future__ import annotations

from kvasir.wire.base import Tagged


# -- KV hand-off to a decode stage ----------------------------------------------------------------
class KvReady(Tagged, frozen=True):
    """Prefill stage -> decode stage: a request's prompt KV for ``layers`` sits in the
    prefill stage's cache segment at ``blocks`` (held there until the decode head adopts it)."""

    request_id: int
    source: int  # global index of the prefill stage (which cache segment to read)
    layers: tuple[int, int]  # the prefill stage's layers
    blocks: tuple[int, ...]  # the request's block table in the prefill pool
    num_tokens: int  # positions [0, num_tokens) hold K/V
    sent_ns: int


class Placement(Tagged, frozen=True):
    """Decode head -> decode stage: the request's decode blocks (copy its parts there once
    they are all announced); no blocks = forget the request's parts and table."""

    request_id: int
    blocks: tuple[int, ...]
    prefill_head: int = 0  # the prefill instance whose stages announce its parts (their head's index)


class KvChunk(Tagged, frozen=True):
    """Prefill stage -> decode stage on another host: K/V rows of a request, positions
    [start, start + num_tokens) of layers ``layers`` (the layers the two stages share),
    followed by two frames: the keys, then the values, each [layers, tokens, kv heads,
    head dim] in the cache's dtype. The stage's ``KvReady`` follows its last chunk."""

    request_id: int
    source: int  # global index of the prefill stage
    layers: tuple[int, int]
    start: int
    num_tokens: int
    total: int  # the request's prompt positions (its KvReady's num_tokens)


KvMessage = KvReady | Placement | KvChunk
