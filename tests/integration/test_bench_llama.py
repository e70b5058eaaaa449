"""``kvasir bench compare`` through the HTTP door: the rings through a loopback OpenAI
front the compare adds, and llama.cpp's own llama-server as a contender on the default
model's GGUF (where scripts/llama-server has built it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.daemon import BIN, write_plan

PLANS = Path(__file__).resolve().parents[2] / "plans"


def compare(*args: str, timeout: int = 600) -> dict:
    run = subprocess.run(
        [str(BIN / "kvasir"), "bench", "compare", *args, "--json"], capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["compare"]


def test_compare_drives_the_rings_through_an_http_front_it_adds(tiny_models, tmp_path):
    plan = write_plan(tmp_path / "plan.toml", tiny_models["llama"], [(0, 3), (3, 6)], max_rows=8, max_tokens=64)
    report = compare(
        *("--plan", str(plan), "--contenders", "ring", "--door", "http"),  # drained: the same door, another plan
        *("--requests", "6", "--warmup", "1", "--concurrency", "3", "--prompt-len", "4:12", "--output-len", "5"),
    )
    entry = report["contenders"]["ring"]
    assert entry["door"] == "http"
    # through the front, EOS ignored: every request produced exactly its 5 tokens
    assert entry["summary"]["requests"] == 6 and entry["summary"]["errors"] == 0
    assert entry["summary"]["output_tokens"] == 30
    assert [s["index"] for s in entry["stages"]] == [0, 1]  # the daemon's stats still read
    assert report["served"] == {"dtype": "float32", "weights": "dequantize"}
    assert "http" not in plan.read_text(), "the plan given is left as it was"


def llama_server() -> str:
    from kvasir.bench.llamacpp import find_binary
    from kvasir.errors import KvasirError

    try:
        return str(find_binary(None))
    except KvasirError as exc:
        pytest.skip(str(exc))


def test_llama_cpp_contends_on_the_default_models_own_gguf():
    binary = llama_server()
    report = compare(
        *("--plan", str(PLANS / "smollm2-q4.toml"), "--contenders", "ring,llama.cpp", "--llama-server", binary),
        *("--requests", "6", "--warmup", "2", "--concurrency", "3", "--prompt-len", "24", "--output-len", "8"),
    )
    llama = report["contenders"]["llama.cpp"]
    assert llama["summary"]["requests"] == 6 and llama["summary"]["errors"] == 0
    assert llama["summary"]["output_tokens"] == 48, "llama-server honours ignore_eos and max_tokens"
    assert llama["served"]["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and llama["served"]["slots"] == 3
    assert llama["summary"]["ttft"]["p50"] > 0 and llama["summary"]["itl"]["p50"] > 0
    assert report["contenders"]["ring"]["door"] == "http"
    assert report["ratios"]["ring/llama.cpp"] > 0 and report["ratios"]["ring/llama.cpp ITL p50"] > 0
