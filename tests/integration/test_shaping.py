"""Penalties, logit bias and min_tokens through a disaggregated daemon: the prefill pool's
tail samples the first token, the decode pool's the rest, from the history its head hands
on (kvasir/stage/logits.py). Greedy output equals Hugging Face ``generate`` with the same
processors, and a reference written out here for vLLM's presence and frequency penalties."""

from __future__ import annotations

import asyncio
import json

import torch
from test_ring import check_events
from transformers import AutoTokenizer

from kvasir.client import AsyncClient
from kvasir.wire.base import Grammar
from kvasir.wire.client import Finished
from tests.support.models import random_prompts, reference_model

SPLITS = {"prefill": [(0, 2), (2, 5), (5, 6)], "decode": [(0, 4), (4, 6)]}
EOS = 2  # the tiny models' end of sequence (tests/support/models.py)


async def submit_all(runtime_dir, jobs: list[tuple[list[int], dict]]) -> list[Finished]:
    async with await AsyncClient.connect(runtime_dir) as client:
        streams = [await client.submit(token_ids=ids, temperature=0, **kw) for ids, kw in jobs]
        finals = []
        for stream in streams:
            _, final = check_events([event async for event in stream])
            assert isinstance(final, Finished), final
            finals.append(final)
        return finals


def hf(model, ids: list[int], new: int, **processors) -> list[int]:
    inputs = torch.tensor([ids])
    out = model.generate(
        inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new, do_sample=False, **processors
    )
    return out[0, len(ids) :].tolist()


def penalised(model, ids: list[int], new: int, frequency: float, presence: float) -> list[int]:
    """Greedy, each step's logits less frequency x count + presence for every token output so far."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            for tok in set(out):
                logits[tok] -= frequency * out.count(tok) + presence
            out.append(int(logits.argmax()))
            if out[-1] == EOS:
                break
    return out


def test_penalties_bias_and_min_tokens_hold_across_the_handoff(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], SPLITS, name="shaping", max_rows=6, num_blocks=160).wait_ready()
    model = reference_model(tiny_models["llama"])
    prompts = random_prompts(320, [5, 17, 33, 9], seed=23)
    favoured = (prompts[0][0] + 7) % 320
    jobs = [
        (prompts[0], {"max_tokens": 16, "repetition_penalty": 1.6}),
        (prompts[1], {"max_tokens": 16, "repetition_penalty": 0.8}),
        (prompts[2], {"max_tokens": 12, "logit_bias": {favoured: 4.0, 11: -50.0}}),
        (prompts[3], {"max_tokens": 12, "logit_bias": {EOS: 100.0}, "min_tokens": 5}),
        (prompts[0], {"max_tokens": 16, "frequency_penalty": 1.5, "presence_penalty": 0.5}),
    ]
    finals = asyncio.run(submit_all(daemon.runtime_dir, jobs))
    assert finals[0].token_ids == hf(model, prompts[0], 16, repetition_penalty=1.6)
    assert finals[1].token_ids == hf(model, prompts[1], 16, repetition_penalty=0.8)
    bias = {(favoured,): 4.0, (11,): -50.0}
    assert finals[2].token_ids == hf(model, prompts[2], 12, sequence_bias=bias)
    # EOS is all but certain, yet barred for the first five tokens: the sixth ends it
    assert finals[3].token_ids == hf(model, prompts[3], 12, sequence_bias={(EOS,): 100.0}, min_new_tokens=5)
    assert len(finals[3].token_ids) == 6 and finals[3].token_ids[-1] == EOS and finals[3].reason == "stop"
    assert finals[4].token_ids == penalised(model, prompts[0], 16, 1.5, 0.5)
    plain = hf(model, prompts[0], 16)
    assert finals[0].token_ids != plain or finals[4].token_ids != plain  # the penalties acted
    assert all(final.handoff is not None for final in finals)  # every one crossed the pools


def test_structured_output_holds_across_the_handoff(tiny_models, start_daemon):
    """The decode pool's tail rebuilds each request's matcher from its first token."""
    source = tiny_models["llama-tokenizer"]
    daemon = start_daemon(source, SPLITS, name="structured", max_rows=6, num_blocks=160).wait_ready()
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    }
    grammar = Grammar("json", json.dumps(schema))
    prompts = random_prompts(320, [4, 11, 23, 7, 15, 30], seed=3)
    jobs = [
        (ids, {"max_tokens": 40, "temperature": 1.0, "seed": k, "grammar": grammar}) for k, ids in enumerate(prompts)
    ]

    async def sampled():  # temperature 1: submit_all is greedy
        async with await AsyncClient.connect(daemon.runtime_dir) as client:
            streams = [await client.submit(token_ids=ids, **kw) for ids, kw in jobs]
            return [await stream.result() for stream in streams]

    tokenizer = AutoTokenizer.from_pretrained(source)
    for final in asyncio.run(sampled()):
        assert isinstance(final, Finished) and final.reason == "stop", final
        body = json.loads(tokenizer.decode(final.token_ids, skip_special_tokens=True))
        assert set(body) == {"id", "ok"} and 0 <= body["id"] <= 999 and isinstance(body["ok"], bool)
        assert final.handoff is not None
