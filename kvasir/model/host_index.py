"""Per-batch index tensors (positions, cache slots, row indices), built on the host and
moved to an accelerator without making the host wait.

A blocking host-to-device copy (``tensor.to("cuda")`` from ordinary memory, or
``torch.tensor(..., device="cuda")``) synchronises: the host thread stops until the
stream's earlier work is done, and a stage loses the overlap between its host work and
its GPU work (and, through the slot events, with its neighbours'). So a batch's indices
are built on the CPU, packed into one page-locked buffer and copied with one
non-blocking copy on the stream the stage computes on; the caching host allocator keeps
the buffer until that copy has run. On a CPU stage the tensors are used as they are.
"""

from __future__ import annotations

import torch


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` (integer, on the CPU) on ``device``, in their shapes: as they are on a
    CPU device; else one pinned buffer, one non-blocking copy, split into views."""
    if device.type == "cpu" or not tensors:
        return tensors
    return unpack(pack(tensors).pin_memory().to(device, non_blocking=True), tensors)


def pack(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tensors' values, one after another, as one flat int64 tensor."""
    return torch.cat([t.reshape(-1).to(torch.long) for t in tensors])


def unpack(flat: torch.Tensor, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` in the shapes of ``like`` (the tensors ``pack`` was given)."""
    parts = flat.split([t.numel() for t in like])
    return tuple(part.view(t.shape) for part, t in zip(parts, like, strict=True))


def input_to(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """A stage's input (the head's token ids, or a boundary read from a plain shared-memory
    slot) on the stage's device, without waiting; as it is where it already is."""
    if tensor.device == device or device.type == "cpu" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
