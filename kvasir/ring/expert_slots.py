"""A stage's dispatch slot for one expert shard, in shared memory the launcher creates
(between hosts, kind ``tcp``: a copy on each side, the rows and results sent as frames).

For each MoE layer the stage writes the rows routed to the shard (their expert ids,
routing weights and hidden states) and the shard writes their partial sums back into
the same segment. A stage has one layer's rows out to a shard at a time, so one slot
per shard is enough. Layout, each part aligned for its type: ids [max_rows, top_k]
int64, weights [max_rows, top_k] float32, hidden [max_rows, hidden], out [max_rows, hidden].

Kind ``pinned`` (the stage or the shard on CUDA): each CUDA side page-locks the segment,
so its copies in and out are DMA copies without a staging buffer. A side's copies into
the slot have landed before its message goes (the other side may be a CPU process, which
cannot wait on a CUDA event); copies out of the slot are queued on the side's stream and
are done before that side writes the slot again (same stream), which is before the other
side is told it may write. Expert shards on GPUs stage through host memory this way even
when the stage is on a GPU too (CUDA IPC is for ring edges only, kvasir/ring/gpu_slots.py).
"""

from __future__ import annotations

import mmap
from typing import Any, Literal

import torch

from kvasir.config.devices import cuda_ordinal, torch_dtype
from kvasir.ring.shm import SHM_DIR, SlotError, close_map, map_file
from kvasir.ring.slots import received
from kvasir.wire.control import DispatchSlot

DispatchSide = Literal["stage", "shard"]


def _frame(tensor: torch.Tensor) -> memoryview:
    """A view of a slot's rows (contiguous: whole rows from the start) as bytes, no copy."""
    array: Any = tensor.view(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def dispatch_slot_bytes(max_rows: int, hidden: int, top_k: int, itemsize: int) -> int:
    return max_rows * top_k * (8 + 4) + 2 * max_rows * hidden * itemsize


class DispatchSegment:
    """The slot mapped as tensors: ``create`` on the launcher's side; ``side`` (stage or
    shard) where it is used, which page-locks it there when that side is on CUDA."""

    def __init__(self, spec: DispatchSlot, create: bool, side: DispatchSide | None = None) -> None:
        self.spec = spec
        self.path = SHM_DIR / spec.name
        dtype = torch_dtype(spec.dtype)
        size = dispatch_slot_bytes(spec.max_rows, spec.hidden, spec.top_k, dtype.itemsize)
        device = spec.stage_device if side == "stage" else spec.shard_device if side == "shard" else "cpu"
        self._map: mmap.mmap | None = None
        if spec.kind == "tcp":  # between hosts: this side's own copy (page-locked on a CUDA side)
            raw = torch.zeros(size, dtype=torch.uint8)
            raw = raw.pin_memory() if cuda_ordinal(device) is not None else raw
        else:
            self._map = map_file(self.path, size, create)
            raw = torch.frombuffer(self._map, dtype=torch.uint8)
        rows, k, h = spec.max_rows, spec.top_k, spec.hidden
        ids_end = rows * k * 8
        weights_end = ids_end + rows * k * 4
        hidden_end = weights_end + rows * h * dtype.itemsize
        self.ids = raw[:ids_end].view(torch.int64).view(rows, k)
        self.weights = raw[ids_end:weights_end].view(torch.float32).view(rows, k)
        self.hidden = raw[weights_end:hidden_end].view(dtype).view(rows, h)
        self.out = raw[hidden_end:].view(dtype).view(rows, h)
        self._registered: int | None = None
        self._landed: torch.cuda.Event | None = None
        if spec.kind == "tcp" and cuda_ordinal(device) is not None:
            self._landed = torch.cuda.Event(blocking=True)  # waits sleep, not spin
        if spec.kind == "pinned" and cuda_ordinal(device) is not None:
            from kvasir.ring.gpu_slots import register_host

            self._registered = register_host(raw.data_ptr(), size, f"dispatch slot {spec.name}")
            self._landed = torch.cuda.Event(blocking=True)

    def check(self, rows: int) -> None:
        if not 0 < rows <= self.spec.max_rows:
            raise SlotError(f"dispatch slot {self.spec.name}: {rows} rows, it holds 1 to {self.spec.max_rows}")

    # -- the stage's side -----------------------------------------------------------------
    def write_rows(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        rows = hidden.shape[0]
        self.check(rows)
        pinned = self._landed is not None
        self.ids[:rows].copy_(ids, non_blocking=pinned)
        self.weights[:rows].copy_(weights, non_blocking=pinned)
        self.hidden[:rows].copy_(hidden, non_blocking=pinned)
        self._settle(hidden.device)

    def read_out(self, rows: int, device: torch.device) -> torch.Tensor:
        """The shard's partial sums for ``rows`` rows, on ``device`` (on CPU: a view of the slot)."""
        return self.out[:rows].to(device, non_blocking=self._landed is not None)

    # -- the shard's side -----------------------------------------------------------------
    def read_rows(
        self, rows: int, device: torch.device, weights_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dispatched rows' hidden states, expert ids and routing weights on ``device``."""
        pinned = self._landed is not None
        hidden = self.hidden[:rows].to(device, non_blocking=pinned)
        ids = self.ids[:rows].to(device, non_blocking=pinned)
        return hidden, ids, self.weights[:rows].to(device, weights_dtype, non_blocking=pinned)

    def write_out(self, out: torch.Tensor) -> None:
        self.out[: out.shape[0]].copy_(out, non_blocking=self._landed is not None)
        self._settle(out.device)

    def _settle(self, device: torch.device) -> None:
        """Wait until this side's copies into the slot have landed (CUDA sides only)."""
        if self._landed is not None and device.type == "cuda":
            self._landed.record(torch.cuda.current_stream(device))
            self._landed.synchronize()

    # -- between hosts (kind tcp): the rows and the results travel as frames -------------
    def row_frames(self, rows: int) -> list[memoryview]:
        """The stage's side: the rows it wrote, as frames to send after the work."""
        return [_frame(part[:rows]) for part in (self.ids, self.weights, self.hidden)]

    def fill_rows(self, rows: int, frames: list) -> None:
        """The shard's side: the frames that came with the work, into this side's copy."""
        self._fill([self.ids, self.weights, self.hidden], rows, frames)

    def out_frame(self, rows: int) -> memoryview:
        return _frame(self.out[:rows])

    def fill_out(self, rows: int, frames: list) -> None:
        """The stage's side: the shard's partial sums, into this side's copy."""
        self._fill([self.out], rows, frames)

    def _fill(self, parts: list[torch.Tensor], rows: int, frames: list) -> None:
        self.check(rows)
        sizes = [part[:rows].nbytes for part in parts]
        got = [memoryview(frame).nbytes for frame in frames]
        if got != sizes:
            raise SlotError(f"dispatch slot {self.spec.name}: frames of {got} bytes for {rows} rows, expected {sizes}")
        for part, frame in zip(parts, frames, strict=True):
            part[:rows].view(-1).view(torch.uint8).copy_(received(frame))

    def close(self) -> None:
        registered, self._registered = self._registered, None
        try:
            if registered is not None:
                from kvasir.ring.gpu_slots import unregister_host

                unregister_host(registered, f"dispatch slot {self.spec.name}")
        finally:
            self.ids = self.weights = self.hidden = self.out = None  # type: ignore[assignment]
            if self._map is not None:
                close_map(self._map)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
