"""Which slot ring each stage-to-stage edge uses, and the start-up exchange of CUDA IPC handles.

Kinds (docs/architecture.md, Edge kinds):
    shm       POSIX shared memory (CPU stages; works for any pair, through pageable memory)
    pinned    the same shared memory, registered as page-locked with CUDA by each GPU
              side, so copies to and from the device are DMA copies that need no staging
    cuda-ipc  slot buffers on the consumer's GPU that the producer opens through CUDA IPC;
              interprocess CUDA events order each write before its read, and each read
              before the slot is written again
    tcp       between stages on different hosts of a plan with [cluster] (ZMQ over TCP
              with CURVE: the descriptor, then the boundary as a zero-copy frame;
              kvasir/ring/tcp_slots.py)

A stage's ``edge`` key picks the kind of the edge from it to the next stage. ``auto`` (the
default) picks CUDA IPC between two GPU stages (one GPU, or two that have peer access),
pinned memory where one side is a GPU (or two GPUs without peer access), and shared
memory between CPU stages.

The CUDA IPC handles are exchanged at start-up (kvasir/ring/handshake.py). Nothing here
imports torch at module level (the plan checks use it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

from kvasir.config.devices import IPC, EdgeRequest, cuda_ordinal


@dataclass(frozen=True)
class EdgeChoice:
    kind: EdgeRequest | Literal["tcp"]  # "auto" while undecided (peer access unknown here)
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
            if peer_access is not None and a is not None and b is not None and not peer_access(a, b):
                reason = f"as the plan says; {producer} has no peer access to {consumer}, so the driver copies through host memory"
        return EdgeChoice(cast(EdgeRequest, requested), reason)  # check_edge_request checked it
    if a is None and b is None:
        return EdgeChoice("shm", "both stages on cpu")
    if a is None or b is None:
        return EdgeChoice("pinned", f"{producer} to {consumer}: page-locked shared memory")
    if a == b:
        return EdgeChoice(IPC, f"both stages on {producer}")
    if peer_access is None:
        return EdgeChoice(
            "auto", f"cuda-ipc if {producer} has peer access to {consumer}, else pinned (decided at start)"
        )
    if peer_access(a, b):
        return EdgeChoice(IPC, f"{producer} has peer access to {consumer}")
    return EdgeChoice("pinned", f"{producer} has no peer access to {consumer}: staged through page-locked memory")


def pool_edges(
    stages, peer_access: Callable[[int, int], bool] | None, hosts: list[str | None] | None = None
) -> list[EdgeChoice]:
    """The choice for each edge of one pipeline (``stages``: a pool's StageSpecs, in order;
    ``hosts``: where each runs, None for a plan on one machine). Between hosts: tcp."""
    where = hosts or [None] * len(stages)
    return [
        EdgeChoice("tcp", f"stages on hosts {where[k]} and {where[k + 1]}")
        if where[k] != where[k + 1]
        else choose_edge(s.edge, s.device, nxt.device, peer_access)
        for k, (s, nxt) in enumerate(zip(stages, stages[1:]))
    ]


def torch_peer_access(stages) -> Callable[[int, int], bool] | None:
    """CUDA's peer-access query where ``stages`` has GPU stages and CUDA is present, else
    None (torch is imported only for plans with CUDA stages)."""
    if all(cuda_ordinal(stage.device) is None for stage in stages):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.can_device_access_peer
