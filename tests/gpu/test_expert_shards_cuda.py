"""Expert shards with a CUDA side: pinned dispatch slots between a GPU stage and GPU or
CPU shards, against Hugging Face ``generate`` (skipped where CUDA is absent). The rules
are tests/gpu/test_ring_cuda.py's: float32 across CPU and GPU every token is within
``MIXED_MARGIN`` of the step's best under the reference, teacher forced."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from test_ring_cuda import MIXED_MARGIN, check_near_argmax, greedy, reference

from kvasir.ring.expert_slots import DispatchSegment
from kvasir.wire.control import DispatchSlot
from tests.support.gpu import gpu_under_test
from tests.support.models import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]

GPU = gpu_under_test()


def test_a_pinned_slot_carries_rows_from_a_gpu_stage_to_a_cpu_shard_and_back():
    spec = DispatchSlot(
        name=f"kvasir-test-dispatch-gpu-{os.getpid()}", max_rows=64, hidden=256, top_k=2, dtype="float32",
        kind="pinned", stage_device=GPU, shard_device="cpu",
    )  # fmt: skip
    made = DispatchSegment(spec, create=True)
    stage, shard = DispatchSegment(spec, create=False, side="stage"), DispatchSegment(spec, create=False, side="shard")
    try:
        for rows in (1, 17, 64, 3):
            hidden = torch.randn(rows, 256, device=GPU)
            ids = torch.randint(0, 8, (rows, 2), device=GPU)
            torch.cuda._sleep(2_000_000)  # a slow stream: the rows must still have landed when write_rows returns
            stage.write_rows(hidden * 3, ids, torch.rand(rows, 2, device=GPU))
            got, got_ids, _ = shard.read_rows(rows, torch.device("cpu"), torch.float32)
            assert torch.equal(got, (hidden * 3).cpu()) and torch.equal(got_ids, ids.cpu())
            shard.write_out(got + 1)
            assert torch.equal(stage.read_out(rows, torch.device(GPU)), hidden * 3 + 1)
    finally:
        for segment in (stage, shard, made):
            segment.close()
        made.unlink()


@pytest.mark.parametrize("shard_devices", [(GPU, GPU), (GPU, "cpu")], ids=["gpu-shards", "gpu-and-cpu-shards"])
def test_a_gpu_stage_with_expert_shards_matches_generate(start_daemon, tiny_models, shard_devices):
    first, second = shard_devices
    daemon = start_daemon(
        tiny_models["mixtral"],
        [(0, 3), (3, 6)],
        devices=[GPU, "cpu"],
        experts={0: [(0, 3, first), (3, 8, second)]},
    ).wait_ready()
    prompts = random_prompts(320, [1, 4, 9, 17, 33, 60], seed=8)
    got = asyncio.run(greedy(daemon.runtime_dir, prompts))
    check_near_argmax(reference(tiny_models["mixtral"], "cpu"), prompts, got, MIXED_MARGIN)
