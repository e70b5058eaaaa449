"""Where a worker process runs (a stage or an expert shard): its device, torch threads
and CPUs, checked the same way for both."""

from __future__ import annotations

import re

from kvasir.errors import PlanError

_DEVICE_RE = re.compile(r"^(cpu|cuda(:(0|[1-9][0-9]*))?)$")


def positive(key: str, value: int) -> None:
    if value <= 0:
        raise PlanError(f"{key} must be a positive integer, got {value}")


def check_solo_threads(key: str, threads: int, solo: int | None) -> None:
    """A stage's threads for a batch alone in the ring: at least its usual ``threads``."""
    if solo is not None and solo < threads:
        raise PlanError(
            f"{key}.solo_threads = {solo} is below {key}.threads = {threads}: a batch alone in the ring "
            "runs with at least the stage's usual threads"
        )


def check_placement(key: str, device: str, threads: int, cpus: tuple[int, ...] | None) -> None:
    """``key``: the worker's table, e.g. ``stages[1]`` or ``stages[1].experts[0]``."""
    if not _DEVICE_RE.match(device):
        raise PlanError(f"{key}.device = {device!r} is not a device (use 'cpu', 'cuda' or 'cuda:N')")
    positive(f"{key}.threads", threads)
    if cpus is not None:
        if not cpus:
            raise PlanError(f"{key}.cpus is empty: list at least one CPU or leave the key out")
        if any(c < 0 for c in cpus) or len(set(cpus)) != len(cpus):
            raise PlanError(f"{key}.cpus = {list(cpus)} must be distinct non-negative CPU numbers")
