"""Pools that follow the load: instances move between the prefill and decode pools of a
running daemon (a plan with [planner], docs/planner.md), by hand, under load, and no
request is lost: every one gets exactly one terminal event, and every one finishes
exactly (greedy output equal to Hugging Face's)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess

import pytest

from kvasir.client import AsyncClient, Client
from kvasir.errors import RequestError
from kvasir.wire.client import Finished
from tests.support.daemon import BIN
from tests.support.models import hf_greedy, random_prompts, reference_model

VOCAB = 320
FLEET = {  # two prefill and two decode instances, each splitting the layers its own way
    "prefill.p0": [(0, 3), (3, 6)],
    "prefill.p1": [(0, 2), (2, 6)],
    "decode.d0": [(0, 4), (4, 6)],
    "decode.d1": [(0, 3), (3, 6)],
}
TEXT = {"capture_output": True, "text": True, "timeout": 120}


def start_fleet(start_daemon, tiny_models, **kw):
    return start_daemon(
        tiny_models["llama"], FLEET, planner="", max_tokens=16, prefill_blocks=200, decode_blocks=300, **kw
    ).wait_ready()


def instances(runtime_dir) -> dict:
    with Client(runtime_dir) as client:
        return {i.name: i for i in client.stats().instances}


def stage_pids(runtime_dir) -> dict[int, int]:
    with Client(runtime_dir) as client:
        return {stage.index: stage.pid for stage in client.stats().stages}


def kvasir(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "kvasir"), *args], **TEXT)


async def load(runtime_dir, prompts: list[list[int]], max_tokens: int, moves: list[tuple[str, str]]):
    """Run ``prompts`` (each to ``max_tokens``) while moving instances one after the
    other by hand with `kvasir instances move` (each waits until served), submitting four
    more after each move; every request's terminal event, and what each move printed."""
    client = await AsyncClient.connect(runtime_dir)
    said = []
    try:
        streams = [await client.submit(token_ids=p, max_tokens=max_tokens, temperature=0.0) for p in prompts]
        for name, to in moves:
            args = ("instances", "move", name, "--to", to, "--runtime-dir", str(runtime_dir))
            done = await asyncio.to_thread(kvasir, *args)
            assert done.returncode == 0, done.stderr
            assert f"{name} serves the {to} pool: moved in" in done.stdout, done.stdout
            said.append(done.stdout)
            streams += [await client.submit(token_ids=p, max_tokens=max_tokens, temperature=0.0) for p in prompts[:4]]
        return [await stream.result() for stream in streams], said
    finally:
        await client.close()


def test_moves_by_hand_under_load_lose_nothing(tiny_models, start_daemon):
    """Four moves one after the other while requests run and more arrive after each:
    every request finishes, exactly; each instance serves where it was moved, in the same
    stage processes, with its moves counted apart from restarts; a move that would empty
    a pool, or names an unknown instance or its own pool, is refused with the reason."""
    daemon = start_fleet(start_daemon, tiny_models)
    model = reference_model(tiny_models["llama"])
    before = instances(daemon.runtime_dir)
    assert {n: (i.pool, i.movable, i.state) for n, i in before.items()} == {
        "p0": ("prefill", True, "serving"),
        "p1": ("prefill", True, "serving"),
        "d0": ("decode", True, "serving"),
        "d1": ("decode", True, "serving"),
    }
    pids = stage_pids(daemon.runtime_dir)
    prompts = random_prompts(VOCAB, [9, 14, 5, 21, 11, 17, 8, 12, 19, 6, 15, 10], seed=61)
    moves = [("d0", "prefill"), ("p1", "decode"), ("d1", "prefill"), ("p0", "decode")]
    ends, said = asyncio.run(load(daemon.runtime_dir, prompts, 160, moves))
    print(*said, sep="\n")
    first = re.search(r"waiting for (\d+) requests on it", said[0])
    assert first is not None and int(first.group(1)) > 0, said[0]  # the first move waited for d0's requests
    assert len(ends) == len(prompts) + 4 * len(moves)
    assert all(isinstance(end, Finished) for end in ends), [e for e in ends if not isinstance(e, Finished)]
    expected = {len(p): hf_greedy(model, p, 160) for p in prompts}  # the prompts' lengths differ
    for end in ends:
        assert end.token_ids == expected[end.usage.prompt_tokens], (end.instances, end.route)
    served = {name for end in ends for name in end.instances}
    assert served == {"p0", "p1", "d0", "d1"}
    after = instances(daemon.runtime_dir)
    assert {n: (i.pool, i.state, i.moves, i.restarts) for n, i in after.items()} == {
        "p0": ("decode", "serving", 1, 0),
        "p1": ("decode", "serving", 1, 0),
        "d0": ("prefill", "serving", 1, 0),
        "d1": ("prefill", "serving", 1, 0),
    }
    assert all(i.last_move_s is not None and i.last_move_s > 0 for i in after.values())
    assert stage_pids(daemon.runtime_dir) == pids and len(pids) == 8  # a move keeps the stage processes
    with Client(daemon.runtime_dir) as client:
        for name, to, why in [
            ("zz", "decode", "no instance is named 'zz'"),
            ("p0", "decode", "already serves the decode pool"),
        ]:
            with pytest.raises(RequestError, match=why):
                client.move(name, to)
        client.move("p0", "prefill")  # leaves p1 alone in the decode pool
        with pytest.raises(
            RequestError, match=r"would leave the decode pool 0 serving instances \(planner.min_decode = 1\)"
        ):
            client.move("p1", "prefill")
    shown = kvasir("instances", "--json", "--runtime-dir", str(daemon.runtime_dir))
    listed = {i["name"]: i for i in json.loads(shown.stdout)}
    assert listed["p0"]["state"] in ("moving", "serving") and listed["p1"]["pool"] == "decode"
    refused = kvasir("instances", "move", "p1", "--to", "prefill", "--runtime-dir", str(daemon.runtime_dir))
    assert refused.returncode == 2 and "would leave the decode pool" in refused.stderr


def test_the_mixed_role_serves_both_phases_on_one_instance(tiny_models, start_daemon):
    """A decode and then a prefill instance move to the mixed role (both phases, as a
    colocated ring) under load, and the first moves back to decode: requests routed to a
    mixed instance run there alone, every request finishes, exactly."""
    daemon = start_fleet(start_daemon, tiny_models)
    model = reference_model(tiny_models["llama"])
    prompts = random_prompts(VOCAB, [9, 14, 5, 21, 11, 17, 8, 12], seed=63)
    moves = [("d0", "mixed"), ("p1", "mixed"), ("d0", "decode")]
    ends, said = asyncio.run(load(daemon.runtime_dir, prompts, 96, moves))
    assert all(isinstance(end, Finished) for end in ends), [e for e in ends if not isinstance(e, Finished)]
    expected = {len(p): hf_greedy(model, p, 96) for p in prompts}
    assert all(end.token_ids == expected[end.usage.prompt_tokens] for end in ends)
    alone = [end.instances for end in ends if len(end.instances) == 1]
    assert alone and all(names[0] in ("d0", "p1") for names in alone), [end.instances for end in ends]
    shown = kvasir("instances", "--runtime-dir", str(daemon.runtime_dir))
    pools = {row.split()[0]: row.split()[1] for row in shown.stdout.splitlines()[1:]}
    assert pools == {"p0": "prefill", "p1": "mixed", "d0": "decode", "d1": "decode"}, shown.stdout
    with Client(daemon.runtime_dir) as client:
        with pytest.raises(RequestError, match="already serves the mixed pool"):
            client.move("p1", "mixed")


def test_a_plan_without_planner_refuses_moves(tiny_models, start_daemon):
    splits = {"prefill": [(0, 3), (3, 6)], "decode": [(0, 2), (2, 6)]}
    daemon = start_daemon(tiny_models["llama"], splits, max_tokens=16).wait_ready()
    table = kvasir("instances", "--runtime-dir", str(daemon.runtime_dir))
    rows = [line.split() for line in table.stdout.splitlines()]
    assert rows[0][:4] == ["instance", "pool", "state", "requests"]
    assert [row[:3] + row[5:6] for row in rows[1:]] == [
        ["prefill", "prefill", "serving", "no"],
        ["decode", "decode", "serving", "no"],
    ]
    refused = kvasir("instances", "move", "prefill", "--to", "decode", "--runtime-dir", str(daemon.runtime_dir))
    assert refused.returncode == 2
    assert "instance prefill cannot move: the plan has no [planner] section" in refused.stderr


PLANNER = (  # the decode pool always misses its ITL target, the prefill pool always meets its TTFT
    "enabled = true\ninterval_s = 1.0\npatience = 1\ncooldown_s = 0.0\nttft_s = 1000.0\nitl_s = 0.000001\n"
)


async def planned_load(runtime_dir, prompts: list[list[int]], max_tokens: int):
    """Run ``prompts`` until the planner has moved an instance, then four more; every
    request's terminal event, and the instances once all have ended."""
    client = await AsyncClient.connect(runtime_dir)
    try:
        streams = [await client.submit(token_ids=p, max_tokens=max_tokens, temperature=0.0) for p in prompts]
        for _ in range(600):
            stats = await client.stats()
            if any(i.moves for i in stats.instances):
                break
            await asyncio.sleep(0.1)
        streams += [await client.submit(token_ids=p, max_tokens=max_tokens, temperature=0.0) for p in prompts[:4]]
        ends = [await stream.result() for stream in streams]
        return ends, await client.stats()
    finally:
        await client.close()


def test_the_planner_moves_an_instance_to_the_pool_that_misses(tiny_models, start_daemon):
    """Under load the decode pool misses its (unreachable) ITL target while the prefill
    pool has slack: the planner moves the less busy prefill instance to decode, once (the
    prefill pool is then at its minimum); every request finishes, exactly; the decisions
    are counted, shown by `kvasir stats` and logged with their inputs."""
    daemon = start_daemon(
        tiny_models["llama"], FLEET, planner=PLANNER, max_tokens=16, prefill_blocks=200, decode_blocks=300
    ).wait_ready()
    model = reference_model(tiny_models["llama"])
    prompts = random_prompts(VOCAB, [9, 14, 5, 21, 11, 17, 8, 12, 19, 6, 15, 10], seed=62)
    ends, stats = asyncio.run(planned_load(daemon.runtime_dir, prompts, 160))
    assert len(ends) == len(prompts) + 4
    assert all(isinstance(end, Finished) for end in ends), [e for e in ends if not isinstance(e, Finished)]
    expected = {len(p): hf_greedy(model, p, 160) for p in prompts}
    assert all(end.token_ids == expected[end.usage.prompt_tokens] for end in ends)
    pools = {i.name: (i.pool, i.moves) for i in stats.instances}
    moved = [name for name, (_, moves) in pools.items() if moves]
    assert len(moved) == 1 and moved[0] in ("p0", "p1") and pools[moved[0]] == ("decode", 1), pools
    planner = stats.planner
    assert planner is not None and planner.decisions["move"] == 1 and planner.decisions["hold"] >= 1
    assert planner.last_move is not None and planner.last_move.instance == moved[0]
    assert "the decode pool misses its target" in planner.last_move.reason
    shown = kvasir("stats", "--runtime-dir", str(daemon.runtime_dir))
    assert "planner: targets TTFT 1000 s, ITL 1e-06 s at p90, every 1 s;" in shown.stdout, shown.stdout
    assert re.search(r"^instance +pool .* moves$", shown.stdout, re.M), shown.stdout
    logged = [line for line in daemon.log().splitlines() if " planner " in line and "action=move" in line]
    assert len(logged) == 1 and "itl_s=" in logged[0] and "prefill=2" in logged[0], logged
