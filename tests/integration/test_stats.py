"""Busy and starved time: an in-flight ring keeps every stage busy, a drained one does not."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvasir.client import AsyncClient, Client
from kvasir.wire.shares import stage_shares
from tests.support.models import save_tiny_model

SPLITS = [(0, 2), (2, 4), (4, 6)]


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory):
    # wide enough that a batch's compute outweighs the per-hop overhead
    folder = tmp_path_factory.mktemp("wide") / "llama"
    return save_tiny_model(
        folder, "llama", hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4
    )


async def saturate_and_measure(runtime_dir, warmup_s=2.5, window_s=4.0, clients=48):
    async with await AsyncClient.connect(runtime_dir) as client:
        stop = time.monotonic() + warmup_s + window_s + 1.5

        async def closed_loop(i):
            while time.monotonic() < stop:
                stream = await client.submit(token_ids=[3 + i % 50] * 20, max_tokens=40, temperature=0)
                await stream.result()

        tasks = [asyncio.create_task(closed_loop(i)) for i in range(clients)]
        await asyncio.sleep(warmup_s)
        before = await client.stats()
        await asyncio.sleep(window_s)
        after = await client.stats()
        await asyncio.gather(*tasks)
    windows = [stage_shares(b, a) for a, b in zip(before.stages, after.stages)]
    return [(shares.busy, shares.starved) for shares in windows]


def test_inflight_ring_is_busy_and_drained_ring_starves(wider_model, start_daemon):
    stages = len(SPLITS)
    ring = start_daemon(wider_model, SPLITS, name="ring", max_rows=16, max_tokens=64, inflight=stages, num_blocks=2000)
    ring.wait_ready()
    busy_ring = asyncio.run(saturate_and_measure(ring.runtime_dir))
    ring.stop()
    drained = start_daemon(wider_model, SPLITS, name="drained", max_rows=16, max_tokens=64, inflight=1, num_blocks=2000)
    drained.wait_ready()
    busy_drained = asyncio.run(saturate_and_measure(drained.runtime_dir))
    print("inflight=S:", busy_ring, "inflight=1:", busy_drained)
    for (ring_busy, _), (drained_busy, drained_starved) in zip(busy_ring, busy_drained):
        assert ring_busy > 0.55  # far above 1/S = 0.33
        assert drained_starved > 0.5  # about (S-1)/S = 0.67 in theory
        assert ring_busy > 1.5 * drained_busy


def test_top_draws_frames_from_live_stats(shared_daemon):
    import subprocess
    import threading

    from tests.support.daemon import BIN

    daemon = shared_daemon
    with Client(daemon.runtime_dir) as client:

        def load():
            for _ in range(6):
                client.generate(token_ids=[5, 6, 7], max_tokens=40, temperature=0)

        worker = threading.Thread(target=load)
        worker.start()
        run = subprocess.run(
            [str(BIN / "kvasir"), "top", "--interval", "0.6", "--count", "3", "--runtime-dir", str(daemon.runtime_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        worker.join()
    assert run.returncode == 0, run.stderr
    frames = [line for line in run.stdout.splitlines() if line.startswith("kvasir  up")]
    assert len(frames) == 3
    stage_lines = [line for line in run.stdout.splitlines() if line.lstrip().startswith(("0 ", "1 "))]
    assert len(stage_lines) == 6 and any("#" in line for line in stage_lines)
    assert "tokens/s out" in run.stdout
    # on a terminal: redraws in place, and q quits at once
    import os
    import pty

    main, side = pty.openpty()
    live = subprocess.Popen(
        [str(BIN / "kvasir"), "top", "--interval", "0.3", "--runtime-dir", str(daemon.runtime_dir)],
        stdin=side,
        stdout=side,
        stderr=side,
    )
    os.close(side)
    seen = b""
    deadline = time.monotonic() + 30
    while b"(q to quit)" not in seen and time.monotonic() < deadline:
        seen += os.read(main, 4096)
    assert b"\x1b[2J" in seen and b"(q to quit)" in seen
    os.write(main, b"q")
    assert live.wait(10) == 0
    os.close(main)
    gone = subprocess.run(
        [str(BIN / "kvasir"), "top", "--count", "1", "--runtime-dir", str(daemon.runtime_dir / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 3
