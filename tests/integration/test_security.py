"""CURVE on the bridge's TCP endpoint: the allow-listed client is served, others are not."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from kvasir.client import AsyncClient, NotAuthorised, Remote
from kvasir.config.keys import generate
from kvasir.wire.client import ErrorEvent, Finished
from tests.support.daemon import BIN, free_port
from tests.support.models import hf_greedy, reference_model


async def greedy(runtime_dir, remote, ids, n):
    async with await AsyncClient.connect(runtime_dir, timeout_s=10.0, remote=remote) as client:
        return await (await client.submit(token_ids=ids, max_tokens=n, temperature=0)).result()


async def greedy_end(runtime_dir, remote, ids, **kw):
    async with await AsyncClient.connect(runtime_dir, timeout_s=10.0, remote=remote) as client:
        return await (await client.submit(token_ids=ids, max_tokens=2, temperature=0, **kw)).result()


async def refused(runtime_dir, remote):
    with pytest.raises(NotAuthorised):  # at once, normally; the bound is for a slow machine
        await AsyncClient.connect(runtime_dir, timeout_s=30.0, remote=remote)


def test_only_allow_listed_keys_are_served_over_tcp(tiny_models, start_daemon, tmp_path):
    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    generate(keys, ["alice", "bob"])
    generate(strangers, ["mallory"])  # a valid key pair, not in keys/clients
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = start_daemon(
        tiny_models["llama"],
        [(0, 3), (3, 6)],
        tcp=endpoint,
        server_key=keys / "server.key_secret",
        client_keys=keys / "clients",
    ).wait_ready()
    reference = hf_greedy(reference_model(tiny_models["llama"]), [7, 1, 7], 6)
    elsewhere = daemon.runtime_dir.parent / "nowhere"  # the remote path never needs the runtime dir

    alice = Remote(endpoint, keys / "alice.key_secret", keys / "server.key")
    final = asyncio.run(greedy(elsewhere, alice, [7, 1, 7], 6))
    assert isinstance(final, Finished) and final.token_ids == reference

    # each key is a tenant of the prefix cache: bob cannot confirm alice's prompt, she reuses it
    bob = Remote(endpoint, keys / "bob.key_secret", keys / "server.key")
    long = [7 + i % 50 for i in range(22)]  # five full 4-token blocks before its last token
    ends = [asyncio.run(greedy_end(elsewhere, who, long)) for who in (alice, bob, alice)]
    assert [end.usage.cached_tokens for end in ends] == [0, 0, 20]
    assert asyncio.run(greedy_end(daemon.runtime_dir, None, long)).usage.cached_tokens == 0  # local: its own
    named = asyncio.run(greedy_end(elsewhere, bob, long, tenant="alice"))  # only local clients name tenants
    assert isinstance(named, ErrorEvent) and named.code == "invalid_request" and "tenant" in named.message

    mallory = Remote(endpoint, strangers / "mallory.key_secret", keys / "server.key")
    asyncio.run(refused(elsewhere, mallory))
    wrong_server = Remote(endpoint, keys / "alice.key_secret", strangers / "server.key")
    asyncio.run(refused(elsewhere, wrong_server))
    asyncio.run(refused(elsewhere, Remote(endpoint)))  # plaintext against a CURVE endpoint

    # the command line, in a fresh process each time (its first connection is refused)
    run = [
        str(BIN / "kvasir"),
        "generate",
        "--ids",
        "7,1,7",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--json",
        "--connect",
        endpoint,
        "--server-key",
        str(keys / "server.key"),
    ]
    ok = subprocess.run(run + ["--key", str(keys / "alice.key_secret")], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1])["token_ids"] == reference
    no = subprocess.run(
        run + ["--key", str(strangers / "mallory.key_secret")], capture_output=True, text=True, timeout=60
    )
    assert no.returncode == 3 and "refused this client" in no.stderr, no.stderr

    # the local socket in the runtime dir is unaffected, and no refused client restarted anything
    assert asyncio.run(greedy(daemon.runtime_dir, None, [7, 1, 7], 6)).token_ids == reference
    with daemon.client() as client:
        assert client.stats().restarts == 0
