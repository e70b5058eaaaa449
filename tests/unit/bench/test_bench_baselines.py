"""The transformers baselines of ``kvasir bench --compare`` on a tiny model."""

from __future__ import annotations

import torch
from transformers import ContinuousBatchingConfig

from kvasir.bench.baselines import continuous, load_reference, static_batches
from kvasir.bench.workload import LengthSpec, synthetic_jobs


def test_static_and_continuous_baselines_produce_every_token(tiny_models):
    threads = torch.get_num_threads()
    try:
        run_baselines(tiny_models)
    finally:
        torch.set_num_threads(threads)


def run_baselines(tiny_models):
    model = load_reference(tiny_models["llama"], threads=1)
    jobs = synthetic_jobs(5, LengthSpec(3, 12), LengthSpec(6, 6), vocab_size=320, seed=2)
    tokens, seconds = static_batches(model, jobs, batch_size=2, pad_id=0)
    assert tokens == 5 * 6 and seconds > 0
    small = ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=64)  # not the machine's memory
    tokens, seconds = continuous(model, jobs, small)
    assert tokens == 5 * 6 and seconds > 0
