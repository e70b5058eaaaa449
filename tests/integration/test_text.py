"""Text in, text out: the bridge's tokenizer, chat template and incremental detokenizer."""

from __future__ import annotations

import json
import subprocess

from transformers import AutoTokenizer

from tests.support.daemon import BIN


def kvasir(runtime_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "kvasir"), *args, "--runtime-dir", str(runtime_dir)], capture_output=True, text=True, timeout=120
    )


def test_generate_streams_text_and_applies_the_chat_template(tiny_models, shared_daemon):
    daemon = shared_daemon  # the Llama with a tokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama-tokenizer"])
    for extra in ([], ["--chat"]):
        as_json = kvasir(
            daemon.runtime_dir, "generate", "hello ring", "--max-tokens", "16", "--temperature", "0", "--json", *extra
        )
        assert as_json.returncode == 0, as_json.stderr
        events = [json.loads(line) for line in as_json.stdout.splitlines()]
        assert [e["type"] for e in events][0] == "accepted" and events[-1]["type"] == "finished"
        tokens = [e for e in events if e["type"] == "token"]
        final = events[-1]
        assert final["token_ids"] == [t["token_id"] for t in tokens]
        text = "".join(t["text"] for t in tokens)
        assert text == tokenizer.decode(final["token_ids"], skip_special_tokens=True)
        prompt = (
            tokenizer.apply_chat_template([{"role": "user", "content": "hello ring"}], add_generation_prompt=True)
            if extra
            else tokenizer.encode("hello ring")
        )
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        assert final["usage"]["prompt_tokens"] == len(prompt)
        plain = kvasir(daemon.runtime_dir, "generate", "hello ring", "--max-tokens", "16", "--temperature", "0", *extra)
        assert plain.returncode == 0 and plain.stdout == text + "\n"
