"""What one connection, request or caller may hold of an HTTP front: compressed bodies
refused, idle and half-open connections closed and evicted, slow bodies timed out,
fan-out and callers bounded, a stream nobody reads cut off with its request cancelled.
Each limit is set low in the plan so the test meets it quickly."""

from __future__ import annotations

import gzip
import json
import socket
import time

import pytest

from tests.integration.test_http import curl_health
from tests.support.daemon import Daemon, free_port, settled, stage_count, write_plan

SPLITS = [(0, 3), (3, 6)]
KEYS = ("sk-alice", "sk-bob")
LIMITS = {
    "max_connections": 16,
    "header_timeout_s": 1.0,
    "idle_timeout_s": 1.0,
    "body_timeout_s": 1.0,
    "write_timeout_s": 1.0,
    "max_choices": 4,
    "max_per_caller": 4,
    "max_tokens": 3000,
    "allow_ignore_eos": True,
}


@pytest.fixture(scope="module")
def front(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    (root / "keys").write_text("\n".join(KEYS) + "\n")
    (root / "keys").chmod(0o600)  # a file of secrets: its owner's only
    port = free_port()
    http = {"listen": f"127.0.0.1:{port}", "api_keys": "keys", "model_name": "tiny", **LIMITS}
    plan = write_plan(
        root / "plan.toml", tiny_models["llama-tokenizer"], SPLITS, max_seq_len=512, num_blocks=1200, http=http
    )
    daemon = Daemon(plan, root / "rt", stage_count(SPLITS))
    daemon.port = port  # type: ignore[attr-defined]
    try:
        daemon.wait_ready()
        deadline = time.monotonic() + 30
        while curl_health(port)[0] != "200" and time.monotonic() < deadline:
            time.sleep(0.1)
        yield daemon
    finally:
        assert daemon.stop() == 0, daemon.log()[-5_000:]


def request(
    port: int, path: str, body: bytes, key: str = KEYS[0], extra: str = "", timeout: float = 30
) -> tuple[int, bytes]:
    """One raw HTTP/1.1 POST; the status and the body (read to the end)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def completion(**body) -> bytes:
    return json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, **body}).encode()


def test_a_compressed_body_is_refused_before_it_is_inflated(front):
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (32 << 20) + b'"}')  # ~32 KB that inflate to 32 MiB
    status, body = request(front.port, "/v1/completions", bomb, extra="Content-Encoding: gzip\r\n")
    assert status == 415 and b"Content-Encoding" in body
    assert request(front.port, "/v1/completions", completion())[0] == 200


def closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock``: an orderly end, or a reset (a connection closed
    before the front read what it had sent, as an evicted one may be)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_half_open_connections_are_evicted_and_closed_and_health_still_answers(front):
    idle = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(3 * LIMITS["max_connections"])]
    for sock in idle[::2]:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    try:
        assert curl_health(front.port)[0] == "200"  # the newest connection took an idle one's place
        time.sleep(LIMITS["header_timeout_s"] + 1.0)
        for sock in idle:
            sock.settimeout(5)
            assert closed(sock)  # by the front: evicted, or past its deadline
    finally:
        for sock in idle:
            sock.close()
    assert request(front.port, "/v1/completions", completion())[0] == 200


def test_a_body_that_does_not_arrive_is_a_408(front):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
        'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt":'
    )
    with socket.create_connection(("127.0.0.1", front.port), timeout=30) as sock:
        sock.sendall(head.encode())
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (completion(prompt=[[5], [6]], n=3), b"http.max_choices"),
        (completion(max_tokens=3001), b"http.max_tokens"),
        (completion(max_tokens=2**64), b"max_tokens"),
        (completion(seed=2**64), b"seed"),
        (completion(top_k=2**64), b"top_k"),
        (completion(logprobs=-1), b"logprobs"),
        (completion(prompt=[5, 2**32], echo=True), b"prompt"),
        (completion(prompt=[5, 10**6], echo=True), b"not a token of this model"),
        (b'{"prompt": [5], "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"nested too deeply"),
    ],
)
def test_values_out_of_range_are_400s_naming_them(front, body, says):
    status, reply = request(front.port, "/v1/completions", body)
    assert status == 400 and says in reply, reply


def test_one_caller_cannot_take_another_callers_share(front):
    long = completion(n=4, max_tokens=2000, ignore_eos=True, stream=True)
    with socket.create_connection(("127.0.0.1", front.port), timeout=30) as hog:
        hog.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(long)}\r\n\r\n".encode()
            + long
        )
        assert hog.recv(65536).startswith(b"HTTP/1.1 200")  # its stream began: its four are running
        status, reply = request(front.port, "/v1/completions", completion(), key=KEYS[0])
        assert status == 429 and b"http.max_per_caller" in reply
        assert request(front.port, "/v1/completions", completion(), key=KEYS[1])[0] == 200


def test_a_stream_nobody_reads_is_cut_off_and_its_request_cancelled(front):
    """Top-20 log-probabilities make each event about a kilobyte, four choices 2 MB in all:
    the client's small window and the front's buffers fill early, the front's write waits, and
    after http.write_timeout_s the front drops the connection and cancels the request."""
    body = completion(max_tokens=500, ignore_eos=True, stream=True, logprobs=20, n=4)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing, holds little
    sock.connect(("127.0.0.1", front.port))
    try:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[1]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 60
        while "the client stopped reading its stream" not in front.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "the client stopped reading its stream" in front.log()
        sock.settimeout(10)
        received = b""
        try:
            while chunk := sock.recv(65536):  # what was buffered, then the connection's end
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received  # cut short
    finally:
        sock.close()
    stats = settled(front.runtime_dir)
    assert stats.in_flight == 0 and stats.restarts == 0


def test_the_front_is_still_whole(front):
    assert "http front failed" not in front.log() and curl_health(front.port)[0] == "200"
