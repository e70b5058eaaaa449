"""Struct bases of every wire message, and the size limit shared by requests and submissions."""

from __future__ import annotations

import msgspec

MAX_STOP_TOKEN_IDS = 256  # stop token ids of one request


class Wire(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    pass


class Tagged(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag=True):
    pass
