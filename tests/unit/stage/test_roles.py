"""A stage changes pools on what it keeps (kvasir/stage/roles.py): one real stage of the
tiny model, built in this process by the stage process's own ``build_agent``, sent
"regroup" commands on its command socket as the launcher sends them."""

from __future__ import annotations

import os

import msgspec
import pytest
import zmq

from kvasir.config.sections import BatchSpec, KvSpec
from kvasir.logs import setup_logging
from kvasir.model.source import resolve_source
from kvasir.stage.process import build_agent
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.transport.fabric import Sockets, open_fabric
from kvasir.wire.batch import SamplingParams
from kvasir.wire.control import Command, ControlMessage, EdgeSpec, Ready, StageSettings
from tests.support.models import make_plan


@pytest.fixture
def stage(tmp_path, tiny_models):
    """The head of a two-stage ring (its edge a tcp one: no shared memory to make), the
    launcher's ends of its command and control sockets."""
    plan = make_plan(tiny_models["llama"], [(0, 3), (3, 6)], inflight=3, max_tokens=32)
    hidden = int(resolve_source(plan.model.source).config.hidden_size)
    edge = EdgeSpec(kind="tcp", name="edge0", slots=3, max_tokens=32, hidden=hidden, dtype="float32")
    settings = StageSettings(index=0, plan=plan, runtime_dir=str(tmp_path), launcher_pid=os.getpid(), edges=[edge])
    sockets = Sockets(zmq.Context(), *open_fabric(tmp_path, None))
    control = PullChannel[ControlMessage](sockets.bind(zmq.PULL, sockets.ends.control), ControlMessage)
    agent, closing = build_agent(settings, sockets, setup_logging("critical", role="test"))
    commands = PushChannel[Command](sockets.connect(zmq.PUSH, sockets.ends.command("stage-0")))
    try:
        yield agent, commands, control
    finally:
        for resource in closing:
            resource.close()
        sockets.end()


def regroup(stage, **command) -> list:
    """Send one regroup command, let the agent take it; what it said to the launcher."""
    agent, commands, control = stage
    commands.send(Command("regroup", **command))
    assert agent.commands.socket.poll(5000)
    agent._receive()
    control.socket.poll(200)
    return control.drain()


def test_a_stage_serves_another_pools_widths_on_the_same_engine_and_scheduler(stage):
    agent, _, _ = stage
    engine, scheduler = agent.engine, agent.intake.scheduler
    plan = agent.settings.plan
    narrow = msgspec.structs.replace(plan, batch=BatchSpec(max_rows=2, max_tokens=16, inflight=1))
    said = regroup(stage, pool="", plan=narrow)
    assert said == [Ready("stage", 0, os.getpid())]
    assert agent.engine is engine and agent.intake.scheduler is scheduler
    assert (scheduler.max_rows, scheduler.max_tokens, scheduler.inflight_limit) == (2, 16, 1)
    assert agent.settings.plan == narrow


class Said:
    """A logger that keeps what it was told."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((event, fields))


@pytest.mark.parametrize(
    ("command", "busy", "why"),
    [
        ({"pool": "", "plan": None}, False, "without its pool and plan"),
        ({"pool": "", "plan": "other cache"}, False, "differs from this stage's in more than its widths"),
        ({"pool": "", "plan": "wider"}, False, "widths do not fit edge edge0"),
        ({"pool": "prefill", "plan": "same"}, False, "no hand-off wiring: it cannot serve the prefill pool"),
        ({"pool": "", "plan": "same"}, True, "holds 1 requests and 0 batches in flight"),
    ],
)
def test_a_regroup_the_stage_cannot_follow_is_refused_and_it_serves_on_as_it_was(stage, command, busy, why):
    agent, _, _ = stage
    agent.log = said = Said()
    plan, intake = agent.settings.plan, agent.intake
    views = {
        "same": plan,
        "other cache": msgspec.structs.replace(plan, kv=KvSpec(block_size=4, num_blocks=300)),
        "wider": msgspec.structs.replace(plan, batch=BatchSpec(max_rows=8, max_tokens=32, inflight=5)),
    }
    if busy:
        intake.scheduler.submit([1, 2, 3], SamplingParams(max_tokens=4), request_id=7)
    answer = regroup(stage, pool=command["pool"], plan=views.get(command["plan"]))
    assert answer == [] and agent.intake is intake and agent.settings.plan == plan and agent.settings.pool == ""
    [(event, fields)] = said.lines
    assert event == "regroup refused" and why in fields["reason"], fields
