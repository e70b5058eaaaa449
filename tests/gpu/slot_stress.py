"""A two-process stress test of one GPU edge's slot ring (CUDA IPC or pinned slots).

The producer (the calling process) writes thousands of boundaries of random sizes into a
ring of 2 slots; the consumer (a child process, this file run as a script) reads each,
sums it on its device and returns the slot's credit. Each side's stream is held back at
random with ``torch.cuda._sleep``: the producer's before each write, the consumer's before
and after each read; one hold in twenty is longer than a GPU time slice, so the two
processes' kernels interleave even where the GPU time-slices between them. Only the ring's events keep the bytes right under those delays: the
consumer's stream waits for the producer's copy ("written"), and the producer's for the
consumer's reads ("read"; on pinned slots the consumer waits for its copy out of the slot
before it returns the credit). Every boundary holds one value, so its sum is known
exactly; the consumer's sums are compared at the end.

``broken`` runs the negative control: the same test with one wait left out (CUDA IPC: the
consumer's wait for "written"; pinned: the consumer's wait for its copy out of the slot),
which must produce wrong sums, or the test could not catch a race.

    python tests/gpu/slot_stress.py KIND DEVICE HAND_OFFS [--broken]   (prints one summary line)
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import msgspec
import torch
import zmq

from kvasir.ring.attach import attach_ring, create_ring
from kvasir.ring.gpu_slots import CudaIpcSlotRing, PinnedSlotRing
from kvasir.ring.shm import segment_prefix
from kvasir.wire.control import EdgeHandles, EdgeSpec

SLOTS, MAX_TOKENS, HIDDEN = 2, 64, 256
MAX_SLEEP = 400_000  # GPU cycles, about 0.2 ms
LONG_HOLD = 10_000_000  # about 5 ms: longer than a time slice, so the other process's kernels run meanwhile


def _hold(rng: random.Random) -> int:
    """A random hold for a stream: mostly short, one in twenty long."""
    return LONG_HOLD if rng.random() < 0.05 else rng.randrange(MAX_SLEEP)


class UnwaitedIpcSlots(CudaIpcSlotRing):
    """The negative control's CUDA IPC consumer: reads without waiting for "written"."""

    def read(self, slot: int, num_tokens: int) -> torch.Tensor:
        return self._checked(slot, num_tokens)[slot, :num_tokens]


class UnwaitedPinnedSlots(PinnedSlotRing):
    """The negative control's pinned consumer: returns the credit without waiting for its copy."""

    def release(self, slot: int) -> None:
        pass


@dataclass(frozen=True)
class Outcome:
    kind: str
    hand_offs: int
    wrong: int  # boundaries whose sum on the consumer differs from what was written
    broken: bool

    def line(self) -> str:
        what = "negative control (one wait left out)" if self.broken else "stress"
        verdict = ("caught" if self.wrong else "NOT CAUGHT") if self.broken else ("ok" if not self.wrong else "FAILED")
        return f"slot {what} over {self.kind}: {self.hand_offs} hand-offs, 2 slots, {self.wrong} wrong sums: {verdict}"


def _spec(kind: str, device: str) -> EdgeSpec:
    return EdgeSpec(
        kind=kind,
        name=f"{segment_prefix()}-stress",
        slots=SLOTS,
        max_tokens=MAX_TOKENS,
        hidden=HIDDEN,
        dtype="float32",
        producer=device,
        consumer=device,
    )


def _value(i: int) -> float:
    return float(i % 251 + 1)  # neighbouring hand-offs differ, so a stale or torn read shows


def run_stress(kind: str, device: str, hand_offs: int, broken: bool = False, seed: int = 0) -> Outcome:
    """Drive ``hand_offs`` boundaries through a fresh ring between this process and a child."""
    torch.cuda.set_device(torch.device(device))
    spec = _spec(kind, device)
    made = create_ring(spec) if kind == "pinned" else None
    ring = attach_ring(spec, "producer")
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="kvasir-stress-") as tmp:
        sock = ctx.socket(zmq.PAIR)
        sock.bind(f"ipc://{Path(tmp) / 'pair.sock'}")
        argv = [sys.executable, __file__, "--consumer", tmp, msgspec.json.encode(spec).decode(), str(hand_offs)]
        argv += [str(seed), "broken" if broken else "sound"]
        if kind == "cuda-ipc":
            argv.append(msgspec.json.encode(cast(CudaIpcSlotRing, ring).local_half(0, os.getpid())).decode())
        child = subprocess.Popen(argv)
        try:
            if kind == "cuda-ipc":
                cast(CudaIpcSlotRing, ring).attach(_receive(sock, EdgeHandles))
            expected = _produce(ring, sock, hand_offs, device, random.Random(seed))
            sums = _receive(sock, list[float])
            ring.close()  # the slots' importer lets go before their exporter exits
            sock.send(msgspec.msgpack.encode("done"))
            if child.wait(60) != 0:
                raise RuntimeError(f"the stress consumer exited with {child.returncode}")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            ring.close()
            if made is not None:
                made.close()
                made.unlink()
            sock.close(linger=0)
            ctx.term()
    wrong = sum(1 for got, want in zip(sums, expected, strict=True) if got != want)
    return Outcome(kind, hand_offs, wrong, broken)


def _receive(sock: zmq.Socket, kind, timeout_ms: int = 120_000):
    if not sock.poll(timeout_ms):
        raise RuntimeError(f"the stress consumer sent nothing within {timeout_ms / 1000:.0f} s")
    return msgspec.msgpack.decode(sock.recv(), type=kind)


def _produce(ring, sock: zmq.Socket, hand_offs: int, device: str, rng: random.Random) -> list[float]:
    """Write every boundary (after a random hold on this stream), one credit per slot reuse."""
    expected = []
    for i in range(hand_offs):
        if i >= SLOTS:
            _receive(sock, int)  # the credit of the slot about to be written again
        tokens = rng.randint(1, MAX_TOKENS)
        boundary = torch.full((tokens, HIDDEN), _value(i), device=device)
        torch.cuda._sleep(_hold(rng))
        ring.write(i % SLOTS, boundary)
        sock.send(msgspec.msgpack.encode((i % SLOTS, tokens)))
        expected.append(_value(i) * tokens * HIDDEN)
    for _ in range(min(SLOTS, hand_offs)):
        _receive(sock, int)
    return expected


def consumer_main(argv: list[str]) -> None:
    folder, spec = argv[0], msgspec.json.decode(argv[1].encode(), type=EdgeSpec)
    hand_offs, rng, broken = int(argv[2]), random.Random(int(argv[3]) + 1), argv[4] == "broken"
    device = torch.device(spec.consumer)
    torch.cuda.set_device(device)
    sound = CudaIpcSlotRing if spec.kind == "cuda-ipc" else PinnedSlotRing
    unwaited = UnwaitedIpcSlots if spec.kind == "cuda-ipc" else UnwaitedPinnedSlots
    ring = (unwaited if broken else sound)(spec, "consumer")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(f"ipc://{Path(folder) / 'pair.sock'}")
    if isinstance(ring, CudaIpcSlotRing):
        ring.attach(msgspec.json.decode(argv[5].encode(), type=EdgeHandles))
        sock.send(msgspec.msgpack.encode(ring.local_half(1, os.getpid())))
    sums = torch.zeros(hand_offs, dtype=torch.float64, device=device)
    try:
        for i in range(hand_offs):
            slot, tokens = msgspec.msgpack.decode(sock.recv(), type=tuple[int, int])
            torch.cuda._sleep(_hold(rng))  # a pinned slot's copy to the device starts late
            view = ring.read(slot, tokens)
            torch.cuda._sleep(_hold(rng))  # and the kernel reading the slot
            sums[i] = view.double().sum()
            ring.release(slot)
            sock.send(msgspec.msgpack.encode(slot))
        sock.send(msgspec.msgpack.encode(sums.tolist()))  # waits for every sum
        sock.poll(60_000)  # the producer's "done": it holds the slots no more
    finally:
        ring.close()
        sock.close(linger=1000)
        ctx.term()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--consumer"]:
        consumer_main(sys.argv[2:])
    else:
        outcome = run_stress(sys.argv[1], sys.argv[2], int(sys.argv[3]), broken="--broken" in sys.argv[4:])
        print(outcome.line())
        sys.exit(0 if bool(outcome.wrong) == outcome.broken else 1)
