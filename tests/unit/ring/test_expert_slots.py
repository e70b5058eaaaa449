"""An expert shard's dispatch slot: what each side writes and reads, and its kind (the
CUDA sides of a pinned slot: tests/gpu/test_expert_shards_cuda.py)."""

from __future__ import annotations

import os

import pytest
import torch

from kvasir.config.devices import dispatch_kind
from kvasir.ring.expert_slots import DispatchSegment
from kvasir.ring.shm import SlotError
from kvasir.wire.control import DispatchSlot


@pytest.mark.parametrize(
    "stage, shard, kind",
    [("cpu", "cpu", "shm"), ("cuda:0", "cpu", "pinned"), ("cpu", "cuda:1", "pinned"), ("cuda", "cuda:0", "pinned")],
)
def test_a_cuda_side_makes_the_slot_pinned(stage, shard, kind):
    assert dispatch_kind(stage, shard) == kind


def spec(kind="shm", **devices) -> DispatchSlot:
    name = f"kvasir-test-dispatch-{os.getpid()}"
    return DispatchSlot(name=name, max_rows=4, hidden=6, top_k=2, dtype="float32", kind=kind, **devices)


@pytest.mark.parametrize("kind", ["shm", "pinned"])
def test_rows_go_to_the_shard_and_partial_sums_come_back(kind):
    """A pinned slot whose sides are both on CPU is plain shared memory: no CUDA call."""
    made = DispatchSegment(spec(kind), create=True)
    stage = DispatchSegment(spec(kind), create=False, side="stage")
    shard = DispatchSegment(spec(kind), create=False, side="shard")
    try:
        hidden, ids, weights = torch.randn(3, 6), torch.tensor([[0, 5], [2, 1], [7, 3]]), torch.rand(3, 2)
        stage.write_rows(hidden, ids, weights)
        got_hidden, got_ids, got_weights = shard.read_rows(3, torch.device("cpu"), torch.bfloat16)
        assert torch.equal(got_hidden, hidden) and torch.equal(got_ids, ids)
        assert got_weights.dtype == torch.bfloat16 and torch.equal(got_weights, weights.to(torch.bfloat16))
        shard.write_out(2 * got_hidden)
        assert torch.equal(stage.read_out(3, torch.device("cpu")), 2 * hidden)
        for rows in (0, 5):
            with pytest.raises(SlotError, match=f"{rows} rows, it holds 1 to 4"):
                stage.write_rows(torch.zeros(rows, 6), torch.zeros(rows, 2, dtype=torch.long), torch.zeros(rows, 2))
    finally:
        for segment in (stage, shard, made):
            segment.close()
        made.unlink()


def test_between_hosts_each_side_keeps_its_copy_and_the_rows_and_sums_travel_as_frames():
    assert dispatch_kind("cpu", "cpu", same_host=False) == "tcp"
    stage = DispatchSegment(spec("tcp"), create=False, side="stage")
    shard = DispatchSegment(spec("tcp"), create=False, side="shard")
    try:
        assert not stage.path.exists()  # no shared memory between hosts
        hidden, ids, weights = torch.randn(3, 6), torch.tensor([[0, 5], [2, 1], [7, 3]]), torch.rand(3, 2)
        stage.write_rows(hidden, ids, weights)
        shard.fill_rows(3, [bytes(frame) for frame in stage.row_frames(3)])
        got_hidden, got_ids, got_weights = shard.read_rows(3, torch.device("cpu"), torch.float32)
        assert torch.equal(got_hidden, hidden) and torch.equal(got_ids, ids) and torch.equal(got_weights, weights)
        shard.write_out(got_hidden * 2)
        stage.fill_out(3, [bytes(shard.out_frame(3))])
        assert torch.equal(stage.read_out(3, torch.device("cpu")), hidden * 2)
        with pytest.raises(SlotError, match="frames of"):
            shard.fill_rows(3, [bytes(frame) for frame in stage.row_frames(2)])  # sizes of 2 rows, not 3
        with pytest.raises(SlotError, match="frames of"):
            stage.fill_out(3, [])
        with pytest.raises(SlotError, match="1 to 4"):
            stage.fill_out(5, [bytes(4 * 6 * 5)])
    finally:
        stage.close()
        shard.close()
