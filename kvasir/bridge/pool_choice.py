"""Whether an instance reads a prefix from another host's pool or computes it: the
predicted fetch time (each fetching stage's bytes over its measured rate from other
hosts, added up: the stages read in turn, as the load's descriptor travels the ring)
against the predicted compute time
(the tokens over the instance's measured rate: its slowest stage's tokens per busy
second). Until a rate has been measured the fetch is tried, which measures it.

Reading from the instance's own host (memory, or disk in the page cache) is always
taken: on every machine measured it is an order of magnitude faster than computing
(BENCHMARKS.md, "The KV pool"). Policy only: the rates come from the stages' reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvasir.units import GIB

MIN_MEASURED_S = 0.05  # seconds of fetching or computing before a rate counts


@dataclass(frozen=True)
class Fetch:
    """One stage's part of a read from another host."""

    stage: int  # global index
    blocks: int  # blocks it would fetch
    layer_share: float  # its layers over the model's


@dataclass
class Rates:
    """What the stages last reported: (bytes, seconds) fetched from other hosts, and
    (tokens, busy seconds) run, each since the stage started."""

    fetched: dict[int, tuple[int, float]]
    ran: dict[int, tuple[int, float]]

    def fetch_gib_s(self, stage: int) -> float | None:
        nbytes, seconds = self.fetched.get(stage, (0, 0.0))
        return nbytes / GIB / seconds if seconds >= MIN_MEASURED_S else None

    def tokens_s(self, stages: Sequence[int]) -> float | None:
        rates = [t / s for t, s in (self.ran.get(k, (0, 0.0)) for k in stages) if s >= MIN_MEASURED_S]
        return min(rates) if len(rates) == len(stages) and rates else None


def worth_fetching(
    fetches: Sequence[Fetch], tokens: int, block_bytes: int, instance: Sequence[int], rates: Rates
) -> tuple[bool, str]:
    """Whether to fetch ``tokens`` prompt tokens (``block_bytes``: one block's K/V over
    every layer) rather than compute them on the stages ``instance``; and why, in words."""
    times = []
    for fetch in fetches:
        rate = rates.fetch_gib_s(fetch.stage)
        if rate is None:
            return True, f"{tokens} tokens from another host's pool (no fetch measured yet)"
        times.append(fetch.blocks * block_bytes * fetch.layer_share / GIB / rate)
    fetch_s = sum(times)
    speed = rates.tokens_s(instance)
    if speed is None:
        return True, f"{tokens} tokens from another host's pool (predicted {fetch_s:.3f} s; no compute measured yet)"
    compute_s = tokens / speed
    verdict = fetch_s <= compute_s
    action = "fetched" if verdict else "computed"
    return verdict, (
        f"{tokens} tokens {action}: fetching from another host's pool predicted {fetch_s:.3f} s, "
        f"computing {compute_s:.3f} s at {speed:.0f} tokens/s"
    )
