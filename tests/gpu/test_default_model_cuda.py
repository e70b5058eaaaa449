"""The default model as two stage processes on one GPU (plans/smollm2-cuda.toml, CUDA IPC
edge) against Hugging Face ``generate`` on the same GPU. Tolerance rules as in
test_ring_cuda.py: float32 exact, bfloat16 near-argmax of the float32 reference."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvasir.client import AsyncClient
from kvasir.config.plan import load_plan, plan_toml
from kvasir.errors import KvasirError
from kvasir.model.convert import prepare
from kvasir.model.source import resolve_source
from kvasir.wire.client import Finished
from tests.support.daemon import Daemon
from tests.support.gpu import gpu_under_test

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]

PLAN = Path(__file__).parents[2] / "plans" / "smollm2-cuda.toml"
GPU = gpu_under_test()
CHATS = ["What is the capital of France?", "Name a colour of the sky.", "Write one line about rivers."]
NEW_TOKENS = 32
BF16_MARGIN = 0.05


@pytest.fixture(scope="module")
def smollm2():
    try:
        return prepare(resolve_source("smollm2-135m")).weights_dir
    except KvasirError as exc:
        pytest.skip(f"the default model is not installed here: {exc}")


@pytest.fixture(scope="module")
def prompts(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    out = []
    for text in CHATS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def reference(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).to(GPU).eval()


def on_the_gpu(tmp_path: Path) -> Path:
    """The default CUDA plan with its stages on $KVASIR_GPU."""
    copy = tmp_path / "smollm2-cuda.toml"
    copy.write_text(PLAN.read_text().replace('device = "cuda:0"', f'device = "{GPU}"'))
    return copy


def serve(plan_path: Path, tmp_path: Path, prompts) -> list[list[int]]:
    async def ask():
        async with await AsyncClient.connect(daemon.runtime_dir) as client:
            streams = [await client.submit(token_ids=p, max_tokens=NEW_TOKENS, temperature=0) for p in prompts]
            return [await s.result() for s in streams]

    daemon = Daemon(plan_path, tmp_path / "rt", 2)
    try:
        daemon.wait_ready()
        finals = asyncio.run(ask())
    finally:
        assert daemon.stop() == 0
    assert "kind=cuda-ipc" in daemon.log()
    assert all(isinstance(f, Finished) for f in finals), finals
    return [list(f.token_ids) for f in finals]


def test_default_model_on_one_gpu_matches_generate_float32(reference, prompts, tmp_path):
    got = serve(on_the_gpu(tmp_path), tmp_path, prompts)
    for prompt, tokens in zip(prompts, got):
        inputs = torch.tensor([prompt], device=GPU)
        out = reference.generate(
            inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=NEW_TOKENS, do_sample=False
        )
        assert tokens == out[0, len(prompt) :].tolist()


def test_default_model_on_one_gpu_bfloat16_is_near_argmax(reference, prompts, tmp_path):
    import msgspec

    plan = load_plan(on_the_gpu(tmp_path))
    bf16 = tmp_path / "bf16.toml"
    text = plan_toml(msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, dtype="bfloat16")))
    bf16.write_text(text)
    got = serve(bf16, tmp_path, prompts)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens], device=GPU)).logits[0, len(prompt) - 1 : -1].float()
        best = logits.max(dim=-1).values
        chosen = logits.gather(1, torch.tensor(tokens, device=GPU)[:, None])[:, 0]
        assert bool(((best - chosen) <= BF16_MARGIN * logits.abs().max(dim=-1).values).all())
