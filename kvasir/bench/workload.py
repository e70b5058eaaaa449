"""What a bench run submits: prompts and output lengths from fixed, uniform, mixed,
log-normal or file specs."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from kvasir.errors import KvasirError
from kvasir.wire.base import Grammar


class WorkloadError(KvasirError):
    """A length spec or prompt file that cannot be used."""


@dataclass(frozen=True)
class LengthSpec:
    """A fixed length ("128"), a uniform range ("64:192", both ends included), a mix
    drawn uniformly from a list ("1000,40,40,40": a quarter long prompts, the rest chats),
    or a heavy tail like chat traffic's ("lognormal:96:0.9:8:1024": log-normal with median
    96 and sigma 0.9, rounded and kept within 8..1024). For prompts, "shared:N+SPEC" puts
    the same N tokens (one system prompt) before every prompt's own SPEC tokens, and
    "shared:NxK+SPEC" one of K different ones (K tenants, each conversation one of them,
    drawn at random). ``turns``
    (``kvasir bench load --turns``) groups the prompts into conversations: each later turn's
    SPEC tokens follow the whole history (earlier prompts and replies), resent."""

    low: int
    high: int
    choices: tuple[int, ...] = ()
    median: float | None = None  # log-normal: the median and the sigma of the log
    sigma: float = 0.0
    shared: int = 0  # prompts: tokens every prompt begins with, before its own
    tenants: int = 1  # prompts: how many different shared beginnings (each conversation draws one)
    turns: int = 1  # prompts: turns of a conversation (the first turn starts with the shared tokens)

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        if text.startswith("shared:"):
            return cls._shared(text)
        if text.startswith("lognormal:"):
            return cls._lognormal(text)
        if "," in text:
            try:
                choices = tuple(int(part) for part in text.split(","))
            except ValueError:
                raise WorkloadError(f"length {text!r} is not a comma-separated list of lengths") from None
            if min(choices) < 1:
                raise WorkloadError(f"length {text!r}: every length must be >= 1")
            return cls(min(choices), max(choices), choices)
        low_text, _, high_text = text.partition(":")
        try:
            low = int(low_text)
            high = int(high_text) if high_text else low
        except ValueError:
            raise WorkloadError(f"length {text!r} is not N, LOW:HIGH or N,N,...") from None
        if low < 1 or high < low:
            raise WorkloadError(f"length {text!r} must satisfy 1 <= LOW <= HIGH")
        return cls(low, high)

    @classmethod
    def _shared(cls, text: str) -> LengthSpec:
        shared, plus, own = text.removeprefix("shared:").partition("+")
        tokens, times, tenants = shared.partition("x")
        if (
            not plus
            or not tokens.isdigit()
            or int(tokens) < 1
            or times
            and not (tenants.isdigit() and int(tenants) >= 1)
        ):
            raise WorkloadError(
                f"length {text!r} is not shared:N+SPEC or shared:NxK+SPEC (N >= 1 shared tokens, K >= 1 "
                "different ones, then SPEC of its own)"
            )
        if own.startswith("shared:"):
            raise WorkloadError(f"length {text!r}: one shared prefix only")
        return replace(cls.parse(own), shared=int(tokens), tenants=int(tenants) if times else 1)

    @classmethod
    def _lognormal(cls, text: str) -> LengthSpec:
        parts = text.split(":")[1:]
        try:
            median, sigma = float(parts[0]), float(parts[1])
            low, high = int(parts[2]), int(parts[3])
        except (ValueError, IndexError):
            raise WorkloadError(f"length {text!r} is not lognormal:MEDIAN:SIGMA:LOW:HIGH") from None
        if len(parts) != 4 or not (math.isfinite(median) and math.isfinite(sigma)):
            raise WorkloadError(f"length {text!r} is not lognormal:MEDIAN:SIGMA:LOW:HIGH")
        if low < 1 or high < low or not low <= median <= high or not 0 <= sigma <= 10:
            raise WorkloadError(f"length {text!r} must satisfy 1 <= LOW <= MEDIAN <= HIGH and 0 <= SIGMA <= 10")
        return cls(low, high, median=median, sigma=sigma)

    def draw(self, rng: random.Random) -> int:
        if self.median is not None:
            length = round(rng.lognormvariate(math.log(self.median), self.sigma))
            return min(self.high, max(self.low, length))
        return rng.choice(self.choices) if self.choices else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        if self.shared:
            tenants = f"x{self.tenants}" if self.tenants > 1 else ""
            return f"shared:{self.shared}{tenants}+{replace(self, shared=0, tenants=1)}"
        if self.median is not None:
            return f"lognormal:{self.median:g}:{self.sigma:g}:{self.low}:{self.high}"
        if self.choices:
            return ",".join(map(str, self.choices))
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class Job:
    token_ids: list[int] | None
    text: str | None
    max_tokens: int
    turn: int = 0  # > 0: a later turn of the conversation the jobs before it began; token_ids
    # are then only its new message, sent after the history (kvasir/bench/runner.py)
    grammar: Grammar | None = None  # a structured output the request's tokens must keep to
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # its sampling's seed (with a temperature)


def synthetic_jobs(count: int, prompt_len: LengthSpec, output_len: LengthSpec, vocab_size: int, seed: int) -> list[Job]:
    """Random token-id prompts (ids 3..vocab-1), reproducible by seed; with a shared
    prefix, every conversation's first prompt begins with the same random tokens (one of
    ``tenants`` such prefixes, drawn per conversation); with turns, every ``turns``
    consecutive jobs are one conversation."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(prompt_len.shared)] for _ in range(prompt_len.tenants)]
    jobs = []
    for number in range(count):
        turn = number % prompt_len.turns
        prefix = [] if turn else prefixes[rng.randrange(len(prefixes))] if len(prefixes) > 1 else prefixes[0]
        own = [rng.randrange(3, vocab_size) for _ in range(prompt_len.draw(rng))]
        jobs.append(Job(prefix + own, None, output_len.draw(rng), turn))
    return jobs


def conversations(jobs: list[Job]) -> list[list[Job]]:
    """The jobs grouped into conversations: each begins at a job of turn 0."""
    groups: list[list[Job]] = []
    for job in jobs:
        if job.turn == 0 or not groups:
            groups.append([])
        groups[-1].append(job)
    return groups


def workload_lengths(lengths: tuple[LengthSpec, LengthSpec]) -> dict:
    """The length fields of a run's report (and its turns a conversation, if more than one)."""
    prompt, output = lengths
    return {"prompt_len": str(prompt), "output_len": str(output)} | (
        {"turns": prompt.turns} if prompt.turns > 1 else {}
    )


def file_jobs(path: Path, count: int, output_len: LengthSpec, seed: int) -> list[Job]:
    """Prompts from a JSONL file: one object per line with "prompt" (text) or "token_ids",
    and optionally "max_tokens"; cycled to ``count`` jobs."""
    rng = random.Random(seed)
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read prompts file {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise WorkloadError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(row, dict) or not (
            isinstance(row.get("prompt"), str) or isinstance(row.get("token_ids"), list)
        ):
            raise WorkloadError(f'{path}:{number}: needs "prompt" (text) or "token_ids" (list)')
        rows.append(row)
    if not rows:
        raise WorkloadError(f"{path} holds no prompts")
    jobs = []
    for i in range(count):
        row = rows[i % len(rows)]
        max_tokens = row.get("max_tokens")
        jobs.append(
            Job(row.get("token_ids"), row.get("prompt"), int(max_tokens) if max_tokens else output_len.draw(rng))
        )
    return jobs


@dataclass(frozen=True)
class Workload:
    """What every load-running ``kvasir bench`` mode submits, as its options give it: how
    many requests (after how many warm-up ones), their lengths or prompt file, the seed."""

    count: int  # measured requests
    warmup: int
    lengths: tuple[LengthSpec, LengthSpec]  # prompt (with its shared prefix and turns), output
    prompts_file: str | None = None
    seed: int = 0
    ignore_eos: bool = False
    grammar: Grammar | None = None  # --structured: every request keeps to it
    temperature: float = 0.0  # --temperature: sampled (each job seeded from ``seed`` and its place)

    def jobs(self, vocab_size: int) -> list[Job]:
        """The warm-up jobs, then the measured ones: random ids below ``vocab_size``, or the file's prompts."""
        prompts, outputs = self.lengths
        total = self.count + self.warmup
        if self.prompts_file:
            jobs = file_jobs(Path(self.prompts_file), total, outputs, self.seed)
        else:
            jobs = synthetic_jobs(total, prompts, outputs, vocab_size, self.seed)
        if self.grammar:
            jobs = [replace(job, grammar=self.grammar) for job in jobs]
        if self.temperature:
            jobs = [
                replace(job, temperature=self.temperature, seed=(self.seed * 1_000_003 + i) % 2**63)
                for i, job in enumerate(jobs)
            ]
        return jobs

    def report(self) -> dict:
        return {
            "requests": self.count,
            "warmup": self.warmup,
            **workload_lengths(self.lengths),
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "structured": self.grammar.kind if self.grammar else None,
            "temperature": self.temperature,
        }


@dataclass(frozen=True)
class Load:
    """A workload's jobs for one model, and how they arrive: a closed loop of
    ``concurrency`` requests in flight, or an open loop of ``rate`` requests/s (Poisson)."""

    jobs: list[Job]  # warm-up jobs first
    warmup: int
    concurrency: int | None = None
    rate: float | None = None
    seed: int = 0

    @property
    def measured(self) -> list[Job]:
        return self.jobs[self.warmup :]
