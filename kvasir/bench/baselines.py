"""Hugging Face transformers in one process, the baselines ``kvasir bench compare`` runs.

Both run the same jobs (token-id prompts, greedy) with a given torch thread count:
``static`` groups the jobs into fixed batches of ``batch_size`` and calls ``generate`` on
each (left-padded); ``continuous`` hands every job to transformers' own continuous
batching (``generate_batch``). Each returns (output tokens, seconds).
"""

from __future__ import annotations

import time
from pathlib import Path

from kvasir.bench.workload import Job
from kvasir.errors import KvasirError


def load_reference(folder: Path, threads: int, dtype: str = "float32"):
    """The model folder in transformers, in ``dtype`` (a plan's: float32, bfloat16, float16)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvasir.config.devices import torch_dtype

    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype)).eval()


def static_batches(model, jobs: list[Job], batch_size: int, pad_id: int) -> tuple[int, float]:
    import torch

    tokens = 0
    started = time.perf_counter()
    for first in range(0, len(jobs), batch_size):
        group = jobs[first : first + batch_size]
        prompts = [_ids(job) for job in group]
        width = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(j.max_tokens for j in group)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad_id
            )
        tokens += sum(min(j.max_tokens, out.shape[1] - width) for j in group)
    return tokens, time.perf_counter() - started


def continuous(model, jobs: list[Job], cache=None) -> tuple[int, float]:
    """``cache``: a transformers ContinuousBatchingConfig; None keeps transformers' defaults
    (what ``kvasir bench compare`` runs), which size the cache to the machine's memory and
    spend seconds filling it before the first token."""
    from transformers import GenerationConfig

    new = max(j.max_tokens for j in jobs)
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    started = time.perf_counter()
    outputs = model.generate_batch(
        [_ids(j) for j in jobs], generation_config=config, continuous_batching_config=cache, progress_bar=False
    )
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return tokens, elapsed


def _ids(job: Job) -> list[int]:
    if job.token_ids is None:
        raise KvasirError("the transformers baselines run token-id prompts only")
    return job.token_ids
