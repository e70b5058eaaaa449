"""Pinning a worker process (a stage or an expert shard) to what its plan entry says:
torch threads, CPU affinity and CUDA device, once at start."""

from __future__ import annotations

import os

import torch

from kvasir.config.devices import cuda_ordinal


def pin_process(device: str, threads: int, cpus: tuple[int, ...] | None) -> None:
    torch.set_num_threads(threads)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    ordinal = cuda_ordinal(device)
    if ordinal is not None:
        torch.cuda.set_device(ordinal)  # once, before anything touches CUDA: plain "cuda" is device 0
