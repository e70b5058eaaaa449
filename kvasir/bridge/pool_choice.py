"""Whether an instance reads a prefix from another host's pool or computes it: the
predicted fetch time (each fetching stage's bytes over its measured rate from other
hosts, added up: the stages read in turn, as the load's descriptor travels the ring)
against the predicted compute time: the tokens at the instance's measured seconds per
computed prompt token (from a request's first batch to its first token, for requests that
computed at least ``MIN_PREFILL_TOKENS`` and read nothing from the pool; a moving
average), or before any such request at its slowest stage's tokens per busy second
(which overstates how fast one prompt goes through a pipeline). Until a stage has
fetched, the fetch is tried, which measures it.

Reading from the instance's own host (memory, or disk in the page cache) is always
taken: on every machine measured it is an order of magnitude faster than computing
(docs/bench/kvpool.md). Policy only: the rates come from the stages' reports
and the requests' first tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvasir.units import GIB

MIN_MEASURED_S = 0.05  # seconds of fetching or computing before a rate counts
MIN_PREFILL_TOKENS = 256  # prompt tokens computed before a request's first token counts
WEIGHT = 0.3  # of the newest request in the moving average of seconds per prompt token


@dataclass(frozen=True)
class Fetch:
    """One stage's part of a read from another host."""

    stage: int  # global index
    blocks: int  # blocks it would fetch
    layer_share: float  # its layers over the model's


@dataclass
class Rates:
    """What the stages last reported: (bytes, seconds) fetched from other hosts, and
    (tokens, busy seconds) run, each since the stage started; and per instance, its
    moving average of seconds per computed prompt token."""

    fetched: dict[int, tuple[int, float]] = field(default_factory=dict)
    ran: dict[int, tuple[int, float]] = field(default_factory=dict)
    per_token_s: dict[str, float] = field(default_factory=dict)

    def prefilled(self, instance: str, tokens: int, seconds: float) -> None:
        if tokens < MIN_PREFILL_TOKENS or not seconds > 0:
            return
        last = self.per_token_s.get(instance)
        now = seconds / tokens
        self.per_token_s[instance] = now if last is None else WEIGHT * now + (1 - WEIGHT) * last

    def fetch_gib_s(self, stage: int) -> float | None:
        nbytes, seconds = self.fetched.get(stage, (0, 0.0))
        return nbytes / GIB / seconds if seconds >= MIN_MEASURED_S else None

    def compute_s(self, tokens: int, instance: str, stages: Sequence[int]) -> tuple[float, str] | None:
        """Seconds to compute ``tokens`` on ``instance`` (whose stages are ``stages``), and from what."""
        per_token = self.per_token_s.get(instance)
        if per_token is not None:
            return tokens * per_token, f"{1 / per_token:.0f} tokens/s measured on its prompts"
        rates = [t / s for t, s in (self.ran.get(k, (0, 0.0)) for k in stages) if s >= MIN_MEASURED_S]
        if len(rates) != len(stages) or not rates:
            return None
        return tokens / min(rates), f"{min(rates):.0f} tokens/s, its slowest stage's"


def worth_fetching(
    fetches: Sequence[Fetch], tokens: int, block_bytes: int, instance: str, stages: Sequence[int], rates: Rates
) -> tuple[bool, str]:
    """Whether to fetch ``tokens`` prompt tokens (``block_bytes``: one block's K/V over
    every layer) rather than compute them on ``instance`` (its ``stages``); and why, in words."""
    times = []
    for fetch in fetches:
        rate = rates.fetch_gib_s(fetch.stage)
        if rate is None:
            return True, f"{tokens} tokens from another host's pool (no fetch measured yet)"
        times.append(fetch.blocks * block_bytes * fetch.layer_share / GIB / rate)
    fetch_s = sum(times)
    compute = rates.compute_s(tokens, instance, stages)
    if compute is None:
        return True, f"{tokens} tokens from another host's pool (predicted {fetch_s:.3f} s; no compute measured yet)"
    compute_s, basis = compute
    verdict = fetch_s <= compute_s
    return verdict, (
        f"{tokens} tokens {'fetched' if verdict else 'computed'}: fetching from another host's pool "
        f"predicted {fetch_s:.3f} s, computing {compute_s:.3f} s at {basis}"
    )
