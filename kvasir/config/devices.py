"""Devices, dtypes and edge kinds a plan may name: the tables every layer shares.

Nothing here imports torch (only when a dtype is asked for), the model loader or
transformers: reading and checking a plan stays quick for the command line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

from kvasir.errors import PlanError

if TYPE_CHECKING:
    import torch


DTYPES = ("float32", "bfloat16", "float16")  # what a plan's model.dtype may be: torch's names


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a plan's ``model.dtype`` (one of DTYPES)."""
    if name not in DTYPES:
        raise KeyError(name)
    import torch

    return getattr(torch, name)


EdgeKind = Literal["shm", "pinned", "cuda-ipc", "tcp"]  # what an edge is (kvasir/ring/edges.py picks)
EdgeRequest = Literal["auto", "cuda-ipc", "pinned", "shm"]  # what a plan may ask for
EDGE_KINDS: tuple[str, ...] = get_args(EdgeRequest)


IPC: Literal["cuda-ipc"] = "cuda-ipc"

DispatchKind = Literal["shm", "pinned", "tcp"]  # an expert shard's dispatch slot (kvasir/ring/expert_slots.py)


def dispatch_kind(stage: str, shard: str, same_host: bool = True) -> DispatchKind:
    """Host shared memory, page-locked ("pinned") where the stage or the shard is on CUDA;
    between hosts ("tcp") each side's own copy, the rows and results sent as frames."""
    if not same_host:
        return "tcp"
    return "pinned" if cuda_ordinal(stage) is not None or cuda_ordinal(shard) is not None else "shm"


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
