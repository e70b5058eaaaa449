"""Latency statistics and goodput, as pure functions over per-request records.

Definitions (docs/architecture.md, Benchmark figures): TTFT is submission to first token; inter-token latency (ITL)
is the gap between consecutive tokens of one request; time per output token (TPOT) is a
request's mean ITL; goodput is the highest request rate at which at least ``attain`` of
the requests meet both the TTFT and the TPOT targets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvasir.units import gib_per_s


@dataclass(frozen=True)
class RequestRecord:
    """What one request measured, in seconds from its submission."""

    submitted: float  # on the bench's clock
    first_token_s: float  # TTFT
    token_times_s: tuple[float, ...]  # arrival of every output token, from submission
    output_tokens: int
    ok: bool = True  # finished (not an error or cancellation)
    handoff: tuple[int, float, float] | None = None  # disaggregated plans: KV bytes, hand-off s, copy s
    prompt_tokens: int = 0  # as the daemon counted them (finished requests)
    cached_tokens: int = 0  # of those, reused from the prefix cache
    output_ids: tuple[int, ...] = ()  # the reply's tokens (a conversation's next turn resends them)
    instance: str = ""  # the instance that served it (a disaggregated plan's: its prefill instance)
    drafts: tuple[int, int, int] | None = None  # speculative decoding: its passes, drafts checked, confirmed

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] if self.token_times_s else self.first_token_s

    @property
    def itl_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float:
        gaps = self.itl_s
        return sum(gaps) / len(gaps) if gaps else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    p50: float
    p90: float
    p99: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        mean = sum(values) / len(values) if values else math.nan
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99), mean, len(values))


def attainment(records: Sequence[RequestRecord], slo_ttft_s: float, slo_tpot_s: float) -> float:
    """Share of requests that finished and met both targets."""
    if not records:
        return 0.0
    good = sum(1 for r in records if r.ok and r.first_token_s <= slo_ttft_s and r.tpot_s <= slo_tpot_s)
    return good / len(records)


def goodput(points: Sequence[tuple[float, float]], attain: float) -> float:
    """The highest rate whose attainment reaches ``attain``, from (rate, attainment) points.

    Rates above the first failing rate do not count (a lucky run past the knee is not
    goodput); 0.0 when even the lowest rate fails.
    """
    best = 0.0
    for rate, share in sorted(points):
        if share < attain:
            break
        best = rate
    return best


def search_goodput(
    measure: Callable[[float], float], attain: float, start: float, steps: int = 3, max_moves: int = 8
) -> tuple[float, list[tuple[float, float]]]:
    """Find goodput by measuring attainment at chosen rates: from ``start``, double (or
    halve) until attainment crosses ``attain``, then bisect ``steps`` times between the
    last passing and the first failing rate. Returns (goodput, (rate, attainment) points).
    """
    points: list[tuple[float, float]] = []

    def passes(rate: float) -> bool:
        share = measure(rate)
        points.append((rate, share))
        return share >= attain

    low: float | None = None
    high: float | None = None
    rate = start
    if passes(rate):
        low = rate
        for _ in range(max_moves):
            rate *= 2
            if not passes(rate):
                high = rate
                break
            low = rate
    else:
        high = rate
        for _ in range(max_moves):
            rate /= 2
            if passes(rate):
                low = rate
                break
            high = rate
    if low is not None and high is not None:
        for _ in range(steps):
            middle = (low + high) / 2
            if passes(middle):
                low = middle
            else:
                high = middle
    return goodput(points, attain), points


@dataclass
class Summary:
    """The figures a bench run reports."""

    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft: Distribution
    itl: Distribution
    e2e: Distribution
    slo_attainment: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    drafts: dict | None = None  # speculative decoding over the requests drafted for (``draft_figures``)
    extra: dict = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def summarise(records: Sequence[RequestRecord], duration_s: float, slo: tuple[float, float] | None = None) -> Summary:
    done = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in done)
    return Summary(
        requests=len(done),
        errors=len(records) - len(done),
        duration_s=duration_s,
        output_tokens=tokens,
        requests_per_s=len(done) / duration_s if duration_s > 0 else 0.0,
        output_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        ttft=Distribution.of([r.first_token_s for r in done]),
        itl=Distribution.of([gap for r in done for gap in r.itl_s]),
        e2e=Distribution.of([r.e2e_s for r in done]),
        slo_attainment=attainment(records, *slo) if slo is not None else None,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        cached_tokens=sum(r.cached_tokens for r in done),
        drafts=draft_figures(done),
    )


def draft_figures(done: Sequence[RequestRecord]) -> dict | None:
    """Speculative decoding's part in the finished requests drafted for: their drafts
    checked and confirmed, and their tokens per pass of the model (None: no drafts)."""
    counts = [(r.output_tokens, r.drafts) for r in done if r.drafts is not None]
    if not counts:
        return None
    passes = sum(d[0] for _, d in counts)
    checked = sum(d[1] for _, d in counts)
    confirmed = sum(d[2] for _, d in counts)
    return {
        "requests": len(counts),
        "drafted": checked,
        "accepted": confirmed,
        "acceptance": confirmed / checked if checked else 0.0,
        "tokens_per_pass": sum(tokens for tokens, _ in counts) / passes if passes else 0.0,
    }


def handoff_figures(records: Sequence[RequestRecord]) -> dict | None:
    """What moving KV between pools cost the finished requests: bytes, time, bandwidth,
    and the first-to-second token gap it lands in (None when nothing was handed off)."""
    moved = [(r, r.handoff) for r in records if r.ok and r.handoff is not None]
    if not moved:
        return None
    nbytes = [handoff[0] for _, handoff in moved]
    copying = sum(handoff[2] for _, handoff in moved)
    gaps = [r.token_times_s[1] - r.token_times_s[0] for r, _ in moved if len(r.token_times_s) > 1]
    return {
        "requests": len(moved),
        "kv_bytes_mean": sum(nbytes) / len(nbytes),
        "seconds": Distribution.of([handoff[1] for _, handoff in moved]).__dict__,
        "copy_gibps": gib_per_s(sum(nbytes), copying),
        "second_token_gap": Distribution.of(gaps).__dict__,
    }
