from __future__ import annotations

import pytest
import torch

from kvasir.errors import BatchError
from kvasir.model.kv_cache import PagedKVCache
from kvasir.stage.engine import StageEngine
from kvasir.wire.batch import BatchDescriptor, Row


def cache():
    return PagedKVCache(
        2, num_blocks=4, block_size=4, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu")
    )


def test_slots_follow_the_block_table():
    kv = cache()
    table = kv.extend(7, (2, 0))
    assert kv.slots(7, table, 2, 7).tolist() == [10, 11, 0, 1, 2]
    assert kv.extend(7, (3,)) == [2, 0, 3]
    kv.release([7, 99])
    assert kv.requests == 0
    assert kv.nbytes == PagedKVCache.bytes_needed(2, 4, 4, 1, 2, torch.float32)


def test_hostile_rows_are_refused():
    kv = cache()
    with pytest.raises(BatchError, match="block id 4 outside"):
        kv.extend(1, (4,))
    with pytest.raises(BatchError, match="block id -1 outside"):
        kv.extend(1, (-1,))
    table = kv.extend(1, (0,))
    with pytest.raises(BatchError, match="position 4 is past its 1 KV blocks"):
        kv.slots(1, table, 0, 5)
    with pytest.raises(BatchError, match="negative position -1"):
        kv.slots(1, table, -1, 1)  # would wrap round to the table's last block


def test_engine_refuses_inconsistent_descriptors(tiny_models, plan_for):
    plan, source = plan_for(tiny_models["llama"], [(0, 3), (3, 6)])
    head = StageEngine(plan, 0, source)
    good = BatchDescriptor(1, 0, 3, (Row(1, 0, 3, (0,), True),), (), (), 0)
    assert head.run(good, torch.tensor([5, 6, 7])).shape == (3, 64)
    lying = BatchDescriptor(2, 0, 4, (Row(2, 0, 3, (1,), True),), (), (), 0)
    with pytest.raises(BatchError, match="descriptor says 4"):
        head.run(lying, torch.tensor([5, 6, 7]))
    with pytest.raises(BatchError, match="input has 2"):
        head.run(BatchDescriptor(3, 0, 3, (Row(3, 0, 3, (1,), True),), (), (), 0), torch.tensor([5, 6]))
    with pytest.raises(BatchError, match="past its 1 KV blocks"):
        head.run(BatchDescriptor(4, 0, 1, (Row(1, 4, 1, (), True),), (), (), 0), torch.tensor([5]))
    empty = (Row(5, 0, 0, (), False), Row(6, 0, 1, (2,), True))
    with pytest.raises(BatchError, match="request 5: a row of 0 tokens"):
        head.run(BatchDescriptor(5, 0, 1, empty, (), (), 0), torch.tensor([5]))
    with pytest.raises(BatchError, match="request 7: negative position -1"):
        head.run(BatchDescriptor(6, 0, 1, (Row(7, -1, 1, (3,), True),), (), (), 0), torch.tensor([5]))
