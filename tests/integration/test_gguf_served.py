"""A tiny GGUF file written here, served as stored by a real kvasird (bfloat16, CPU
stages) next to the same file dequantised, against its float32 reference."""

from __future__ import annotations

import asyncio

import torch

from kvasir.client import AsyncClient
from kvasir.model.convert import prepare
from kvasir.model.source import resolve_source
from kvasir.wire.client import Finished
from tests.support.gguf_models import save_tiny_gguf
from tests.support.models import hf_greedy, random_prompts, reference_model

NEW = 12


async def greedy(runtime_dir, prompts) -> list[list[int]]:
    async with await AsyncClient.connect(runtime_dir) as client:
        streams = [await client.submit(token_ids=p, max_tokens=NEW, temperature=0) for p in prompts]
        finals = [await s.result() for s in streams]
    assert all(isinstance(f, Finished) for f in finals), finals
    return [f.token_ids for f in finals]


def test_a_gguf_is_served_as_stored_through_kvasird(start_daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("KVASIR_CACHE_DIR", str(tmp_path / "cache"))  # the daemons inherit it
    path = save_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q4_1", "Q8_0")
    source = prepare(resolve_source(str(path)))
    prompts = random_prompts(source.vocab_size, [2, 17, 40], seed=8)
    stored = start_daemon(path, [(0, 2), (2, 4)], name="stored", dtype="bfloat16").wait_ready()
    floats = start_daemon(path, [(0, 2), (2, 4)], name="floats", weights="dequantize").wait_ready()
    ready = [line for line in stored.log().splitlines() if "stage ready" in line]
    assert len(ready) == 2 and all("stored=" in line and "Q4_1" in line for line in ready), ready
    assert all("stored=None" in line for line in floats.log().splitlines() if "stage ready" in line)
    reference = reference_model(source.weights_dir)
    for prompt, tokens in zip(prompts, asyncio.run(greedy(stored.runtime_dir, prompts))):
        assert len(tokens) == NEW or tokens[-1] in source.eos_token_ids
        with torch.no_grad():  # teacher forced: within 5 % of the step's logit scale of the best
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool((logits.max(dim=-1).values - chosen <= 0.05 * logits.abs().max(dim=-1).values).all())
    exact = [hf_greedy(reference, p, NEW) for p in prompts]
    assert asyncio.run(greedy(floats.runtime_dir, prompts)) == exact
