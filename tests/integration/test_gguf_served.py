"""A tiny GGUF file and a tiny GPTQ checkpoint written here, each served as stored by a
real kvasird (bfloat16, CPU stages) next to the same weights dequantised, against their
float32 reference."""

from __future__ import annotations

import asyncio

import torch

from kvasir.client import AsyncClient
from kvasir.model.convert import prepare
from kvasir.model.source import resolve_source
from kvasir.wire.client import Finished
from tests.support.gguf_models import save_tiny_gguf
from tests.support.models import hf_greedy, random_prompts, reference_model
from tests.support.quantized import save_quantized

NEW = 12


async def greedy(runtime_dir, prompts) -> list[list[int]]:
    async with await AsyncClient.connect(runtime_dir) as client:
        streams = [await client.submit(token_ids=p, max_tokens=NEW, temperature=0) for p in prompts]
        finals = [await s.result() for s in streams]
    assert all(isinstance(f, Finished) for f in finals), finals
    return [f.token_ids for f in finals]


def near_greedy(reference, prompts, outputs, eos_ids) -> None:
    """Each output token, teacher forced, within 5 % of the step's logit scale of the
    reference's best (bfloat16 and 4-bit products part from float32 on near ties)."""
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert len(tokens) == NEW or tokens[-1] in eos_ids
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool((logits.max(dim=-1).values - chosen <= 0.05 * logits.abs().max(dim=-1).values).all())


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
    near_greedy(reference, prompts, asyncio.run(greedy(stored.runtime_dir, prompts)), source.eos_token_ids)
    exact = [hf_greedy(reference, p, NEW) for p in prompts]
    assert asyncio.run(greedy(floats.runtime_dir, prompts)) == exact


def test_a_gptq_checkpoint_is_served_as_stored_through_kvasird(start_daemon, tmp_path):
    folder, reference_folder = save_quantized(tmp_path, "gptq")
    source = resolve_source(str(folder))
    prompts = random_prompts(source.vocab_size, [2, 17, 40], seed=8)
    stored = start_daemon(folder, [(0, 2), (2, 4)], name="stored", dtype="bfloat16").wait_ready()
    floats = start_daemon(folder, [(0, 2), (2, 4)], name="floats", weights="dequantize").wait_ready()
    ready = [line for line in stored.log().splitlines() if "stage ready" in line]
    assert len(ready) == 2 and all("stored=" in line and "gptq 4-bit" in line for line in ready), ready
    reference = reference_model(reference_folder)
    near_greedy(reference, prompts, asyncio.run(greedy(stored.runtime_dir, prompts)), source.eos_token_ids)
    assert asyncio.run(greedy(floats.runtime_dir, prompts)) == [hf_greedy(reference, p, NEW) for p in prompts]
