"""Bad input, overload and cancellation against a real daemon: it keeps serving everyone."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time

import msgspec
import zmq
import zmq.asyncio

from kvasir.client import AsyncClient
from kvasir.transport.channels import Endpoints
from kvasir.wire.client import Accepted, Cancelled, ClientEvent, ErrorEvent, Finished, TokenOut
from tests.support.daemon import BIN, alive, write_plan
from tests.support.models import hf_greedy, reference_model
from tests.support.wire import events


async def raw_exchange(runtime_dir, frames_list):
    """Send raw frames on a DEALER and collect the events of one reply per message."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(Endpoints(runtime_dir).client)
    decoder = msgspec.msgpack.Decoder(ClientEvent)
    replies = []
    try:
        for frames in frames_list:
            await sock.send_multipart(frames)
            replies.extend(events(decoder, await asyncio.wait_for(sock.recv(), 10)))
    finally:
        sock.close()
        ctx.term()
    return replies


def enc(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


MALFORMED = [
    [b"\xc1\xff garbage"],  # not msgpack
    [b""],  # empty frame
    [enc({"type": "submit"})],  # missing key
    [enc({"type": "launch", "key": 1})],  # unknown message type
    [enc({"type": "submit", "key": 1, "token_ids": [1, 2], "colour": "red"})],  # unknown field
    [enc({"type": "submit", "key": "one", "token_ids": [1]})],  # wrong type
    [enc({"type": "cancel", "request_id": [1]})],
    [enc([1, 2, 3])],  # a batch of three messages, each malformed: three errors
    [enc([])],  # an empty batch
    [enc([{"type": "cancel", "request_id": 1}] * 1025)],  # past MAX_BATCH
    [enc([[{"type": "stats", "key": 1}]])],  # a batch inside a batch
    [enc({"type": "submit", "key": 1, "token_ids": [1]}), b"extra frame"],
]


async def mixed_batch(runtime_dir):
    """One body holding a good submission between bad ones: every member answered on
    its own; the good one runs to the end."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(Endpoints(runtime_dir).client)
    decoder = msgspec.msgpack.Decoder(ClientEvent)
    body = enc(
        [
            {"type": "submit", "key": 8, "token_ids": [1, 999]},  # outside the vocabulary
            {"type": "submit", "key": 7, "token_ids": [5, 9, 11], "max_tokens": 3, "temperature": 0.0},
            {"type": "submit", "key": 9, "colour": "red"},
        ]
    )
    got: list = []
    try:
        await sock.send(body)
        while not any(isinstance(e, Finished) for e in got):
            got.extend(events(decoder, await asyncio.wait_for(sock.recv(), 10)))
    finally:
        sock.close()
        ctx.term()
    return got


async def refusals(runtime_dir):
    async with await AsyncClient.connect(runtime_dir) as client:
        cases = {
            "empty prompt": dict(token_ids=[]),
            "out of vocab": dict(token_ids=[1, 320]),
            "negative id": dict(token_ids=[-4]),
            "too long": dict(token_ids=[7] * 64),
            "both prompt and ids": dict(prompt="hi", token_ids=[1]),
            "text without tokenizer": dict(prompt="hello"),
            "negative temperature": dict(token_ids=[1], temperature=-1.0),
            "nan temperature": dict(token_ids=[1], temperature=float("nan")),
            "top_p zero": dict(token_ids=[1], top_p=0.0),
            "top_k negative": dict(token_ids=[1], top_k=-2),
            "zero max_tokens": dict(token_ids=[1], max_tokens=0),
            "bad stop id": dict(token_ids=[1], stop_token_ids=[999]),
        }
        results = {}
        for name, kwargs in cases.items():
            results[name] = await (await client.submit(**kwargs)).result()
        await client.cancel(424242)
        return results


def test_bad_input_gets_clear_errors_and_the_daemon_keeps_serving(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], max_seq_len=64, num_blocks=64, max_waiting=4)
    daemon.wait_ready()
    replies = asyncio.run(raw_exchange(daemon.runtime_dir, MALFORMED))
    assert all(isinstance(r, ErrorEvent) and r.code == "invalid_request" for r in replies), replies
    assert len(replies) == len(MALFORMED) + 2  # the batch of three got an error each
    assert sum("1 to 1024 messages" in r.message for r in replies) == 2
    results = asyncio.run(refusals(daemon.runtime_dir))
    for name, event in results.items():
        assert isinstance(event, ErrorEvent), (name, event)
        assert event.code == ("too_long" if name == "too long" else "invalid_request"), (name, event)
        assert event.message
    mixed = asyncio.run(mixed_batch(daemon.runtime_dir))
    answers = {e.key: e for e in mixed if isinstance(e, (Accepted, ErrorEvent))}
    assert answers[8].code == "invalid_request" and answers[9].code == "invalid_request", mixed
    assert isinstance(answers[7], Accepted) and isinstance(mixed[-1], Finished)
    assert mixed[-1].token_ids == hf_greedy(reference_model(tiny_models["llama"]), [5, 9, 11], 3)
    unknown = asyncio.run(raw_exchange(daemon.runtime_dir, [[enc({"type": "cancel", "request_id": 424242})]]))
    assert unknown[0].code == "unknown_request"
    # a client that vanishes mid-stream is dropped quietly
    asyncio.run(vanish(daemon.runtime_dir))
    # after all that, a normal request is served correctly
    final = asyncio.run(one_request(daemon.runtime_dir, [5, 9, 11], 6))
    assert isinstance(final, Finished)
    assert final.token_ids == hf_greedy(reference_model(tiny_models["llama"]), [5, 9, 11], 6)


async def vanish(runtime_dir):
    client = await AsyncClient.connect(runtime_dir)
    streams = [await client.submit(token_ids=[4, 5, 6], max_tokens=40, temperature=0) for _ in range(3)]
    async for event in streams[0]:
        if isinstance(event, TokenOut):
            break
    await client.close()


async def one_request(runtime_dir, ids, n):
    async with await AsyncClient.connect(runtime_dir) as client:
        return await (await client.submit(token_ids=ids, max_tokens=n, temperature=0)).result()


async def flood_then_cancel(runtime_dir, count):
    async with await AsyncClient.connect(runtime_dir) as client:
        streams = [await client.submit(token_ids=[3 + i, 4, 5], max_tokens=50, temperature=0) for i in range(count)]
        first = [await anext(aiter(s)) for s in streams]
        accepted = [s for s, e in zip(streams, first) if isinstance(e, Accepted)]
        overloaded = [e for e in first if isinstance(e, ErrorEvent)]
        # let the accepted ones stream a few tokens, then cancel them mid-stream
        for stream in accepted:
            event = await anext(aiter(stream))
            assert isinstance(event, TokenOut)
        for stream in accepted:
            await client.cancel(stream.request_id)
        finals = [await s.result() for s in accepted]
        return accepted, overloaded, finals


def test_overload_and_cancel_mid_stream_free_kv_on_every_stage(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 2), (2, 4), (4, 6)], max_seq_len=64, num_blocks=64, max_waiting=4)
    daemon.wait_ready()
    accepted, overloaded, finals = asyncio.run(flood_then_cancel(daemon.runtime_dir, 12))
    assert len(accepted) == 4 and len(overloaded) == 8
    assert all(e.code == "overloaded" for e in overloaded)
    assert all(isinstance(f, Cancelled) for f in finals), finals
    deadline = time.monotonic() + 10
    while True:
        stages = asyncio.run(stats(daemon.runtime_dir)).stages
        if all(s.kv.requests == 0 and s.kv.blocks == 0 for s in stages) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert [(s.kv.requests, s.kv.blocks) for s in stages] == [(0, 0)] * 3
    final = asyncio.run(one_request(daemon.runtime_dir, [5, 9, 11], 6))
    assert isinstance(final, Finished) and len(final.token_ids) >= 1


async def stats(runtime_dir):
    async with await AsyncClient.connect(runtime_dir) as client:
        return await client.stats()


def test_one_stage_plan_exits_2_without_spawning(tmp_path, tiny_models):
    plan = write_plan(tmp_path / "one.toml", tiny_models["llama"], [(0, 6)])
    runtime = tmp_path / "rt"
    proc = subprocess.run(
        [str(BIN / "kvasird"), "start", "--plan", str(plan), "--runtime-dir", str(runtime)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "a pipeline needs at least two stages: head and tail are different roles" in proc.stderr
    assert not runtime.exists()  # nothing was created, nothing spawned


def test_client_commands_without_a_daemon_exit_3(tmp_path):
    for args in (["generate", "--ids", "1,2"], ["stats"], ["tail"]):
        proc = subprocess.run(
            [str(BIN / "kvasir"), *args, "--runtime-dir", str(tmp_path / "none")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 3, (args, proc.stderr)
        assert "no kvasird is running at runtime dir" in proc.stderr


def test_plan_this_machine_cannot_run_exits_2(tmp_path, tiny_models):
    plan = write_plan(tmp_path / "cpus.toml", tiny_models["llama"], [(0, 3), (3, 6)])
    plan.write_text(plan.read_text().replace("layers = [3, 6]", "layers = [3, 6]\ncpus = [4095]"))
    proc = subprocess.run(
        [str(BIN / "kvasird"), "start", "--plan", str(plan), "--runtime-dir", str(tmp_path / "rt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "stages[1].cpus: CPUs [4095] are not available here" in proc.stderr


def test_ready_timeout_stops_every_child_and_exits_nonzero(tmp_path, tiny_models):
    plan = write_plan(tmp_path / "p.toml", tiny_models["llama"], [(0, 3), (3, 6)])
    runtime = tmp_path / "rt"
    start = [str(BIN / "kvasird"), "start", "--plan", str(plan), "--runtime-dir", str(runtime), "--ready-timeout"]
    for wrong in ("0", "-1", "nan", "inf", "1e9", "soon"):  # refused before anything starts
        refused = subprocess.run([*start, wrong], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "--ready-timeout" in refused.stderr, (wrong, refused.stderr)
    # a millisecond: forked from the zygote, the tiny model's workers are ready in well under 0.2 s
    proc = subprocess.run([*start, "0.001"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "not ready after" in proc.stderr
    assert list(runtime.iterdir()) == []
    spawned = [int(m) for m in re.findall(r"spawned +child=\S+ pid=(\d+)", proc.stderr)]
    assert len(spawned) == 3 and not any(alive(pid) for pid in spawned)
