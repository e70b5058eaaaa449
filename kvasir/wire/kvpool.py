"""Between the stages of two hosts (a plan across hosts with a KV pool): a stage asks a
stage of the same layers on another host for a prefix block's stored slice
(kvasir/stage/pool_peers.py). The reply is a ``SliceGot`` and, when found, the slice's
stored bytes (kvasir/kvpool/slices.py) in the next frame; the asker checks them as it
checks its own tiers' files."""

from __future__ import annotations

from kvasir.wire.base import Tagged
from kvasir.wire.batch import BlockKey


class SliceWant(Tagged, frozen=True):
    key: BlockKey
    layers: tuple[int, int]  # the asker's layers: the server's own, or nothing is found


class SliceGot(Tagged, frozen=True):
    key: BlockKey
    found: bool  # its stored bytes follow in the next frame
