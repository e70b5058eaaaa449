"""The llama.cpp contender's plumbing: finding the binary, its command line, a server that
does not come up (a real process that exits)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvasir.bench.llamacpp import LlamaServer, LlamaServerError, ServerSpec, find_binary
from kvasir.bench.workload import Job, Load
from kvasir.errors import KvasirError


def executable(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def jobs(*shapes: tuple[int, int]) -> list[Job]:
    return [Job(text=None, token_ids=[1] * prompt, max_tokens=output) for prompt, output in shapes]


def test_the_spec_gives_each_slot_the_longest_job_rounded_up_and_the_plans_threads(tmp_path):
    load = Load(jobs((128, 64), (300, 64), (10, 5)), warmup=1, concurrency=32)
    spec = ServerSpec.for_load(tmp_path / "llama-server", tmp_path / "m.gguf", 2, load)
    assert (spec.slots, spec.slot_context, spec.threads) == (32, 512, 2)  # 364 tokens rounded up to 256s
    args = spec.args(8123)
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert pairs["--parallel"] == "32" and pairs["--ctx-size"] == str(32 * 512)
    assert pairs["--threads"] == pairs["--threads-batch"] == "2" and pairs["--model"] == str(tmp_path / "m.gguf")
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "8123" and args[-1] == "--no-webui"


def test_an_open_loop_load_and_text_prompts_are_refused():
    with pytest.raises(KvasirError, match="closed loop"):
        ServerSpec.for_load(Path("x"), Path("m.gguf"), 2, Load(jobs((4, 4)), warmup=0, rate=2.0))
    texts = [*jobs((4, 4)), Job(token_ids=None, text="Hello", max_tokens=4)]
    with pytest.raises(KvasirError, match="token-id prompts only"):
        ServerSpec.for_load(Path("x"), Path("m.gguf"), 2, Load(texts, warmup=0, concurrency=2))


def test_the_binary_given_must_be_executable_and_none_found_says_how_to_build_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVASIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("KVASIR_LLAMA_SERVER", raising=False)
    with pytest.raises(KvasirError, match="scripts/llama-server"):
        find_binary(None)
    plain = tmp_path / "plain"
    plain.write_text("not a program")
    with pytest.raises(KvasirError, match="not an executable file"):
        find_binary(str(plain))
    monkeypatch.setenv("KVASIR_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(KvasirError, match="missing is not an executable file"):
        find_binary(None)
    server = executable(tmp_path / "llama-server", "exit 0")
    assert find_binary(str(server)) == server  # given beats the environment


def test_a_server_that_exits_before_serving_fails_the_run_with_its_log(tmp_path):
    binary = executable(tmp_path / "llama-server", 'echo "error: unknown model format" >&2; exit 3')
    spec = ServerSpec(binary, tmp_path / "m.gguf", 2, 4, 256)
    with pytest.raises(LlamaServerError, match=r"exited with 3 before serving:\n.*unknown model format"):
        with LlamaServer(spec, tmp_path / "server.log"):
            pass


def test_a_server_that_never_answers_is_stopped_after_the_timeout(tmp_path):
    binary = executable(tmp_path / "llama-server", "exec sleep 60")
    spec = ServerSpec(binary, tmp_path / "m.gguf", 2, 4, 256)
    server = LlamaServer(spec, tmp_path / "server.log", ready_timeout_s=1.0)
    with pytest.raises(LlamaServerError, match="not serving after 1 s"):
        with server:
            pass
    assert server.process is not None and server.process.poll() is not None, "the server was left running"
