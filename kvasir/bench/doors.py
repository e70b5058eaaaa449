"""``kvasir bench doors URL``: the same workload through both doors of one daemon, the
ZeroMQ client and the HTTP front's OpenAI API (streamed completions), alternating round
by round, so the ratio of their throughputs is measured in one run on the same cores."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp

from kvasir.bench.metrics import RequestRecord
from kvasir.bench.workload import Job
from kvasir.errors import KvasirError

DOORS = ("zeromq", "http")


@dataclass(frozen=True)
class Door:
    url: str  # the front's base URL, e.g. http://127.0.0.1:8000
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def served_model(session: aiohttp.ClientSession, door: Door, wait_s: float = 60.0) -> str:
    """The id the front serves under (its /v1/models), once its /health says serving (a
    front reaches the bridge a moment after the stages are ready); KvasirError if not."""
    deadline = time.monotonic() + wait_s
    while not await _serving(session, door):
        if time.monotonic() > deadline:
            raise KvasirError(f"the HTTP front at {door.url} is not serving after {wait_s:g} s (its /health)")
        await asyncio.sleep(0.2)
    try:
        async with session.get(f"{door.url}/v1/models", headers=door.headers) as response:
            body = await response.read()
            if response.status != 200:
                raise KvasirError(f"{door.url}/v1/models answered {response.status}: {body[:200]!r}")
            return json.loads(body)["data"][0]["id"]
    except aiohttp.ClientError as exc:
        raise KvasirError(f"no HTTP front answers at {door.url}: {exc}") from None


async def http_request(
    session: aiohttp.ClientSession, door: Door, model: str, job: Job, ignore_eos: bool = False, clock=time.perf_counter
) -> RequestRecord:
    """One streamed completion, timed per chunk; its output tokens from the usage chunk."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": job.token_ids if job.token_ids is not None else job.text,
        "max_tokens": job.max_tokens,
        "temperature": job.temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if job.seed is not None:
        body["seed"] = job.seed
    if job.grammar is not None:  # vLLM's structured_outputs, as kvasir/http/structured.py reads it
        kind, text = job.grammar.kind, job.grammar.text
        body["structured_outputs"] = {
            kind: True if kind == "json_object" else json.loads(text) if kind == "choice" else text
        }
    submitted = clock()
    times: list[float] = []
    tokens, ok = 0, False
    async with session.post(f"{door.url}/v1/completions", json=body, headers=door.headers) as response:
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("usage"):
                tokens, ok = chunk["usage"]["completion_tokens"], True
            elif any(choice.get("text") for choice in chunk.get("choices", ())):
                times.append(clock() - submitted)
    first = times[0] if times else clock() - submitted
    return RequestRecord(submitted, first, tuple(times), tokens, ok and response.status == 200)


async def _serving(session: aiohttp.ClientSession, door: Door) -> bool:
    try:
        async with session.get(f"{door.url}/health") as response:
            return response.status == 200
    except aiohttp.ClientError:
        return False


def http_sender(session: aiohttp.ClientSession, door: Door, model: str, ignore_eos: bool):
    return partial(http_request, session, door, model, ignore_eos=ignore_eos)


def doors_summary(runs: list[tuple[str, dict]]) -> dict:
    """Per door: each round's summary; and the ratio HTTP / ZeroMQ of the rounds' totals."""
    by_door = {door: [summary for name, summary in runs if name == door] for door in DOORS}

    def total(door: str, key: str) -> float:
        return sum(s[key] * s["duration_s"] for s in by_door[door]) / max(
            sum(s["duration_s"] for s in by_door[door]), 1e-9
        )

    ratio = {
        key: total("http", key) / max(total("zeromq", key), 1e-9) for key in ("output_tokens_per_s", "requests_per_s")
    }
    return {"rounds": [{"door": name, "summary": summary} for name, summary in runs], "http_over_zeromq": ratio}


def print_doors(report: dict, echo) -> None:
    for entry in report["doors"]["rounds"]:
        s = entry["summary"]
        echo(
            f"{entry['door']:<7} {s['requests']} ok, {s['errors']} failed: {s['output_tokens_per_s']:8.1f} output tokens/s, "
            f"{s['requests_per_s']:7.2f} requests/s, TTFT p50 {s['ttft']['p50'] * 1e3:7.1f} ms, ITL p50 {s['itl']['p50'] * 1e3:6.1f} ms"
        )
    ratio = report["doors"]["http_over_zeromq"]
    echo(
        f"http / zeromq: {ratio['output_tokens_per_s']:.3f}x output tokens/s, {ratio['requests_per_s']:.3f}x requests/s"
    )
