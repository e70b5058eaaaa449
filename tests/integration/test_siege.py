"""The siege: every attack of issue "under siege" at once against one daemon with an HTTP
front, while normal clients run. A deeply nested message on the client socket, 40
concurrent gzip bombs, 1,100 half-open connections, a stream nobody reads with top-20
log-probabilities, a fan-out request at the limit; meanwhile normal callers (HTTP and
ZeroMQ) get exactly the greedy tokens they get in peace, /health answers 200 within 5 s
every time it is asked, the front's and the bridge's resident memory stay under the bound
docs/operations.md states, nothing restarts, and afterwards the front's descriptors and
the daemon's queues are back to idle. Bounded: every attack has a count, every wait a
deadline."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import re
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import openai
import pytest
import zmq

from kvasir.client import AsyncClient
from kvasir.transport import envelopes
from kvasir.wire.client import ClientEvent, ErrorEvent, Finished
from tests.support.daemon import free_port, serving, settled, write_plan

SPLITS = [(0, 3), (3, 6)]
NORMAL, ATTACKER = "sk-normal-caller", "sk-attacker"
RSS_BOUND_MIB = 512  # docs/operations.md: the front's and the bridge's resident memory under siege
HALF_OPEN, BOMBS = 1100, 40
PROMPTS = [[5, 17, 42, 99, 3], [7, 1, 7], [250, 11, 12, 13, 14, 15, 16, 17], [300, 2]]


@pytest.fixture(scope="module")
def besieged(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("siege")
    (root / "keys").write_text(f"{NORMAL}\n{ATTACKER}\n")
    (root / "keys").chmod(0o600)
    port = free_port()
    front = {
        "listen": f"127.0.0.1:{port}",
        "api_keys": "keys",
        "model_name": "tiny",
        "allow_ignore_eos": True,
        "write_timeout_s": 3.0,  # the never-reading stream is cut off within the test
        "header_timeout_s": 5.0,
    }
    plan = write_plan(
        root / "plan.toml", tiny_models["llama-tokenizer"], SPLITS, max_seq_len=512, num_blocks=1200, http=front
    )
    with serving(plan, root / "rt", SPLITS, port) as daemon:
        yield daemon


def health(port: int) -> int:
    """GET /health on a fresh connection; its status (a 5 s timeout fails the test)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def post(port: int, body: bytes, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {ATTACKER}", **headers})
        return conn.getresponse().status
    finally:
        conn.close()


def normal_round(sdk: openai.OpenAI, runtime_dir) -> list[list[int]]:
    """Each prompt once over HTTP and once over ZeroMQ, greedy; every answer's tokens."""
    answers = []
    for prompt in PROMPTS:
        choice = sdk.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
        ).choices[0]
        answers.append(list(choice.token_ids))  # type: ignore[attr-defined]

    async def zeromq() -> list[list[int]]:
        async with await AsyncClient.connect(runtime_dir) as client:
            streams = [await client.submit(token_ids=p, max_tokens=10, temperature=0) for p in PROMPTS]
            ends = [await stream.result() for stream in streams]
        assert all(isinstance(end, Finished) for end in ends), ends
        return [end.token_ids for end in ends]  # type: ignore[union-attr]

    return answers + asyncio.run(zeromq())


def nested_messages(runtime_dir) -> list[ClientEvent]:
    """~1 KB of nesting on the client socket, bare and inside a submission; the answers."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"ipc://{runtime_dir}/client.sock")
    try:
        sock.send(b"\x91" * 1000 + b"\xc0")
        sock.send(b"\x83\xa4type\xa6submit\xa3key\x07\xa1x" + b"\x91" * 3000 + b"\xc0")
        answers: list[ClientEvent] = []
        while len(answers) < 2:
            assert sock.poll(30_000), "the bridge did not answer a nested message"
            answers += [msgspec.msgpack.decode(body, type=ClientEvent) for body in envelopes.members(sock.recv())]
        return answers
    finally:
        sock.close(linger=0)
        ctx.term()


def never_read(port: int, stop: threading.Event) -> None:
    """A stream of four choices with top-20 log-probabilities that nobody reads."""
    body = json.dumps(
        {"model": "tiny", "prompt": "a b c", "max_tokens": 400, "ignore_eos": True, "stream": True, "logprobs": 20,
         "n": 4}
    ).encode()  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ATTACKER}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    stop.wait(120)
    sock.close()


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+) kB", status.read()).group(1)) / 1024  # type: ignore[union-attr]


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_every_attack_at_once_leaves_normal_callers_served(besieged):
    port, runtime_dir = besieged.port, besieged.runtime_dir
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))  # this test's own sockets
    front = int(re.findall(r"http front ready .*pid=(\d+)", besieged.log())[-1])
    bridge = int(re.findall(r"accepting clients .*pid=(\d+) .*role=bridge", besieged.log())[-1])
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=NORMAL, max_retries=2, timeout=60)
    in_peace = normal_round(sdk, runtime_dir)
    idle_fds = descriptors(front)

    stop, samples, statuses = threading.Event(), [], []

    def watch() -> None:  # /health and resident memory, throughout
        while not stop.is_set():
            statuses.append(health(port))
            samples.append((resident_mib(front), resident_mib(bridge)))
            stop.wait(0.25)

    bomb = gzip.compress(b'{"model": "tiny", "prompt": "' + b"a" * (32 << 20) + b'"}', 9)
    half_open: list[socket.socket] = []
    with ThreadPoolExecutor(max_workers=BOMBS + 8) as pool:
        try:
            watcher = pool.submit(watch)
            reader = pool.submit(never_read, port, stop)
            for k in range(HALF_OPEN):
                sock = socket.create_connection(("127.0.0.1", port))
                if k % 2:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
                half_open.append(sock)
            headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
            bombs = [pool.submit(post, port, bomb, headers) for _ in range(BOMBS)]
            attacker = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=ATTACKER, max_retries=0)
            fan_out = pool.submit(
                attacker.completions.create,
                model="tiny", prompt="a b c", n=16, max_tokens=40, extra_body={"ignore_eos": True}, timeout=120,
            )  # fmt: skip
            nested = nested_messages(runtime_dir)
            under_siege = [normal_round(sdk, runtime_dir) for _ in range(3)]
            assert [future.result(timeout=120) for future in bombs] == [415] * BOMBS
            assert len(fan_out.result(timeout=120).choices) == 16  # at the limit: served, not refused
            deadline = time.monotonic() + 60
            while "the client stopped reading its stream" not in besieged.log() and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            stop.set()  # the watcher and the never-reading client end with it
            for sock in half_open:
                sock.close()
        watcher.result(timeout=30)
        reader.result(timeout=30)

    assert all(isinstance(event, ErrorEvent) and event.code == "invalid_request" for event in nested), nested
    assert under_siege == [in_peace] * 3  # exact, every round
    assert "the client stopped reading its stream" in besieged.log()
    assert statuses and set(statuses) == {200}, statuses
    peak = [max(sample[i] for sample in samples) for i in (0, 1)]
    assert max(peak) < RSS_BOUND_MIB, f"front {peak[0]:.0f} MiB, bridge {peak[1]:.0f} MiB"
    stats = settled(runtime_dir)
    assert stats.in_flight == 0 and stats.restarts == 0
    deadline = time.monotonic() + 30
    while descriptors(front) > idle_fds + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert descriptors(front) <= idle_fds + 4  # every connection of the siege closed
    assert normal_round(sdk, runtime_dir) == in_peace and health(port) == 200
    print(f"siege: front peak {peak[0]:.0f} MiB, bridge peak {peak[1]:.0f} MiB, health polls {len(statuses)}")
