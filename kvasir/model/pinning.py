"""Pinning a worker process (a stage or an expert shard) to what its plan entry says:
torch threads, CPU affinity and CUDA device, once at start; and a stage's threads
following the head's mark on each batch (``Threads``)."""

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


class Threads:
    """A stage's torch intra-op threads per batch: the plan's ``threads``, or its
    ``solo_threads`` for a batch the head fixed while no other was in flight. One batch
    alone in a ring runs one stage at a time (a lone request's every token does), so the
    cores the other stages use under load are idle and this stage may take them."""

    def __init__(self, threads: int, solo: int | None) -> None:
        self.usual = threads
        self.solo = threads if solo is None else solo
        self._now = threads  # what pin_process set

    def follow(self, solo: bool) -> None:
        wanted = self.solo if solo else self.usual
        if wanted != self._now:
            torch.set_num_threads(wanted)
            self._now = wanted
