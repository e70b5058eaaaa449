"""Hostile input, generated: the client protocol and plan files.

The client protocol gets over 10,000 messages per run — random bytes, truncated and
oversized frames, extra frames, wrong types and valid envelopes with invalid values,
each generated message followed by nine seeded mutations of it (cut, flipped, grown,
doubled, spliced with the one before) — after which the daemon still serves a normal
request correctly.
"""

from __future__ import annotations

import random
import time

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir.client import Client
from kvasir.config.plan import parse_plan
from kvasir.errors import PlanError
from tests.support.models import hf_greedy, reference_model

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8,
)
FIELDS = [
    "type",
    "key",
    "prompt",
    "token_ids",
    "chat",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "request_id",
    "timeline",
]
envelopes = st.fixed_dictionaries(
    {"type": st.sampled_from(["submit", "cancel", "stats", "token", "bogus"])},
    optional={name: values for name in FIELDS[1:]},
)
# a submit that decodes but carries bad values
bad_submits = st.fixed_dictionaries(
    {
        "type": st.just("submit"),
        "key": st.integers(0, 2**40),
        "token_ids": st.lists(st.integers(-5, 2**40), max_size=6),
        "max_tokens": st.integers(-3, 3),
        "temperature": st.one_of(st.floats(-2, 5), st.just(float("nan"))),
        "top_p": st.one_of(st.floats(-1, 2), st.just(float("inf"))),
        "top_k": st.integers(-3, 3),
    }
)
frames = st.one_of(
    st.binary(max_size=64),  # random bytes and truncations
    envelopes.map(msgspec.msgpack.encode),
    bad_submits.map(msgspec.msgpack.encode),
    envelopes.map(lambda e: msgspec.msgpack.encode(e)[: max(1, len(msgspec.msgpack.encode(e)) // 2)]),
)
messages = st.lists(frames, min_size=1, max_size=3)  # more than one frame is itself malformed
MUTANTS = 9  # seeded mutations sent after each generated message: most of the volume, at little cost


def mutate(rng: random.Random, parts: list[bytes], before: list[bytes]) -> list[bytes]:
    """One mutation of a message: a frame cut, flipped, grown or doubled, or spliced with
    the message sent before it."""
    parts = list(parts)
    index = rng.randrange(len(parts))
    frame = bytearray(parts[index])
    match rng.randrange(5):
        case 0:
            frame = frame[: rng.randrange(len(frame) + 1)]
        case 1:
            for _ in range(rng.randint(1, 3)):
                if frame:
                    frame[rng.randrange(len(frame))] = rng.randrange(256)
        case 2:
            frame += rng.randbytes(rng.randint(1, 16))
        case 3:
            parts.append(bytes(frame))
        case 4:
            frame = frame[: rng.randrange(len(frame) + 1)] + before[0][rng.randrange(len(before[0]) + 1) :]
    parts[index] = bytes(frame) or b"\x00"
    return parts


def test_client_protocol_fuzz_then_a_normal_request(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], max_waiting=100000).wait_ready()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(f"ipc://{daemon.runtime_dir / 'client.sock'}")
    sent = [0]
    rng = random.Random(1234)
    before = [[b"\x80"]]  # the message sent last (an empty msgpack map to begin with)

    # hypothesis's own cost per example is most of this test's time: each example is
    # sent with MUTANTS seeded mutations of it
    @settings(max_examples=1_050, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(messages)
    def send(parts):
        for message in [parts] + [mutate(rng, parts, before[0]) for _ in range(MUTANTS)]:
            sock.send_multipart(message)
            sent[0] += 1
        before[0] = parts

    try:
        send()
        # an oversized frame (past the bridge's 16 MiB limit) costs only that connection
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(f"ipc://{daemon.runtime_dir / 'client.sock'}")
        big.send(b"\x00" * (17 * 1024 * 1024))
        time.sleep(0.5)
        big.close()
        assert sent[0] >= 10_000
        assert daemon.process.poll() is None, daemon.log()
        with Client(daemon.runtime_dir) as client:
            final = client.generate(token_ids=[4, 8, 15], max_tokens=5, temperature=0)
        assert final.token_ids == hf_greedy(reference_model(tiny_models["llama"]), [4, 8, 15], 5)
    finally:
        sock.close()
        ctx.term()


@settings(max_examples=1500, deadline=None, database=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300)))
def test_fuzzed_plan_text_is_refused_cleanly_or_accepted(raw):
    try:
        parse_plan(raw)
    except PlanError as exc:
        assert str(exc) and "\n" not in str(exc)


sections = st.dictionaries(
    st.sampled_from(["model", "batch", "kv", "bridge", "extra"]),
    st.dictionaries(
        st.sampled_from(
            [
                "source",
                "dtype",
                "max_seq_len",
                "max_rows",
                "max_tokens",
                "inflight",
                "block_size",
                "num_blocks",
                "max_waiting",
                "x",
            ]
        ),
        st.one_of(st.integers(-5, 5000), st.text(max_size=8), st.booleans(), st.lists(st.integers(-2, 40), max_size=3)),
        max_size=4,
    ),
    max_size=4,
)
stage_lists = st.lists(
    st.fixed_dictionaries(
        {"layers": st.lists(st.integers(-2, 40), max_size=3)},
        optional={
            "device": st.sampled_from(["cpu", "cuda:0", "tpu", ""]),
            "threads": st.integers(-1, 4),
            "cpus": st.lists(st.integers(-1, 3), max_size=3),
        },
    ),
    max_size=4,
)


@settings(max_examples=1500, deadline=None, database=None)
@given(sections, stage_lists)
def test_fuzzed_plan_structures_are_refused_cleanly_or_accepted(body, stages):
    raw = _toml(body, stages)
    try:
        parse_plan(raw)
    except PlanError as exc:
        assert str(exc) and "\n" not in str(exc)


def _toml(body: dict, stages: list) -> str:
    import json

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    lines = []
    for name, table in body.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {value(v)}" for k, v in table.items()]
    for stage in stages:
        lines.append("[[stages]]")
        lines += [f"{k} = {value(v)}" for k, v in stage.items()]
    return "\n".join(lines)
