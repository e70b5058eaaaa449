"""Edge kinds per plan and host, and the CUDA IPC handle exchange (the parts that need no CUDA)."""

from __future__ import annotations

import json
import os
import threading
import time

import msgspec
import pytest
import zmq
from click.testing import CliRunner

from kvasir.cli.main import kvasir
from kvasir.config.devices import cuda_ordinal
from kvasir.config.plan import parse_plan
from kvasir.errors import PlanError
from kvasir.ring.attach import attach_ring, create_ring
from kvasir.ring.edges import EdgeChoice, choose_edge, pool_edges
from kvasir.ring.handshake import HandleExchange, HandshakeError, exchange_handles
from kvasir.ring.shm import SHM_DIR
from kvasir.ring.slots import SlotError
from kvasir.transport.channels import PullChannel, PushChannel, make_socket
from kvasir.wire.control import Command, ControlMessage, CudaMemoryHandle, EdgeHandles, EdgeSpec, StageSettings


def stages_text(*stages: str) -> str:
    return "".join(f"[[stages]]\nlayers = [{3 * i}, {3 * i + 3}]\n{body}\n" for i, body in enumerate(stages))


def refused(text: str) -> str:
    with pytest.raises(PlanError) as info:
        parse_plan(text)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- the plan's edge key ----------------------------------------------------------------------
def test_edge_key_defaults_to_auto_and_reads_back():
    from kvasir.config.plan import plan_toml

    plan = parse_plan(stages_text('device = "cuda:0"\nedge = "pinned"', 'device = "cuda:1"'))
    assert plan.stages[0].edge == "pinned" and plan.stages[1].edge is None
    assert parse_plan(plan_toml(plan)) == plan


@pytest.mark.parametrize(
    "stages, expected",
    [
        (('edge = "fast"', ""), "stages[0].edge = 'fast' is not an edge kind (use auto, cuda-ipc, pinned, shm)"),
        (("", 'edge = "shm"'), "stages[1].edge: the last stage of a pipeline has no edge"),
        (('edge = "cuda-ipc"', 'device = "cuda:0"'), "stages[0].edge = 'cuda-ipc' needs CUDA devices on both sides"),
        (('device = "cuda:0"\nedge = "cuda-ipc"', ""), "(this stage is on cuda:0, the next on cpu)"),
        (('edge = "pinned"', ""), "stages[0].edge = 'pinned' needs a CUDA device on at least one side"),
        (("", 'edge = "pinned"', ""), "stages[1].edge = 'pinned' needs a CUDA device"),
    ],
)
def test_impossible_edge_kinds_are_refused_naming_the_key(stages, expected):
    assert expected in refused(stages_text(*stages))


def test_pool_stages_name_their_pool():
    text = (
        '[[prefill.stages]]\nlayers = [0, 3]\nedge = "x"\n[[prefill.stages]]\nlayers = [3, 6]\n'
        "[[decode.stages]]\nlayers = [0, 3]\n[[decode.stages]]\nlayers = [3, 6]\n"
    )
    assert "prefill.stages[0].edge = 'x'" in refused(text)


# -- choosing a kind ----------------------------------------------------------------------------
def no_peers(a: int, b: int) -> bool:
    return False


def all_peers(a: int, b: int) -> bool:
    return True


@pytest.mark.parametrize(
    "requested, producer, consumer, peers, kind",
    [
        (None, "cpu", "cpu", None, "shm"),
        ("auto", "cpu", "cpu", all_peers, "shm"),
        (None, "cuda:0", "cpu", None, "pinned"),
        (None, "cpu", "cuda:1", None, "pinned"),
        (None, "cuda", "cuda:0", None, "cuda-ipc"),  # plain "cuda" is device 0
        (None, "cuda:0", "cuda:1", all_peers, "cuda-ipc"),
        (None, "cuda:0", "cuda:1", no_peers, "pinned"),
        (None, "cuda:0", "cuda:1", None, "auto"),  # no CUDA here to ask: decided at start
        ("shm", "cuda:0", "cuda:0", all_peers, "shm"),
        ("pinned", "cuda:0", "cuda:0", all_peers, "pinned"),
        ("cuda-ipc", "cuda:0", "cuda:1", no_peers, "cuda-ipc"),
    ],
)
def test_auto_picks_cuda_ipc_then_pinned_then_shared_memory(requested, producer, consumer, peers, kind):
    choice = choose_edge(requested, producer, consumer, peers)
    assert choice.kind == kind and choice.reason


def test_peer_access_is_asked_in_the_writing_direction_and_explained():
    asked = []

    def peers(a, b):
        asked.append((a, b))
        return False

    choice = choose_edge("cuda-ipc", "cuda:2", "cuda:0", peers)
    assert asked == [(2, 0)] and "no peer access" in choice.reason
    assert choose_edge(None, "cuda:0", "cuda:0", peers) == EdgeChoice("cuda-ipc", "both stages on cuda:0")
    assert asked == [(2, 0)]  # one device needs no question
    assert cuda_ordinal("cpu") is None and cuda_ordinal("cuda") == 0 and cuda_ordinal("cuda:12") == 12


def test_a_pipeline_has_one_edge_between_each_pair():
    plan = parse_plan(stages_text('device = "cpu"', 'device = "cuda:0"', 'device = "cuda:0"', ""))
    assert [c.kind for c in pool_edges(plan.stages, None)] == ["pinned", "cuda-ipc", "pinned"]


def write_plan(folder, source, *stages: str):
    path = folder / "plan.toml"
    body = "".join(
        f"[[stages]]\nlayers = [{a}, {b}]\n{extra}\n" for (a, b), extra in zip([(0, 2), (2, 4), (4, 6)], stages)
    )
    path.write_text(f'[model]\nsource = "{source}"\nmax_seq_len = 256\n[kv]\nblock_size = 16\nnum_blocks = 32\n{body}')
    return path


def test_plan_check_shows_each_edge_and_why(tmp_path, tiny_models):
    path = write_plan(tmp_path, tiny_models["llama"], 'device = "cpu"', 'device = "cuda:0"', 'device = "cuda:0"')
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output
    edges = [line for line in result.output.splitlines() if line.startswith("edge ")]
    assert edges == [
        "edge     0 -> 1: pinned (cpu to cuda:0: page-locked shared memory)",
        "edge     1 -> 2: cuda-ipc (both stages on cuda:0)",
    ]
    body = json.loads(CliRunner().invoke(kvasir, ["plan", "check", "--json", str(path)]).output)
    assert [s["edge"] for s in body["stages"]] == ["", "pinned", "cuda-ipc"]


# -- the launcher pairs halves --------------------------------------------------------------------
def half(edge: str, side: str, index: int, events: int = 2, memory: bool = False) -> EdgeHandles:
    handle = CudaMemoryHandle(
        device=0,
        handle=b"\x01" * 64,
        size=4096,
        offset=512,
        ref_counter=b"/torch_1_2",
        ref_counter_offset=3,
        event=b"\x02" * 64,
        event_sync=True,
    )
    return EdgeHandles(
        edge=edge,
        side=side,
        index=index,
        pid=100 + index,
        device=0,
        events=tuple(bytes([index, k]) * 32 for k in range(events)),
        memory=handle if memory else None,
    )


def test_the_launcher_sends_each_side_the_other_half_once_both_are_in():
    exchange = HandleExchange({"e0": (0, 1), "e1": (1, 2)})
    consumer, producer = half("e0", "consumer", 1, memory=True), half("e0", "producer", 0)
    assert exchange.offer(consumer) == []
    assert exchange.offer(producer) == [(0, consumer), (1, producer)]
    assert exchange.offer(half("e1", "producer", 1)) == []
    exchange.clear()  # a restart: new processes, new handles
    assert exchange.offer(half("e1", "consumer", 2)) == []


@pytest.mark.parametrize(
    "bad, expected",
    [
        (half("e9", "producer", 0), "not a CUDA IPC edge"),
        (half("e0", "producer", 1), "which is not its side"),
        (half("e0", "sideways", 0), "which is not its side"),
    ],
)
def test_handles_from_the_wrong_stage_are_refused(bad, expected):
    with pytest.raises(HandshakeError, match=expected):
        HandleExchange({"e0": (0, 1)}).offer(bad)


def test_handles_are_bytes_in_msgspec_messages_both_ways():
    consumer = half("e0", "consumer", 1, memory=True)
    control = msgspec.msgpack.decode(msgspec.msgpack.encode(consumer), type=ControlMessage)
    assert control == consumer and isinstance(control.memory.handle, bytes)
    command = msgspec.msgpack.decode(msgspec.msgpack.encode(Command("attach", handles=(consumer,))), type=Command)
    assert command.handles == (consumer,)
    with pytest.raises(msgspec.ValidationError):  # a handle must be bytes, not text
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({**msgspec.structs.asdict(consumer), "events": ["x"]}), type=EdgeHandles
        )


# -- a stage waits for its halves -----------------------------------------------------------------
class StandInRing:
    """The handshake side of a CUDA IPC ring, with no CUDA behind it."""

    def __init__(self, name: str, side: str, index: int) -> None:
        self.spec = EdgeSpec(
            kind="cuda-ipc",
            name=name,
            slots=2,
            max_tokens=4,
            hidden=8,
            dtype="float32",
            producer="cuda:0",
            consumer="cuda:0",
        )
        self.side = side
        self.mine = half(name, side, index, memory=side == "consumer")
        self.peer: EdgeHandles | None = None

    def local_half(self, index: int, pid: int) -> EdgeHandles:
        return msgspec.structs.replace(self.mine, index=index, pid=pid)

    def attach(self, peer: EdgeHandles) -> None:
        self.peer = peer


@pytest.fixture
def wires(tmp_path):
    """A stage's control (to the launcher) and command (from it) channels over ipc://."""
    ctx = zmq.Context()
    control_at, command_at = f"ipc://{tmp_path}/control.sock", f"ipc://{tmp_path}/command.sock"
    launcher_in = PullChannel(make_socket(ctx, zmq.PULL, bind=control_at), ControlMessage)
    launcher_out = PushChannel[Command](make_socket(ctx, zmq.PUSH, connect=command_at))
    stage_out = PushChannel[ControlMessage](make_socket(ctx, zmq.PUSH, connect=control_at))
    stage_in = PullChannel(make_socket(ctx, zmq.PULL, bind=command_at), Command)
    yield launcher_in, launcher_out, stage_out, stage_in
    ctx.destroy(linger=0)


def test_a_middle_stage_gets_both_its_edges_through_the_launcher(wires):
    launcher_in, launcher_out, stage_out, stage_in = wires
    exchange = HandleExchange({"e0": (0, 1), "e1": (1, 2)})
    upstream, downstream = half("e0", "producer", 0), half("e1", "consumer", 2, memory=True)

    def launcher():  # the other stages' halves are in already; stage 1's arrive over the socket
        exchange.offer(upstream)
        exchange.offer(downstream)
        for _ in range(2):
            for target, other in exchange.offer(launcher_in.recv()):
                if target == 1:
                    launcher_out.send(Command("attach", handles=(other,)))

    thread = threading.Thread(target=launcher)
    thread.start()
    rings = [StandInRing("e0", "consumer", 1), StandInRing("e1", "producer", 1)]
    exchange_handles(rings, 1, stage_out, stage_in, launcher_pid=os.getppid(), timeout_s=30)
    thread.join(10)
    assert rings[0].peer == upstream and rings[1].peer == downstream


def test_the_wait_ends_on_stop_on_timeout_and_without_the_launcher(wires):
    launcher_in, launcher_out, stage_out, stage_in = wires
    launcher_out.send(Command("stop"))
    with pytest.raises(HandshakeError, match="stopped"):
        exchange_handles(
            [StandInRing("e0", "consumer", 1)], 1, stage_out, stage_in, launcher_pid=os.getppid(), timeout_s=30
        )
    started = time.monotonic()
    with pytest.raises(HandshakeError, match="no CUDA IPC handles for e0 within 0.2 s"):
        exchange_handles(
            [StandInRing("e0", "consumer", 1)], 1, stage_out, stage_in, launcher_pid=os.getppid(), timeout_s=0.2
        )
    assert time.monotonic() - started < 10
    with pytest.raises(HandshakeError, match="launcher is gone"):  # -1 is no process's parent (1 may be ours)
        exchange_handles([StandInRing("e0", "consumer", 1)], 1, stage_out, stage_in, launcher_pid=-1, timeout_s=30)
    launcher_out.send(Command("attach", handles=(half("e7", "producer", 0),)))
    with pytest.raises(HandshakeError, match="not for this stage"):
        exchange_handles(
            [StandInRing("e0", "consumer", 1)], 1, stage_out, stage_in, launcher_pid=os.getppid(), timeout_s=30
        )
    sent = [launcher_in.recv() for _ in range(4)]
    assert all(h.edge == "e0" and h.side == "consumer" and h.pid == os.getpid() for h in sent)


def test_a_stage_with_no_cuda_ipc_edge_sends_nothing(wires):
    launcher_in, _, stage_out, stage_in = wires
    exchange_handles([], 1, stage_out, stage_in, launcher_pid=1, timeout_s=0.01)
    assert not launcher_in.socket.poll(50)


# -- which end makes what ---------------------------------------------------------------------------
def test_the_launcher_makes_shared_memory_edges_only():
    spec = EdgeSpec(
        kind="cuda-ipc",
        name=f"kvasir-test-{os.getpid()}",
        slots=2,
        max_tokens=4,
        hidden=8,
        dtype="float32",
        producer="cuda:0",
        consumer="cuda:0",
    )
    with pytest.raises(SlotError, match="not made by the launcher"):
        create_ring(spec)
    with pytest.raises(SlotError, match="neither producer nor consumer"):
        attach_ring(spec, "both")
    with pytest.raises(SlotError, match="unknown slot kind"):
        attach_ring(msgspec.structs.replace(spec, kind="frames"), "producer")


def test_launcher_prepares_each_edge_by_kind(tmp_path, tiny_models):
    """A plan's edges as the launcher wires them: shared memory made for shm and pinned
    edges, nothing made but a pairing for CUDA IPC ones (the stages make those)."""
    from kvasir.config.plan import load_plan
    from kvasir.daemon.launcher import Launcher
    from kvasir.logs import setup_logging
    from kvasir.model.source import resolve_source

    path = write_plan(tmp_path, tiny_models["llama"], 'device = "cpu"', 'device = "cuda:0"', 'device = "cuda:0"')
    plan = load_plan(path)
    launcher = Launcher(
        plan, resolve_source(str(tiny_models["llama"])), tmp_path / "rt", setup_logging("error", role="test")
    )
    try:
        launcher.prepare()
        edges = launcher.layout.places[1].edges
        assert [(e.kind, e.producer, e.consumer) for e in edges] == [
            ("pinned", "cpu", "cuda:0"),
            ("cuda-ipc", "cuda:0", "cuda:0"),
        ]
        assert [r.spec.name for r in launcher.layout.rings] == [edges[0].name]  # the pinned edge's shared memory only
        assert launcher.exchange.edges == {edges[1].name: (1, 2)}
        settings = StageSettings(index=1, plan=plan, runtime_dir=str(tmp_path), launcher_pid=1, edges=edges)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(settings), type=StageSettings).edges == edges
        check_the_launcher_passes_halves_between_its_children(launcher, edges[1].name, tmp_path)
    finally:
        launcher.cleanup()
    assert not (SHM_DIR / edges[0].name).exists()


def check_the_launcher_passes_halves_between_its_children(launcher, edge: str, tmp_path) -> None:
    """Stand-in children (real processes, real command sockets): a half from a current
    child is paired and each side gets the other's; one from a replaced child is ignored."""
    import subprocess

    from kvasir.daemon.children import Child, ChildId

    inboxes = []
    for k in range(3):
        process = subprocess.Popen(["sleep", "60"])
        at = f"ipc://{tmp_path}/stage-{k}.sock"
        inboxes.append(PullChannel(launcher.sockets.bind(zmq.PULL, at), Command))
        launcher.ring.instances[0].children.append(
            Child(ChildId("stage", k), process, PushChannel[Command](launcher.sockets.connect(zmq.PUSH, at)))
        )
    pids = [c.process.pid for c in launcher.ring.stages]
    producer = msgspec.structs.replace(half(edge, "producer", 1), pid=pids[1])
    consumer = msgspec.structs.replace(half(edge, "consumer", 2, memory=True), pid=pids[2])
    launcher._note([msgspec.structs.replace(consumer, pid=12345)])  # from a child that is gone
    launcher._note([producer])
    assert not inboxes[2].socket.poll(100)
    launcher._note([consumer])
    assert inboxes[1].recv() == Command("attach", handles=(consumer,))
    assert inboxes[2].recv() == Command("attach", handles=(producer,))
    assert not inboxes[0].socket.poll(50)


def test_pinned_slots_on_a_cpu_side_are_plain_shared_memory():
    """The CPU side of a pinned edge registers nothing and reads in place (a CUDA side
    registers the same file and copies asynchronously: tests/gpu)."""
    import torch

    from kvasir.ring.gpu_slots import CudaIpcSlotRing, PinnedSlotRing

    spec = EdgeSpec(
        kind="pinned",
        name=f"kvasir-test-pinned-{os.getpid()}",
        slots=2,
        max_tokens=4,
        hidden=8,
        dtype="float32",
        producer="cpu",
        consumer="cpu",
    )
    made = create_ring(spec)
    producer, consumer = attach_ring(spec, "producer"), attach_ring(spec, "consumer")
    try:
        assert isinstance(producer, PinnedSlotRing) and producer.device is None and consumer.device is None
        boundary = torch.arange(24, dtype=torch.float32).view(3, 8)
        producer.write(1, boundary)
        assert torch.equal(consumer.read(1, 3), boundary)
        consumer.release(1)
        with pytest.raises(SlotError, match="5 tokens do not fit a 4-token slot"):
            producer.write(0, torch.zeros(5, 8))
        with pytest.raises(SlotError, match="slot 2 outside"):
            consumer.read(2, 1)
    finally:
        for ring in (producer, consumer, made):
            ring.close()
        made.unlink()
    with pytest.raises(SlotError, match="need CUDA stages on both sides"):
        CudaIpcSlotRing(msgspec.structs.replace(spec, kind="cuda-ipc", producer="cuda:0"), "producer")
