"""llama.cpp's own C++ server as a contender of ``kvasir bench compare``.

``llama-server`` (continuous batching over ``-np`` slots) serves the same GGUF file the
plan's model comes from, with the same CPU threads as the plan's stages together, and is
driven through its OpenAI ``/v1/completions`` like Kvasir's HTTP front (streamed, greedy,
``ignore_eos``, token-id prompts). ``scripts/llama-server`` builds it from the llama.cpp
source vendored in the PyPI sdist of ``llama-cpp-python`` (the Python package's own
server handles one sequence at a time and is not the peer).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvasir.bench.daemon import BenchDaemonError, free_ports, read_tail, stop_gracefully
from kvasir.bench.doors import Door, http_sender
from kvasir.bench.runner import drive, summary_data
from kvasir.bench.workload import Load
from kvasir.errors import KvasirError
from kvasir.model.source import cache_dir

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp scripts/llama-server builds
CONTEXT_STEP = 256  # a slot's context, rounded up to this


class LlamaServerError(BenchDaemonError):
    """The llama-server the bench started did not come up."""


def built_binary() -> Path:
    """Where ``scripts/llama-server`` puts the binary it builds."""
    return cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON}" / "build" / "bin" / "llama-server"


def find_binary(given: str | None) -> Path:
    """``given``, else $KVASIR_LLAMA_SERVER, else the one scripts/llama-server built,
    else ``llama-server`` on PATH."""
    explicit = given or os.environ.get("KVASIR_LLAMA_SERVER")
    if explicit:
        if not _executable(explicit):
            raise KvasirError(f"llama-server {explicit} is not an executable file")
        return Path(explicit)
    for candidate in (str(built_binary()), shutil.which("llama-server")):
        if candidate and _executable(candidate):
            return Path(candidate)
    raise KvasirError(
        "no llama-server: build it with scripts/llama-server (from the llama.cpp source in the "
        f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist), or give --llama-server PATH or $KVASIR_LLAMA_SERVER"
    )


def slot_context(tokens: int) -> int:
    """A slot's context for sequences of up to ``tokens``: rounded up to CONTEXT_STEP."""
    return -(-tokens // CONTEXT_STEP) * CONTEXT_STEP


def client_session():
    """An aiohttp session for llama-server: a connection per request, as llama-server
    closes one after a streamed response without saying so, and a reused one fails its
    next request (0.3.36's llama.cpp)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


def _executable(path: str) -> bool:
    return Path(path).is_file() and os.access(path, os.X_OK)


@dataclass(frozen=True)
class ServerSpec:
    binary: Path
    gguf: Path
    threads: int  # -t and -tb: the plan's stage threads summed
    slots: int  # -np: the workload's concurrency
    slot_context: int  # tokens one slot holds: the longest job's prompt and output

    @classmethod
    def for_load(cls, binary: Path, gguf: Path, threads: int, load: Load) -> ServerSpec:
        if load.concurrency is None:
            raise KvasirError("llama-server runs a closed loop: give the load a concurrency")
        if any(job.token_ids is None for job in load.jobs):
            raise KvasirError("the llama.cpp contender runs token-id prompts only (its slots are sized in tokens)")
        longest = max(len(job.token_ids or ()) + job.max_tokens for job in load.jobs)
        return cls(binary, gguf, threads, load.concurrency, slot_context(longest))

    def args(self, port: int) -> list[str]:
        n = str(self.threads)
        return [
            str(self.binary),
            *("--model", str(self.gguf), "--threads", n, "--threads-batch", n),
            *("--parallel", str(self.slots), "--ctx-size", str(self.slots * self.slot_context)),
            *("--host", "127.0.0.1", "--port", str(port), "--no-webui"),
        ]


class LlamaServer:
    """``llama-server`` started from a spec, its log in ``log_path``; entering waits
    until its /health answers 200, leaving stops it (SIGTERM, then SIGKILL)."""

    def __init__(self, spec: ServerSpec, log_path: Path, ready_timeout_s: float = 300.0) -> None:
        self.spec = spec
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.port = free_ports(1)[0]
        self.process: subprocess.Popen | None = None

    @property
    def door(self) -> Door:
        return Door(f"http://127.0.0.1:{self.port}")

    def __enter__(self) -> LlamaServer:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.spec.args(self.port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            self._wait_healthy(self.process)
        except BaseException:
            stop_gracefully(self.process, 10.0)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            stop_gracefully(self.process, 10.0)

    def _wait_healthy(self, process: subprocess.Popen) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise LlamaServerError(
                    f"llama-server exited with {process.returncode} before serving:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.door.url}/health", timeout=2.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise LlamaServerError(f"llama-server not serving after {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        return read_tail(self.log_path, lines)


def run_llama_server(spec: ServerSpec, load: Load, log_path: Path, slo: tuple[float, float] | None) -> dict:
    """One run of ``load`` against a llama-server started for it: the summary (as the
    ring's: tokens/s, TTFT, ITL)."""
    with LlamaServer(spec, log_path) as server:
        records, duration = asyncio.run(_drive(server.door, load))
    return summary_data(records, duration, slo)


async def _drive(door: Door, load: Load):

    concurrency = load.concurrency or 1
    async with client_session() as session:
        send = http_sender(session, door, "model", ignore_eos=True)
        return await drive(send, load.jobs, warmup=load.warmup, concurrency=concurrency)


def perplexity_binary(server: Path) -> Path:
    """``llama-perplexity``, built next to ``llama-server`` (scripts/llama-server builds both)."""
    found = server.parent / "llama-perplexity"
    if not _executable(str(found)):
        raise KvasirError(f"no llama-perplexity next to {server}: build both with scripts/llama-server")
    return found


def llama_perplexity(binary: Path, gguf: Path, text: Path, n_ctx: int, threads: int, log_path: Path) -> float:
    """llama.cpp's own perplexity of the text file (its chunks of ``n_ctx``, second halves)."""
    args = [str(binary), "--model", str(gguf), "--file", str(text), "--ctx-size", str(n_ctx)]
    args += ["--threads", str(threads), "--threads-batch", str(threads)]
    with open(log_path, "wb") as log:
        done = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", log_path.read_text(errors="replace"))
    if done.returncode != 0 or found is None:
        tail = read_tail(log_path, 15)
        raise LlamaServerError(f"llama-perplexity exited with {done.returncode} without a perplexity:\n{tail}")
    return float(found.group(1))


async def llama_tokens(session, door: Door, text: str) -> list[int]:
    """How llama.cpp tokenises ``text`` (no special tokens added), from its /tokenize."""
    async with session.post(f"{door.url}/tokenize", json={"content": text, "add_special": False}) as response:
        body = await response.json()
        if response.status != 200:
            raise LlamaServerError(f"llama-server's /tokenize answered {response.status}: {body}")
        return [int(token) for token in body["tokens"]]


def llama_top_one(session, door: Door):
    """llama-server's greedy next token at each of ``continuation``'s positions, given the
    prompt and the continuation before it: one request a position (its slot keeps the
    common prefix cached, so each computes one new token)."""

    async def top_one(prompt: list[int], continuation: list[int]) -> list[int]:
        picked = []
        for i in range(len(continuation)):
            body = {"prompt": prompt + continuation[:i], "n_predict": 1, "temperature": 0.0}
            body |= {"return_tokens": True, "cache_prompt": True}
            async with session.post(f"{door.url}/completion", json=body) as response:
                answer = await response.json()
                if response.status != 200 or not answer.get("tokens"):
                    raise LlamaServerError(f"llama-server's /completion answered {response.status}: {answer}")
                picked.append(int(answer["tokens"][0]))
        return picked

    return top_one
