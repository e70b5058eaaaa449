"""The chain with every stage on a CUDA device (skipped where CUDA is absent)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvasir.stage.chain import Chain
from kvasir.wire.batch import SamplingParams
from tests.support.gpu import gpu_under_test

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]

GPU = gpu_under_test()


def test_greedy_on_cuda_matches_hf_generate(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["llama"], [(0, 3), (3, 6)], device=GPU, max_rows=4, max_tokens=16)
    chain = Chain(plan, source)
    assert all(stage.cache.keys.is_cuda for stage in chain.stages)
    g = torch.Generator().manual_seed(2)
    texts = [torch.randint(3, source.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 40, 70)]
    ids = [chain.submit(t, SamplingParams(temperature=0, max_tokens=12)) for t in texts]
    done = chain.run()
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    for rid, text in zip(ids, texts):
        inputs = torch.tensor([text])
        expected = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=12, do_sample=False)
        assert done[rid].token_ids == expected[0, len(text) :].tolist()


def test_bfloat16_on_cuda_runs_and_samples_in_vocab(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["qwen2"], [(0, 2), (2, 6)], device=GPU, dtype="bfloat16")
    chain = Chain(plan, source)
    rid = chain.submit(list(range(3, 40)), SamplingParams(temperature=0.7, seed=3, max_tokens=10))
    out = chain.run()[rid]
    assert 1 <= len(out.token_ids) <= 10 and all(0 <= t < source.vocab_size for t in out.token_ids)


class SyncWatchedChain(Chain):
    """The chain with every stage's batch path run under torch.cuda.set_sync_debug_mode
    ("error"): any call that makes the host wait for the GPU raises. Sampling, which must
    read the tail's logits, is outside it."""

    batches = 0

    def forward(self, batch):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return super().forward(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            self.batches += 1


def test_the_stages_batch_path_never_makes_the_host_wait(tiny_models, plan_for, record_property):
    plan, source = plan_for(tiny_models["llama"], [(0, 3), (3, 6)], device=GPU, max_rows=4, max_tokens=16)
    chain = SyncWatchedChain(plan, source)
    g = torch.Generator().manual_seed(3)
    texts = [torch.randint(3, source.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 40, 70)]
    ids = [chain.submit(t, SamplingParams(temperature=0, max_tokens=12)) for t in texts]
    done = chain.run()  # prompt chunks of up to 16 tokens, then decode rows: both attention paths
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    for rid, text in zip(ids, texts):
        inputs = torch.tensor([text])
        expected = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=12, do_sample=False)
        assert done[rid].token_ids == expected[0, len(text) :].tolist()
    record_property(
        "summary",
        f"sync debug: {chain.batches} batches through both stages under set_sync_debug_mode('error'), "
        "no host synchronisation, output equal to generate",
    )
