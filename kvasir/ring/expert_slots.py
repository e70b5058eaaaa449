"""A stage's dispatch slot for one expert shard, in shared memory the launcher creates.

For each MoE layer the stage writes the rows routed to the shard (their expert ids,
routing weights and hidden states) and the shard writes their partial sums back into
the same segment. A stage has one layer's rows out to a shard at a time, so one slot
per shard is enough. Layout, each part aligned for its type: ids [max_rows, top_k]
int64, weights [max_rows, top_k] float32, hidden [max_rows, hidden], out [max_rows, hidden].
"""

from __future__ import annotations

import torch

from kvasir.config.devices import torch_dtype
from kvasir.ring.shm import SHM_DIR, SlotError, close_map, map_file
from kvasir.wire.control import DispatchSlot


def dispatch_slot_bytes(max_rows: int, hidden: int, top_k: int, itemsize: int) -> int:
    return max_rows * top_k * (8 + 4) + 2 * max_rows * hidden * itemsize


class DispatchSegment:
    """The slot mapped as tensors; ``create`` on the launcher's side."""

    def __init__(self, spec: DispatchSlot, create: bool) -> None:
        self.spec = spec
        self.path = SHM_DIR / spec.name
        dtype = torch_dtype(spec.dtype)
        size = dispatch_slot_bytes(spec.max_rows, spec.hidden, spec.top_k, dtype.itemsize)
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

    def check(self, rows: int) -> None:
        if not 0 < rows <= self.spec.max_rows:
            raise SlotError(f"dispatch slot {self.spec.name}: {rows} rows, it holds 1 to {self.spec.max_rows}")

    def write_rows(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        rows = hidden.shape[0]
        self.check(rows)
        self.ids[:rows].copy_(ids)
        self.weights[:rows].copy_(weights)
        self.hidden[:rows].copy_(hidden)

    def close(self) -> None:
        self.ids = self.weights = self.hidden = self.out = None  # type: ignore[assignment]
        close_map(self._map)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
