"""``kvasir bench hop``: the cost of one stage-to-stage hand-off, next to the raw limits.

A producer (this process) and a consumer (a child process) use the stage agent's own
edge classes, ``DownstreamOutlet`` and ``UpstreamIntake``, over a one-slot ring: one
hand-off is writing the boundary into the slot, sending the descriptor, the consumer
taking the boundary (in place) and returning the credit, and the producer receiving it.
Beside it, in the same run: the bare copy into the slot, and a raw ZMQ ipc message round
trip between the same two processes.

On "cpu" the ring is shared memory. On "cuda:N" both processes use that GPU and the ring
is CUDA IPC slots (the two sides swap their handles once, as stages do at start-up); the
consumer waits for the boundary to be on its device before returning the credit, so a
hand-off there is end to end. With link "tcp" the edge is the one between two hosts
(kvasir/ring/tcp_slots.py: the boundary as a frame after its descriptor), over loopback
TCP with CURVE and two throwaway host key pairs, and so are the round trips.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal, cast

import msgspec
import torch
import zmq

from kvasir.bench.daemon import free_ports
from kvasir.config.keys import generate as generate_keys
from kvasir.ring.attach import attach_ring, create_ring
from kvasir.ring.handshake import IpcRing
from kvasir.ring.shm import segment_prefix
from kvasir.ring.slots import ShmSlotRing, SlotRing
from kvasir.ring.tcp_slots import FramedDescriptors, FramedIntake, TcpSlotRing
from kvasir.stage.outlets import DownstreamOutlet
from kvasir.stage.upstream import UpstreamIntake
from kvasir.transport.channels import PullChannel, PushChannel, make_socket
from kvasir.transport.curve import Fabric, HostKeys, end_context
from kvasir.units import KIB, gib_per_s
from kvasir.wire.batch import BatchDescriptor, Credit, Row
from kvasir.wire.control import EdgeHandles, EdgeSpec
from kvasir.wire.decoding import decode, decode_json

SIZES = (1, 16, 128, 512)  # boundary tokens
HIDDEN = 576  # SmolLM2-135M's hidden size
PING = b"p" * 64
HopLink = Literal["local", "tcp"]  # a local edge (shared memory or CUDA IPC), or one between hosts


def _edge(device: str, link: HopLink) -> EdgeSpec:
    return EdgeSpec(
        kind="tcp" if link == "tcp" else "shm" if device == "cpu" else "cuda-ipc",
        name=f"{segment_prefix()}-hop",
        slots=1,
        max_tokens=max(SIZES),
        hidden=HIDDEN,
        dtype="float32",
        producer=device,
        consumer=device,
    )


def _endpoints(folder: Path, link: HopLink) -> tuple[str, str, str]:
    if link == "tcp":
        return cast(tuple[str, str, str], tuple(f"tcp://127.0.0.1:{port}" for port in free_ports(3)))
    return (f"ipc://{folder / 'descriptors.sock'}", f"ipc://{folder / 'credits.sock'}", f"ipc://{folder / 'ping.sock'}")


def _fabric(folder: Path, side: str, ends: tuple[str, str, str]) -> Fabric | None:
    """The CURVE set-up of one side of a tcp hop (None for a local one)."""
    if not ends[0].startswith("tcp://"):
        return None
    descriptors_at, credits_at, ping_at = ends
    owners = {descriptors_at: "consumer", credits_at: "producer", ping_at: "consumer"}
    return Fabric(owners, HostKeys.load(folder, side, ["producer", "consumer"]), "producer", frozenset())


def consumer_main(argv: list[str]) -> None:
    """The child: echo pings, take boundaries and return credits until told to stop."""
    folder, edge = Path(argv[0]), decode_json(argv[1].encode(), EdgeSpec)
    ends = cast(tuple[str, str, str], tuple(decode_json(argv[2].encode(), list[str])))
    descriptors_at, credits_at, ping_at = ends
    torch.set_num_threads(1)
    cuda = edge.kind == "cuda-ipc"
    if cuda:
        torch.cuda.set_device(torch.device(edge.consumer))
    ctx = zmq.Context()
    fabric = _fabric(folder, "consumer", ends)
    auth = fabric.authenticator(ctx) if fabric is not None else None
    ring = attach_ring(edge, "consumer")
    pings = make_socket(ctx, zmq.PULL, bind=ping_at, fabric=fabric)
    credits = make_socket(ctx, zmq.PUSH, connect=credits_at, fabric=fabric)
    if cuda:  # the producer's half came with the arguments; ours goes back first thing
        ipc = cast(IpcRing, ring)  # a cuda-ipc edge's ring
        ipc.attach(decode_json(argv[3].encode(), EdgeHandles))
        credits.send(msgspec.msgpack.encode(ipc.local_half(1, os.getpid())))
    inbox = make_socket(ctx, zmq.PULL, bind=descriptors_at, fabric=fabric)
    descriptors: Any = (
        FramedIntake(inbox, cast(TcpSlotRing, ring))
        if edge.kind == "tcp"
        else PullChannel[BatchDescriptor](inbox, BatchDescriptor)
    )
    intake = UpstreamIntake(descriptors, ring, PushChannel[Credit](credits))
    poller = zmq.Poller()
    poller.register(pings, zmq.POLLIN)
    poller.register(inbox, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll())
            if pings in ready:
                frame = pings.recv()
                if frame == b"stop":
                    return
                credits.send(frame)
            if inbox in ready:
                intake.receive()
                while (work := intake.take(True)) is not None:
                    if cuda:
                        torch.cuda.current_stream().synchronize()  # the boundary is on this device
                    intake.consumed(work[0])
    finally:
        ring.close()
        end_context(ctx, [pings, credits, inbox], auth)


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1e3


def hop_report(iterations: int = 400, device: str = "cpu", link: HopLink = "local") -> dict:
    """Measure the bare copy into a slot, the ZMQ round trip and the hand-off per size."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvasir-hop-") as tmp:
        folder = Path(tmp)
        edge = _edge(device, link)
        ends = _endpoints(folder, link)
        if link == "tcp":
            generate_keys(folder, [], ["producer", "consumer"])
        argv = [sys.executable, "-m", "kvasir.bench.hop", str(folder), msgspec.json.encode(edge).decode()]
        argv.append(msgspec.json.encode(list(ends)).decode())
        ring: SlotRing
        ipc: IpcRing | None = None
        if edge.kind == "shm":
            ring = create_ring(edge)
        elif edge.kind == "tcp":
            ring = attach_ring(edge, "producer")
        else:
            torch.cuda.set_device(torch.device(device))
            ring = attach_ring(edge, "producer")
            ipc = cast(IpcRing, ring)  # a cuda-ipc edge's ring
            argv.append(msgspec.json.encode(ipc.local_half(0, os.getpid())).decode())
        ctx = zmq.Context()
        fabric = _fabric(folder, "producer", ends)
        auth = fabric.authenticator(ctx) if fabric is not None else None
        descriptors_at, credits_at, ping_at = ends
        credits = make_socket(ctx, zmq.PULL, bind=credits_at, fabric=fabric)
        opened = [credits]
        child = subprocess.Popen(argv)
        try:
            if ipc is not None:
                if not credits.poll(120_000):
                    raise RuntimeError("the hop consumer sent no CUDA IPC handles within 120 s")
                ipc.attach(decode(credits.recv(), EdgeHandles))
            pings = make_socket(ctx, zmq.PUSH, connect=ping_at, fabric=fabric)
            out = make_socket(ctx, zmq.PUSH, connect=descriptors_at, fabric=fabric)
            opened += [pings, out]
            descriptors: Any = (
                FramedDescriptors(out, cast(TcpSlotRing, ring)) if link == "tcp" else PushChannel[BatchDescriptor](out)
            )
            outlet = DownstreamOutlet(descriptors, ring, PullChannel[Credit](credits, Credit), slots=1)
            report = _measure(outlet, pings, credits, ring, iterations, device)
            report["link"] = link
            pings.send(b"stop")
            child.wait(30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            ring.close()
            if isinstance(ring, ShmSlotRing):  # the cpu edge's shared memory, made here
                ring.unlink()
            end_context(ctx, opened, auth)
    return report


def _measure(outlet: DownstreamOutlet, pings, credits, ring, iterations: int, device: str) -> dict:
    """Per size: back-to-back copies into the slot (the copy limit), then hand-offs
    alternating with raw round trips (so the machine's drift touches both alike); medians."""
    cuda = device != "cpu"
    poller = zmq.Poller()
    poller.register(credits, zmq.POLLIN)

    def round_trip() -> int:
        started = time.perf_counter_ns()
        pings.send(PING)
        credits.recv()
        return time.perf_counter_ns() - started

    def hand_off(i: int, boundary: torch.Tensor) -> int:
        tokens = boundary.shape[0]
        rows = (Row(request_id=1, start=0, num_tokens=tokens, new_blocks=(), emit=True),)
        descriptor = BatchDescriptor(i, -1, tokens, rows, (), (), time.monotonic_ns())
        started = time.perf_counter_ns()
        outlet.emit(descriptor, boundary)
        while not outlet.credits.available:
            poller.poll(1000)
            outlet.receive()
        return time.perf_counter_ns() - started

    warm = 20
    sizes = []
    for tokens in SIZES:
        boundary = torch.randn(tokens, HIDDEN, device=device)
        copies, hops, trips = [], [], []
        for _ in range(iterations + warm):  # the raw copy, back to back
            started = time.perf_counter_ns()
            ring.write(0, boundary)
            if cuda:
                torch.cuda.synchronize()
            copies.append(time.perf_counter_ns() - started)
        for i in range(iterations + warm):
            hops.append(hand_off(i, boundary))
            trips.append(round_trip())
        nbytes = boundary.numel() * boundary.element_size()
        copy_us, hop_us, rtt_us = (_median_us(x[warm:]) for x in (copies, hops, trips))
        sizes.append(
            {
                "tokens": tokens,
                "bytes": nbytes,
                "memcpy_us": copy_us,
                "memcpy_gibps": gib_per_s(nbytes, copy_us * 1e-6),
                "zmq_rtt_us": rtt_us,
                "hop_us": hop_us,
                "hop_over_zmq_rtt": hop_us / rtt_us,
            }
        )
    return {
        "hidden": HIDDEN,
        "dtype": "float32",
        "iterations": iterations,
        "device": device,
        "kind": ring.spec.kind,
        "sizes": sizes,
    }


def print_hop(report: dict, echo) -> None:
    echo(
        f"medians of {report['iterations']} samples each; hand-offs alternate with 64-byte ZMQ "
        f"{'tcp (CURVE, loopback)' if report['kind'] == 'tcp' else 'ipc'} round trips; "
        f"{report['kind']} slots on {report['device']}"
    )
    echo(
        f"boundary (float32 x 576)   copy into {report['kind']:<8}     ZMQ round trip   one hand-off   hand-off / round trip"
    )
    for s in report["sizes"]:
        echo(
            f"{s['tokens']:5d} tokens {s['bytes'] / KIB:9.1f} KiB  {s['memcpy_us']:7.1f} us {s['memcpy_gibps']:6.2f} GiB/s"
            f"   {s['zmq_rtt_us']:8.1f} us   {s['hop_us']:8.1f} us   {s['hop_over_zmq_rtt']:6.2f}x"
        )


if __name__ == "__main__":
    consumer_main(sys.argv[1:])
