"""The HTTP front's shared daemon for tests: the Llama with a tokenizer behind two front
processes and two bearer keys (tests/integration/conftest.py serves it to the run)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from tests.support.daemon import Daemon, free_port, serving, write_plan

KEY = "sk-kvasir-test-key"
OTHER_KEY = "sk-kvasir-other-tenant"
SPLITS = [(0, 3), (3, 6)]


@contextmanager
def http_serving(root: Path, model: Path) -> Iterator[Daemon]:
    """The daemon, ready, its front's port as ``daemon.port``; stopped (exit 0) after."""
    (root / "keys").write_text(f"# the test's keys\n{KEY}\n{OTHER_KEY}\n")
    (root / "keys").chmod(0o600)  # a file of secrets: its owner's only
    port = free_port()
    http = {
        "listen": f"127.0.0.1:{port}",
        "api_keys": "keys",
        "workers": 2,
        "model_name": "tiny-llama",
        "allow_ignore_eos": True,
        "reasoning": "think",  # a chat's <think> block is its reasoning_content (test_http_features.py)
    }
    # the model's whole context: a prompt that lists tools is long in its small vocabulary
    plan = write_plan(root / "plan.toml", model, SPLITS, max_tokens=64, max_seq_len=1024, http=http)
    with serving(plan, root / "rt", SPLITS, port) as daemon:
        yield daemon


def sdk(daemon, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key=key, max_retries=0, timeout=60)
