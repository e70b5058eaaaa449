"""The bridge's request metrics: latency histograms and counters over every request since
start (kvasir/wire/client.py, RequestMetrics). Bucket bounds are vLLM's, so dashboards
made for it read Kvasir's the same way."""

from __future__ import annotations

from bisect import bisect_left

from kvasir.wire.client import Histogram, RequestMetrics, Timings

TTFT_BOUNDS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
TTFT_BOUNDS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BOUNDS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BOUNDS += (7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BOUNDS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
REQUEST_BOUNDS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ENDINGS = ("stop", "length", "abort", "error")


class Buckets:
    """One histogram being filled: a count per bucket and the sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a value on a bound counts in that bucket (le)
        self.sum += value

    def snapshot(self) -> Histogram:
        return Histogram(bounds=self.bounds, counts=tuple(self.counts), sum=self.sum)


def one_two_five(limit: int) -> tuple[float, ...]:
    """vLLM's token-count bounds: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    bounds: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(bounds)
            bounds.append(float(step * scale))
        scale *= 10


class Metrics:
    def __init__(self, max_seq_len: int = 2048) -> None:
        self.prompt_lengths = Buckets(one_two_five(max_seq_len))
        self.output_lengths = Buckets(one_two_five(max_seq_len))
        self.ttft = Buckets(TTFT_BOUNDS)
        self.itl = Buckets(ITL_BOUNDS)
        self.e2e = Buckets(REQUEST_BOUNDS)
        self.queue = Buckets(REQUEST_BOUNDS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ended = dict.fromkeys(ENDINGS, 0)

    def accepted(self, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens

    def token(self, gap_ns: int | None) -> None:
        """A token streamed; ``gap_ns`` since the request's previous one (None for its first)."""
        self.generation_tokens += 1
        if gap_ns is not None:
            self.itl.observe(gap_ns / 1e9)

    def finished(self, reason: str, timings: Timings, prompt_tokens: int, output_tokens: int) -> None:
        self.ended[reason] += 1
        self.prompt_lengths.observe(prompt_tokens)
        self.output_lengths.observe(output_tokens)
        self.ttft.observe(timings.first_token_s)
        self.e2e.observe(timings.total_s)
        self.queue.observe(timings.queued_s)

    def ended_early(self, code: str) -> None:
        """A request ended without finishing: cancelled ("abort") or failed ("error")."""
        self.ended["abort" if code == "cancelled" else "error"] += 1

    def snapshot(self) -> RequestMetrics:
        return RequestMetrics(
            time_to_first_token_s=self.ttft.snapshot(),
            inter_token_latency_s=self.itl.snapshot(),
            e2e_request_latency_s=self.e2e.snapshot(),
            request_queue_time_s=self.queue.snapshot(),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            ended=dict(self.ended),
            request_prompt_tokens=self.prompt_lengths.snapshot(),
            request_generation_tokens=self.output_lengths.snapshot(),
        )
