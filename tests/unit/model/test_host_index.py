"""The per-batch indices a stage builds on the host (kvasir/model/host_index.py): the
values every layer uses, and the packing that moves them to an accelerator in one copy."""

from __future__ import annotations

import random

import torch

from kvasir.model.attention import build_batch
from kvasir.model.host_index import input_to, pack, to_device, unpack
from kvasir.model.kv_cache import PagedKVCache
from kvasir.model.paged_gather import GatherPlan
from kvasir.wire.batch import Row

BLOCK = 4
CPU = torch.device("cpu")


def rows_and_tables(rng: random.Random) -> tuple[tuple[Row, ...], dict[int, list[int]]]:
    """Decode rows and prompt chunks of requests with scattered block tables, as a head
    would announce them (each row brings the blocks its tokens need)."""
    free = list(range(64))
    rng.shuffle(free)
    rows, tables = [], {}
    for rid, (start, n) in enumerate([(0, 7), (13, 1), (30, 1), (9, 6), (5, 1), (0, 1)]):
        need = -(-(start + n) // BLOCK)
        tables[rid] = free[:need]
        del free[:need]
        rows.append(Row(rid, start, n, tuple(tables[rid]), emit=rid != 3))
    return tuple(rows), tables


def test_batch_indices_are_each_tokens_position_slot_and_row():
    rows, tables = rows_and_tables(random.Random(5))
    cache = PagedKVCache(2, 64, BLOCK, 1, 2, dtype=torch.float32, device=CPU)
    batch = build_batch(cache, 0, rows, scored={3})
    slot = [
        tables[r.request_id][p // BLOCK] * BLOCK + p % BLOCK
        for r in rows
        for p in range(r.start, r.start + r.num_tokens)
    ]
    assert batch.positions.tolist() == [p for r in rows for p in range(r.start, r.start + r.num_tokens)]
    assert batch.write_slots.tolist() == slot
    assert batch.emit_index.tolist() == [6, 7, 8, 15, 16]  # each emitting row's last packed token
    assert batch.score_index.tolist() == list(range(9, 15))  # every token of the scored row
    assert all(t.dtype == torch.long for t in (batch.positions, batch.write_slots, batch.emit_index))
    plan = GatherPlan.of(batch.rows, CPU)
    decode, chunks = plan.decode, plan.chunks
    assert decode is not None and decode.tokens.tolist() == [7, 8, 15, 16]
    assert decode.contexts == decode.lengths.tolist() == [14, 31, 6, 1]
    assert decode.read_slots.shape == (4, 31)
    for k, r in enumerate(row for row in rows if row.num_tokens == 1):
        context = [tables[r.request_id][p // BLOCK] * BLOCK + p % BLOCK for p in range(r.start + 1)]
        assert decode.read_slots[k].tolist() == context + [0] * (31 - len(context))  # padded with slot 0
    assert [c.read_slots.tolist() for c in chunks] == [
        [tables[r][p // BLOCK] * BLOCK + p % BLOCK for p in range(stop)] for r, stop in ((0, 7), (3, 15))
    ]


def test_packing_keeps_every_tensor_and_shape_and_cpu_stages_move_nothing():
    tensors = (torch.arange(5), torch.tensor([[3, 1], [4, 1], [5, 9]]), torch.tensor([], dtype=torch.long))
    flat = pack(tensors)
    assert flat.shape == (11,) and flat.dtype == torch.long
    back = unpack(flat, tensors)
    assert [t.shape for t in back] == [t.shape for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))
    assert all(a is b for a, b in zip(to_device(CPU, *tensors), tensors))  # a CPU stage uses them as built
    ids = torch.tensor([7, 8, 9])
    assert input_to(CPU, ids) is ids
