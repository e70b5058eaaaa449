"""Which slot ring each stage-to-stage edge uses, and the start-up exchange of CUDA IPC handles.

Kinds (DESIGN.md section 4):
    shm       POSIX shared memory (CPU stages; works for any pair, through pageable memory)
    pinned    the same shared memory, registered as page-locked with CUDA by each GPU
              side, so copies to and from the device are DMA copies that need no staging
    cuda-ipc  slot buffers on the consumer's GPU that the producer opens through CUDA IPC;
              interprocess CUDA events order each write before its read, and each read
              before the slot is written again

A stage's ``edge`` key picks the kind of the edge from it to the next stage. ``auto`` (the
default) picks CUDA IPC between two GPU stages (one GPU, or two that have peer access),
pinned memory where one side is a GPU (or two GPUs without peer access), and shared
memory between CPU stages.

The CUDA IPC handles are exchanged at start-up (kvasir/handshake.py). Nothing here
imports torch at module level (the plan checks use it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvasir.errors import PlanError

EDGE_KINDS = ("auto", "cuda-ipc", "pinned", "shm")
IPC = "cuda-ipc"


def cuda_ordinal(device: str) -> int | None:
    """The CUDA device number of "cuda" / "cuda:N" (plain "cuda" is device 0); None for "cpu"."""
    if not device.startswith("cuda"):
        return None
    return int(device.partition(":")[2] or 0)


def check_edge_request(key: str, requested: str | None, producer: str, consumer: str | None) -> None:
    """Model- and host-independent checks of a stage's ``edge`` key (PlanError, one line).

    ``consumer`` is the next stage's device, None on a pool's last stage.
    """
    if requested is None:
        return
    if requested not in EDGE_KINDS:
        raise PlanError(f"{key}.edge = {requested!r} is not an edge kind (use {', '.join(EDGE_KINDS)})")
    if consumer is None:
        raise PlanError(f"{key}.edge: the last stage of a pipeline has no edge to a next stage (leave the key out)")
    gpus = sum(cuda_ordinal(d) is not None for d in (producer, consumer))
    if requested == IPC and gpus < 2:
        raise PlanError(
            f"{key}.edge = 'cuda-ipc' needs CUDA devices on both sides (this stage is on {producer}, the next on {consumer})"
        )
    if requested == "pinned" and gpus == 0:
        raise PlanError(
            f"{key}.edge = 'pinned' needs a CUDA device on at least one side (both stages are on cpu): use 'shm'"
        )


@dataclass(frozen=True)
class EdgeChoice:
    kind: str  # shm | pinned | cuda-ipc; "auto" while undecided (peer access unknown here)
    reason: str


def choose_edge(
    requested: str | None, producer: str, consumer: str, peer_access: Callable[[int, int], bool] | None
) -> EdgeChoice:
    """The slot kind of the edge from a stage on ``producer`` to one on ``consumer``.

    ``peer_access(a, b)``: can device a reach device b's memory (None where there is no
    CUDA to ask: the choice between two GPUs then stays "auto" until the daemon starts).
    Explicit kinds were checked by ``check_edge_request``.
    """
    a, b = cuda_ordinal(producer), cuda_ordinal(consumer)
    if requested not in (None, "auto"):
        reason = "as the plan says"
        if requested == IPC and a != b:
            if peer_access is not None and not peer_access(a, b):
                reason = f"as the plan says; {producer} has no peer access to {consumer}, so the driver copies through host memory"
        return EdgeChoice(requested, reason)
    if a is None and b is None:
        return EdgeChoice("shm", "both stages on cpu")
    if a is None or b is None:
        return EdgeChoice("pinned", f"{producer} to {consumer}: page-locked shared memory")
    if a == b:
        return EdgeChoice(IPC, f"both stages on {producer}")
    if peer_access is None:
        return EdgeChoice("auto", f"cuda-ipc if {producer} has peer access to {consumer}, else pinned (decided at start)")
    if peer_access(a, b):
        return EdgeChoice(IPC, f"{producer} has peer access to {consumer}")
    return EdgeChoice("pinned", f"{producer} has no peer access to {consumer}: staged through page-locked memory")


def pool_edges(stages, peer_access: Callable[[int, int], bool] | None) -> list[EdgeChoice]:
    """The choice for each edge of one pipeline (``stages``: a pool's StageSpecs, in order)."""
    return [choose_edge(s.edge, s.device, nxt.device, peer_access) for s, nxt in zip(stages, stages[1:])]


def torch_peer_access(stages) -> Callable[[int, int], bool] | None:
    """CUDA's peer-access query where ``stages`` has GPU stages and CUDA is present, else
    None (torch is imported only for plans with CUDA stages)."""
    if all(cuda_ordinal(stage.device) is None for stage in stages):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.can_device_access_peer
