"""Decoding hostile bytes: every failure msgspec can raise is one ``Malformed``, and no
module of the package decodes socket bytes with msgspec's decoders directly."""

from __future__ import annotations

import re

import msgspec
import pytest

from kvasir.transport import envelopes
from kvasir.wire.bridge import BridgeMessage
from kvasir.wire.client import ClientMessage, Submit
from kvasir.wire.decoding import Decoder, JsonDecoder, Malformed, decode
from tests.support.tree import lines_matching

DIRECT = re.compile(r"msgspec\.(msgpack|json)\.(Decoder\s*\(|decode\s*\()")

NESTED = b"\x91" * 1000 + b"\xc0"  # about 1 KB: [[[...[nil]...]]]
NESTED_FIELD = b"\x82\xa4type\xa6submit\xa3key" + NESTED  # {"type": "submit", "key": [[[...]]]}
NESTED_SKIPPED = b"\x82\xa4type\xa6submit\xa9__other__" + NESTED  # a field the envelope skips


@pytest.mark.parametrize("body", [NESTED, NESTED_FIELD, NESTED_SKIPPED, b"\x91" * 100_000 + b"\xc0"])
@pytest.mark.parametrize("message_type", [ClientMessage, BridgeMessage, list[msgspec.Raw], dict])
def test_deep_nesting_is_malformed_not_a_recursion_error(body, message_type):
    with pytest.raises(Malformed):
        Decoder(message_type).decode(body)


def test_what_msgspec_itself_raises_on_those_bodies_is_not_only_decode_errors():
    """The reason for the wrapper: without it, a receiver catching DecodeError dies."""
    with pytest.raises(RecursionError):
        msgspec.msgpack.Decoder(list[msgspec.Raw]).decode(NESTED)


def test_a_nested_batch_is_a_batch_error_and_a_good_one_still_splits():
    with pytest.raises(envelopes.BatchError, match="nested too deeply"):
        envelopes.members(NESTED)
    one = msgspec.msgpack.encode(Submit(key=1, token_ids=[1, 2]))
    assert envelopes.members(envelopes.join([one, one])) == [one, one]


def test_a_good_message_still_decodes():
    body = msgspec.msgpack.encode(Submit(key=7, token_ids=[1, 2]))
    assert decode(body, Submit) == Submit(key=7, token_ids=[1, 2])
    assert Decoder(ClientMessage).decode(body) == Submit(key=7, token_ids=[1, 2])


class Body(msgspec.Struct):
    x: int = 0


def test_json_nesting_is_malformed_and_type_errors_keep_their_detail():
    decoder = JsonDecoder(Body)
    with pytest.raises(Malformed, match="nested too deeply"):
        decoder.decode(b'{"unknown": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")  # skipped, yet walked
    with pytest.raises(msgspec.ValidationError, match=r"\$\.x"):
        decoder.decode(b'{"x": "text"}')


def test_no_module_decodes_with_msgspec_directly():
    found = lines_matching(DIRECT, skip=("decoding.py",))
    assert not found, "\n".join(found)
    assert DIRECT.search("x = msgspec.msgpack.Decoder(Submit)") and DIRECT.search("msgspec.json.decode(b, type=T)")
